"""Streaming DFlash speculative decoding: `stream_generate` turns the loop's commits
(`decode/scheduler.py`) into text, timings and `GenerationResponse`s, as mlx-lm's
`stream_generate` does over its `generate_step`.

Each cycle the drafter proposes a block ([last committed token] + mask tokens →
block_size - 1 draft tokens) in one forward, conditioned on the target's
features of every committed position; the target verifies [last token] +
drafts in one forward; the longest prefix where the draft equals the target's
own choice is committed, plus the target's token after it. With greedy sampling
the output is exactly the target's own greedy output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper

from .chat_format import encode_prompt
from .decode.adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree
from .decode.cycle import Reply, ReplyState
from .decode.plan import keep_learned, learned_policy, resolve
from .decode.prompt_cache import PromptCache, make_prompt_cache
from .decode.proposers import DrafterProposer, LookupProposer, Proposer
from .decode.scheduler import Batch, replies
from .decode.settings import GenerationSettings
from .models.draft import DFlashDraft
from .models.mtp import MTPDraft, MTPRow
from .models.target import TargetAdapter
from .response import RULE, Drafting, GenerationResponse, ReplyStats

__all__ = ["GenerationResponse", "PromptCache", "generate", "make_prompt_cache", "stream_generate"]


def stream_generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer: TokenizerWrapper | None = None,
    prompt: str | list[int] | mx.array | None = None,
    block_size: int | None = None,
    *,
    settings: GenerationSettings | None = None,
    prompt_cache: PromptCache | None = None,
    block_policy: AdaptiveBlock | AdaptiveTree | AdaptiveStrategy | None = None,
    batch: Batch | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    input_embeddings: mx.array | None = None,
    **kwargs: Any,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash speculative decoding, one response per verify cycle.

    The drafter comes second, before mlx-lm's (tokenizer, prompt); `tokenizer` and `prompt`
    are required (their defaults only let mlx-lm's order get a clear error); `draft=None`
    decodes without one (no layer hooks, no drafter forwards). The keyword arguments are
    `GenerationSettings`' fields, over `settings` if given; mlx-lm's keywords (`max_tokens`,
    `sampler`, `logits_processors`, `max_kv_size`, `kv_bits`, `kv_group_size`,
    `quantized_kv_start`, `prefill_step_size`) keep their meanings, and greedy output is
    mlx-lm's token for token. `prompt_progress_callback(processed, total)` is called as
    mlx-lm calls it. What each cycle verifies (chains, trees, sizes chosen by measured cost)
    is resolved once from the settings (`decode/plan.resolve`); docs/api.md says how, and how
    sampled drafts are accepted.

    `prompt_cache` (from `make_prompt_cache`) carries the caches across calls: pass the whole
    conversation as `prompt`; only the new part is prefilled. `block_policy` (an adaptive
    policy of `decode/adaptive.py`) keeps what adapting learned across calls with one target
    and drafter (a `prompt_cache` carries its own; without either, a clock-timed policy goes
    on from the last such call). `batch` (`make_batch`) decodes the reply together with the
    batch's other replies; by default the reply is a batch of its own. Each response's
    `drafting` says how the reply's cycles ran and, where drafting was off, why.

    `input_embeddings` (one row per prompt token, as mlx-lm's) are what the prefill runs in
    place of the prompt's token embeddings: the rows a model's `embed_inputs` made of its
    images (`images.image_prompt`). The prompt's last token runs from its id, as the first
    cycle's root, and the reply is drafted and verified from token ids as usual.
    """
    check_argument_order(draft, tokenizer, prompt)
    if block_size is not None:
        kwargs["block_size"] = block_size
    settings = (settings or GenerationSettings()).but(**kwargs)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    target = TargetAdapter(model)
    prompt_ids = encode_prompt(tokenizer, prompt)
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the target's vocabulary")
    max_tokens = settings.max_tokens
    if target.max_context:
        if len(prompt_ids) >= target.max_context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the target's context holds "
                f"{target.max_context}"
            )
        max_tokens = min(max_tokens, target.max_context - len(prompt_ids))
    own_cache = prompt_cache is None
    if input_embeddings is not None:
        check_embeddings(input_embeddings, len(prompt_ids), own_cache)
    if own_cache:
        prompt_cache = make_prompt_cache(model, draft, **settings.cache_options)
    elif (draft is None) != (not prompt_cache.draft):
        raise ValueError("the prompt cache was made for a different drafter (or for none)")
    kept = learned_policy(model, draft) if own_cache else prompt_cache.block_policy
    plan = resolve(settings, draft, target, prompt_cache.target, block_policy, kept)
    if plan.adapts:  # the cache's next call goes on from what this one learns
        prompt_cache.block_policy = plan.policy
    if own_cache and block_policy is None:
        keep_learned(model, draft, plan.policy)
    verifier = settings.verifier.for_reply()
    proposer: Proposer = Proposer()
    if draft is not None:  # the MTP layers read the reply's tokens beside their caches
        rows = MTPRow(prompt_cache) if isinstance(draft, MTPDraft) else prompt_cache.draft
        proposer = DrafterProposer(draft, target, rows, verifier.propose)
    if plan.lookup:
        proposer = LookupProposer(prompt_ids, proposer)
    state = ReplyState(target, prompt_cache, proposer, verifier)
    reply = Reply(state, plan, prompt_ids, max_tokens, set(tokenizer.eos_token_ids))
    reply.prefill_step_size = settings.prefill_step_size
    reply.prompt_progress = prompt_progress_callback
    reply.embeddings = input_embeddings
    commits = replies(batch or Batch(target, draft), reply)
    drafting = Drafting(reason=plan.plain_reason, note=plan.note)
    return stream(commits, tokenizer, len(prompt_ids), drafting)


