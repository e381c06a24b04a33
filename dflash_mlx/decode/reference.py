"""The speculative cycle at its plainest: one reply, greedy, a chain of a fixed block size.

A reader's way into the loop, written as mlx-lm's `speculative_generate_step` is. The loop
(`cycle.py`, `scheduler.py`) commits the same tokens in the same cycles (a test holds it to
that); what it adds serves speed and reach: several replies in one forward, trees, sizes
chosen by measured cost, sampling, logits processors, the next graph built while the
device computes, and a cycle undone where it fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx

from ..models.draft import DFlashDraft
from ..models.target import TargetAdapter


def reference_cycles(
    target: TargetAdapter,
    draft: DFlashDraft,
    prompt: list[int],
    max_tokens: int,
    block_size: int,
    eos: set[int] = frozenset(),
) -> Iterator[list[int]]:
    """Each cycle's committed tokens, the first the target's token after the prompt. A
    DFlash drafter (no candidate selector) proposes from the target's features."""
    target_cache, draft_cache = target.make_cache(), draft.make_cache()
    head = target.draft_head(draft.config.draft_vocab)
    taps = draft.config.target_layer_ids
    mask = draft.config.mask_token_id

    # Prefill all but the prompt's last token; the drafter keeps the features it sees.
    if len(prompt) > 1:
        forward = target.forward(
            mx.array(prompt[:-1])[None], [target_cache], taps=taps, prompt=True
        )
        draft.append_context(forward.features, [draft_cache])

    root, generated, n = prompt[-1], 0, 0  # the first cycle is a plain step: no drafts
    while True:
        # Draft: the drafter fills n mask positions after the root in one forward.
        drafts = mx.array([], dtype=mx.uint32)
        if n:
            block = mx.array([[root] + [mask] * n])
            logits = draft.draft_logits(block, target.embed_tokens, head, [draft_cache])
            drafts = mx.argmax(logits[0], axis=-1).astype(mx.uint32)

        # Verify: one target forward over [root, drafts...]; its choice at every position.
        tokens = mx.concatenate([mx.array([root], dtype=mx.uint32), drafts])
        forward = target.forward(tokens[None], [target_cache], taps=taps)
        choices = mx.argmax(forward.logits[0], axis=-1).tolist()

        # Accept the drafts that equal the target's choice, then the target's next token.
        drafts = drafts.tolist()
        accepted = 0
        while accepted < n and drafts[accepted] == choices[accepted]:
            accepted += 1
        committed = drafts[:accepted] + [choices[accepted]]

        # Forget the rejected positions; the drafter keeps the features of the kept ones.
        target.rollback(target_cache, n - accepted)
        draft.append_context(forward.features[:, : accepted + 1], [draft_cache])

        stop = next((i for i, t in enumerate(committed) if t in eos), None)
        if stop is not None:  # the reply ends at an EOS token, kept
            committed = committed[: stop + 1]
        yield committed
        generated += len(committed)
        if stop is not None or generated >= max_tokens:
            return
        root = committed[-1]
        # The next cycle verifies root + n drafts: no more than the tokens left to commit.
        n = min(block_size - 1, max_tokens - generated - 1)
