"""Stop strings: end a reply where one of them appears in its text, without emitting it.

Text arrives a verify cycle at a time, and a stop string can straddle two
cycles, so the tail that could still begin one is held back until the next
piece settles it. `generate --stop` and the server's `stop` field share this.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

from .response import GenerationResponse


class StopStrings:
    """Finds the first of `stops` in text fed piece by piece."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that is safe to emit now, and whether a stop string ended the reply.

        On a stop the text is cut just before it; otherwise the longest tail that
        is the start of a stop string is held back for the next piece.
        """
        text = self.held + text
        found = [i for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = max(
            (n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once the reply ended without a stop string."""
        text, self.held = self.held, ""
        return text


def stop_at_strings(
    responses: Generator[GenerationResponse, None, None], stops: list[str]
) -> Generator[GenerationResponse, None, None]:
    """`responses` with their text cut at the first stop string, ending there ("stop").

    The response that completes a stop string is the last one: its `tokens`
    still list everything that cycle committed, the text only what precedes it.
    """
    matcher = StopStrings(stops)
    if not matcher.stops:
        yield from responses
        return
    try:
        for response in responses:
            text, stopped = matcher.feed(response.text)
            if stopped:
                yield replace(response, text=text, finish_reason="stop")
                return
            if response.finish_reason is not None:
                text += matcher.flush()
            yield replace(response, text=text)
    finally:
        responses.close()
