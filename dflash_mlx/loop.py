"""The speculative loop at the level of tokens, as mlx-lm's `generate_step` is for plain
decoding: prefill, then one step per cycle, yielding each cycle's commit.

A step (`steps.py`) launches a cycle on the last committed token and settles it
after the previous commit was yielded, so the consumer's work overlaps the
device's. The loop ends a reply at an EOS token (kept) or at `max_tokens`, and
drops a cycle a step queued past the end. It knows nothing of text, time or what
proposes the drafts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.generate import wired_limit

from .steps import Commit, Sequence, Step

PREFILL_STEP = 2048


def prefill(seq: Sequence, prompt: list[int], start: int) -> Commit:
    """Run the prompt from `start` through the target (the proposer observing every
    position) and commit the target's choice after it."""
    model, cache = seq.target.model, seq.cache
    every_cache = cache + seq.prompt_cache.draft
    # All but the last prompt token in chunks whose logits are never computed; then the
    # last one alone, as mlx-lm does: the LM head never sees more than one row.
    for chunk_start in range(start, len(prompt) - 1, PREFILL_STEP):
        chunk = prompt[chunk_start : min(chunk_start + PREFILL_STEP, len(prompt) - 1)]
        model(mx.array(chunk)[None], cache=cache)
        seq.keep(None)
        mx.eval([c.state for c in every_cache])
    logits = model(mx.array(prompt[-1:])[None], cache=cache)
    seq.keep(None)
    first = seq.verifier.verify(mx.array([], dtype=mx.uint32), None, logits[0, -1:], prompt)
    return Commit([first.token.item()], first.logits, prefilled=len(prompt) - start)


def generate_step(
    seq: Sequence,
    step: Step,
    prompt: list[int],
    max_tokens: int,
    eos: set[int],
) -> Iterator[Commit]:
    """Commits of one reply to `prompt`: the prefill's token first, then one per cycle;
    the last has its `finish` reason. The caches hold the prompt and the reply after,
    but for its last token (`prompt_cache.tokens` lists what they hold)."""
    prompt_cache = seq.prompt_cache
    reused = prompt_cache.reuse(prompt)
    with seq.capturing(), wired_limit(seq.target.model):
        commit = prefill(seq, prompt, reused)
        prompt_cache.tokens = list(prompt)
        started, generated = time.perf_counter(), 0
        while True:
            stop = next((i for i, t in enumerate(commit.tokens) if t in eos), None)
            if stop is not None:
                commit.tokens, commit.logits = commit.tokens[: stop + 1], commit.logits[: stop + 1]
            generated += len(commit.tokens)
            if commit.tokens[-1] in eos:
                commit.finish = "stop"
            elif generated >= max_tokens:
                commit.finish = "length"
            if commit.finish and commit.queued:  # queued on the token that ended the reply
                step.cancel(commit.queued)
            elif not commit.finish:
                seq.proposer.committed(commit.tokens)
                pending = commit.queued or step.launch(commit.tokens[-1], max_tokens - generated)
            yield commit
            if commit.finish:
                return
            commit = step.settle(pending, max_tokens - generated, started)
            started = time.perf_counter()
