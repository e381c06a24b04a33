"""Stop strings: end a reply where one of them appears in its text, without emitting it.

Text arrives a verify cycle at a time, and a stop string can straddle two
cycles, so the tail that could still begin one is held back until the next
piece settles it. `generate --stop` and the server's `stop` field share this.

Each piece costs time linear in its length plus the longest stop string's, however
long the reply: only the held-back tail (shorter than the longest stop string) is
searched again, and how much of each stop string the text ends with is kept up to
date character by character (Knuth-Morris-Pratt), not recomputed from the tail.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

from ..response import GenerationResponse, cut_sources


def borders(stop: str) -> list[int]:
    """KMP's failure table: for each prefix of `stop`, its longest proper prefix that is
    also its suffix."""
    table = [0] * len(stop)
    n = 0
    for i, c in enumerate(stop[1:], 1):
        while n and stop[n] != c:
            n = table[n - 1]
        if stop[n] == c:
            n += 1
        table[i] = n
    return table


def advance(stop: str, table: list[int], begun: int, text: str) -> int:
    """How many characters of `stop` the text ends with after `text` is appended to one
    that ended with `begun` of them (`table`: `borders(stop)`).

    The text must not contain `stop` whole: the caller has looked for it first.
    """
    for c in text:
        while begun and stop[begun] != c:
            begun = table[begun - 1]
        if stop[begun] == c:
            begun += 1
    return begun


class StopStrings:
    """Finds the first of `stops` in text fed piece by piece."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.tables = [borders(s) for s in self.stops]
        self.begun = [0] * len(self.stops)  # per stop: how much of it the text ends with
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that is safe to emit now, and whether a stop string ended the reply.

        On a stop the text is cut just before it; otherwise the longest tail that
        is the start of a stop string is held back for the next piece.
        """
        piece, text = text, self.held + text
        found = [i for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        self.begun = [
            advance(s, table, n, piece)
            for s, table, n in zip(self.stops, self.tables, self.begun, strict=True)
        ]
        keep = max(self.begun, default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once the reply ended without a stop string."""
        text, self.held = self.held, ""
        self.begun = [0] * len(self.stops)
        return text


def stop_at_strings(
    responses: Generator[GenerationResponse, None, None], stops: list[str]
) -> Generator[GenerationResponse, None, None]:
    """`responses` with their text cut at the first stop string, ending there ("stop").

    The response that completes a stop string is the last one: its `tokens`
    still list everything that cycle committed, the text only what precedes it. Each
    response's `sources` follow its text (held-back text keeps where it came from).
    """
    matcher = StopStrings(stops)
    if not matcher.stops:
        yield from responses
        return
    held: list[tuple[int, bool]] = []  # where the held-back text came from
    try:
        for response in responses:
            text, stopped = matcher.feed(response.text)
            sources, held = cut_sources(held + response.sources, len(text))
            if stopped:
                yield replace(response, text=text, finish_reason="stop", sources=sources)
                return
            if response.finish_reason is not None:
                text += matcher.flush()
                sources, held = sources + held, []
            yield replace(response, text=text, sources=sources)
    finally:
        responses.close()
