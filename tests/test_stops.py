"""Stop strings: the pure matcher, and `generate --stop` against mlx-lm's greedy text."""

import json
import random
import time

from test_cli import dflash_in_process, greedy_text

from dflash_mlx import GenerationResponse
from dflash_mlx.decode.stops import StopStrings, stop_at_strings


def stop_in(text: str, start: int = 6) -> str:
    """A 3-character stop string (letters, digits, spaces) first occurring in `text` past
    `start`."""
    for i in range(start, len(text) - 3):
        candidate = text[i : i + 3]
        plain = all(c.isascii() and (c.isalnum() or c == " ") for c in candidate)
        if plain and text.index(candidate) == i:
            return candidate
    raise AssertionError(f"no stop string to pick in {text!r}")


def test_a_stop_string_split_across_pieces_ends_the_text_before_it():
    matcher = StopStrings(["END", "\n\n"])
    fed = [matcher.feed(piece) for piece in ["hello E", "N", "x wor", "ld\n", "\nmore"]]
    assert fed == [("hello ", False), ("", False), ("ENx wor", False), ("ld", False), ("", True)]
    matcher = StopStrings(["abc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.flush() == "ab"  # the reply ended without the stop string: nothing is lost
    assert StopStrings([""]).feed("text") == ("text", False)  # an empty stop string is no stop


def test_the_matcher_agrees_with_a_search_of_the_whole_text():
    """Against `str.find` over all the text so far, on random pieces over a small alphabet
    (overlapping stop strings, stops within stops, pieces shorter and longer than them)."""
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randint(0, 6))) for _ in range(rng.randint(1, 4))]
        matcher, text, emitted = StopStrings(stops), "", ""
        for piece in ("".join(rng.choices("abc", k=rng.randint(0, 5))) for _ in range(8)):
            text += piece
            out, stopped = matcher.feed(piece)
            emitted += out
            if stopped:
                break
            assert text.startswith(emitted) and text == emitted + matcher.held
        found = [i for s in stops if s and (i := text.find(s)) >= 0]
        assert stopped == bool(found)
        if stopped:
            assert emitted == text[: min(found)]
        else:  # nothing held back is lost
            assert emitted + matcher.flush() == text


def test_cut_replies_keep_where_each_character_came_from():
    """Text from accepted drafts in upper case, the target's own in lower case: cut at stop
    strings and held back across cycles, each response's `sources` still tell them apart,
    and nothing is lost where no stop string ends the reply."""
    rng = random.Random(1)
    for _ in range(1000):
        stops = ["".join(rng.choices("aAbB", k=rng.randint(1, 4))) for _ in range(2)]
        cycles = []
        for i in range(6):
            drafted = "".join(rng.choices("AB", k=rng.randint(0, 4)))
            own = "".join(rng.choices("ab", k=rng.randint(0, 2)))
            sources = [(len(t), d) for t, d in ((drafted, True), (own, False)) if t]
            cycles.append(
                GenerationResponse(
                    drafted + own, [0], len(drafted), 4, 1, 0.0, i + 1, 0.0, 0.0,
                    finish_reason="length" if i == 5 else None, sources=sources,
                )
            )  # fmt: skip
        out = list(stop_at_strings((c for c in cycles), stops))
        for response in out:
            flags = [drafted for count, drafted in response.sources for _ in range(count)]
            assert flags == [c.isupper() for c in response.text]
        if out[-1].finish_reason == "length":
            assert "".join(r.text for r in out) == "".join(c.text for c in cycles)


def test_matching_time_is_linear_in_the_text_fed():
    """The most and longest stop strings the server takes, fed a character at a time: each
    text ends with 999 characters of every stop. Recomputing that from the held-back
    tail per piece took 6 s here; tracking it character by character, 0.03 s."""
    matcher = StopStrings(["a" * 999 + c for c in "bcdefghijklmnopq"])
    tic = time.perf_counter()
    assert all(matcher.feed("a") == ("a" * (n >= 999), False) for n in range(3000))
    assert time.perf_counter() - tic < 1.5


def test_generate_stop_cuts_greedy_output_at_the_earliest_stop_string(make_pair, loaded):
    target, draft = make_pair("llama-tied-gqa")
    reference, _ = greedy_text(loaded, "Alice has 3 apples", 40)
    early, late = stop_in(reference, 6), stop_in(reference, 14)
    flags = f"--stop '{late}' --stop '{early}' --block-size 4"
    command = f"generate --model {target} --draft {draft} --json -m 40 {flags}"
    out = dflash_in_process(command, "Alice has 3 apples")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["text"] == reference[: reference.index(early)]
    assert result["finish_reason"] == "stop"