def check_argument_order(draft: Any, tokenizer: Any, prompt: Any) -> None:
    """Raise a one-line TypeError for mlx-lm's argument order (no drafter) or a missing
    tokenizer or prompt."""
    if draft is not None and not isinstance(draft, nn.Module):
        raise TypeError(
            f"the drafter goes second: stream_generate(model, draft, tokenizer, prompt), or "
            f"draft=None for plain decoding (got a {type(draft).__name__} as the drafter)"
        )
    if tokenizer is None or prompt is None:
        missing = "tokenizer" if tokenizer is None else "prompt"
        raise TypeError(
            f"no {missing} given: stream_generate(model, draft, tokenizer, prompt) "
            "(draft=None for plain decoding)"
        )


def check_embeddings(embeddings: mx.array, prompt_tokens: int, own_cache: bool) -> None:
    """Raise a one-line ValueError where `input_embeddings` cannot be prefilled."""
    if embeddings.ndim != 2 or embeddings.shape[0] != prompt_tokens:
        raise ValueError(
            f"input_embeddings must hold one row per prompt token ({prompt_tokens}), "
            f"got shape {tuple(embeddings.shape)}"
        )
    if not own_cache:  # a cache's prompt is matched by token ids, which images share
        raise ValueError("input_embeddings (image prompts) cannot go on from a prompt cache")


def stream(
    commits: Iterator,
    tokenizer: TokenizerWrapper,
    prompt_tokens: int,
    drafting: Drafting | None = None,
) -> Iterator[GenerationResponse]:
    """The loop's commits as text and timed responses, each with the reply's `drafting`
    so far (the same object, updated as cycles come)."""
    drafting = drafting or Drafting()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    eos = set(tokenizer.eos_token_ids)
    tic = time.perf_counter()
    prompt_tps, generated = 0.0, 0
    # however this ends (a failure detokenizing too), the reply leaves its batch now, not
    # when a traceback holding this frame is freed
    try:
        for commit in commits:
            if not generated:  # the prefill's commit
                prompt_tps = commit.prefilled / (time.perf_counter() - tic)
                tic = time.perf_counter()
            else:
                last = commit.finish is not None
                drafting.record(commit.proposed, commit.accepted, commit.tree, last, commit.rows)
            generated += len(commit.tokens)
            # the text the cycle's accepted drafts make readable, then its own token's
            drafted = min(commit.accepted, len(commit.tokens))
            add_tokens(detokenizer, commit.tokens[:drafted], eos)
            from_drafts = detokenizer.last_segment
            add_tokens(detokenizer, commit.tokens[drafted:], eos)
            if commit.finish:
                detokenizer.finalize()
            own = detokenizer.last_segment
            logits = commit.logits
            yield GenerationResponse(
                text=from_drafts + own,
                tokens=commit.tokens,
                accepted=commit.accepted,
                proposed=commit.proposed,
                prompt_tokens=prompt_tokens,
                prompt_tps=prompt_tps,
                generation_tokens=generated,
                generation_tps=generated / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=commit.finish,
                logprobs=logits - mx.logsumexp(logits, axis=-1, keepdims=True),
                drafting=drafting,
                sources=[(len(t), d) for t, d in ((from_drafts, True), (own, False)) if t],
            )
    finally:
        commits.close()


def add_tokens(detokenizer: StreamingDetokenizer, tokens: list[int], eos: set[int]) -> None:
    """Add `tokens` to the reply's text, but the EOS tokens (never shown)."""
    for t in tokens:
        if t not in eos:
            detokenizer.add_token(t)


def generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer: TokenizerWrapper | None = None,
    prompt: str | list[int] | mx.array | None = None,
    verbose: bool = False,
    **kwargs: Any,
) -> str:
    """The whole generated text; with `verbose`, stream it and print stats like mlx-lm, and
    a line on what drafting did. The arguments are `stream_generate`'s."""
    stats = ReplyStats()
    if verbose:
        print(RULE)
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        stats.add(response)
    if verbose:
        print()
        print(stats.verbose_report())
    return stats.text


if __name__ == "__main__":
    from .cli import run_as_module

    run_as_module("generate")
