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
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .chat_format import encode_prompt
from .decode.adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree
from .decode.cycle import Reply, ReplyState
from .decode.plan import choose_strategy, keep_learned, learned_policy, make_policy, plain_reason
from .decode.prompt_cache import PromptCache, make_prompt_cache
from .decode.proposers import DrafterProposer, LookupProposer, Proposer
from .decode.scheduler import Batch, replies
from .models.draft import DFlashDraft
from .models.target import TargetAdapter
from .response import RULE, Drafting, GenerationResponse, ReplyStats
from .settings import GenerationSettings

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
    **kwargs: Any,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash speculative decoding, one response per verify cycle.

    The drafter comes second, before mlx-lm's (tokenizer, prompt); `tokenizer` and `prompt`
    are required (their defaults only let mlx-lm's order get a clear error).
    The keyword arguments are `GenerationSettings`' fields, over `settings` if given:
    mlx-lm's `stream_generate` keywords (`max_tokens`, `sampler`, `logits_processors`,
    `max_kv_size`, `kv_bits`, `kv_group_size`, `quantized_kv_start`, `prefill_step_size`) keep
    their meanings. `prompt_progress_callback(processed, total)` is called as mlx-lm calls it:
    with 0 first, after each prefill chunk, and with `total` (the prompt tokens the prefill
    runs) once the first token is computed.

    `block_size` defaults to the drafter's; 1 means plain autoregressive decoding
    through the same loop; `draft=None` decodes so without paying for a drafter
    (no layer hooks, no drafter forwards). Sampling follows mlx-lm's
    `make_sampler` (greedy at temperature 0); a custom `sampler` maps
    log-probabilities to token ids.
    When sampling, `acceptance="coupled"` (the default) draws every position's token as
    argmax(log p + G_t) with noise G_t keyed by the reply's seed and the position alone,
    and drafts with the same noise, accepting a draft equal to the target's choice: exact
    in distribution, and the reply depends on the seed alone, whatever the cycles' shapes;
    `"speculative"` accepts a chain's drafts by speculative sampling; `"match"` only when a
    draft equals the target's own independent sample (also the rule for a custom `sampler`).
    `seed` gives the reply its own random stream instead of MLX's global state, so what
    else samples in between does not change it.
    `prompt_cache` (from `make_prompt_cache`) carries the caches across calls (made with its
    own cache settings, as in mlx-lm, where a given cache ignores `max_kv_size` and `kv_bits`):
    pass the whole conversation as `prompt`; only the new part is prefilled.
    By default (no `block_size`, `tree_budget` or `adaptive`) each cycle is a
    chain of any block size up to the drafter's or a tree of up to 16 nodes with
    the prompt lookup, whichever is expected to commit the most tokens per second
    from the acceptance and cycle times measured so far (`AdaptiveStrategy`); a
    target that cannot verify trees, or ranks under `mlx.launch`, get the adaptive
    chain. `adaptive=True` is that chain: each cycle's block size, up to
    `block_size`, chosen the same way (block 1 when drafting does not pay; see
    `decode/adaptive.py`). The output is the same either way; under the speculative and match
    rules, though, which random draws a sampled cycle consumes depends on its shape, so
    such runs cost chains and trees from fixed per-backend tables instead of the clock:
    a seeded sampled run stays reproducible. So does every run under `mlx.launch`, where
    all ranks must choose the same sizes (trees there never adapt). Each response's
    `drafting` says how the reply's cycles ran and, where drafting was off, why.
    `block_policy` (an `AdaptiveStrategy` or `AdaptiveBlock` for this block size,
    or an `AdaptiveTree` for this tree budget) keeps what adapting learned: pass
    the same one to successive calls with one target and drafter so that each
    starts from the last (a `prompt_cache` carries its own). Without either, a
    policy timed by the clock goes on from the last such call of this target and
    drafter, so a loop of calls explores once.
    `logits_processors` are mlx-lm's (`make_logits_processors`: penalties, logit
    bias), applied at every verified position to the tokens before it, so the
    output is still the target's own (greedy: mlx-lm's with the same processors).
    `tree_budget` verifies a tree of up to that many draft tokens per cycle
    instead of one chain (`models/tree.py`): the budget's most likely continuations
    under the drafter's per-position distributions (a DFlash 2 drafter's: its
    selector's, each token given the one before), up to `block_size` - 1 deep,
    all in one target forward (not for targets with recurrent layers). When
    sampling, a tree node is accepted when the target's own sample at its
    parent is its token (coupled: its choice under that position's noise; else an
    independent sample, the "match" rule); logits processors see each node's own path.
    With `adaptive` the budget is the largest tree: each cycle verifies the first b
    nodes that maximise the expected tokens per second, from the drafter's confidence
    in that cycle's nodes and the cycle times measured so far (`AdaptiveTree`). `prompt_lookup`
    grafts onto each tree what followed the last token where it occurred before
    in the prompt or the reply (`decode/lookup.py`), within the budget; without a drafter
    (`draft=None`), `tree_budget` verifies that chain alone, up to that deep
    (prompt lookup decoding).
    `batch` (a `scheduler.Batch` of this target and drafter) decodes the reply together with the
    other replies in it, each response arriving as the batch's cycles advance it (a
    server's concurrent requests); by default the reply is a batch of its own.
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
    if own_cache:
        prompt_cache = make_prompt_cache(model, draft, **settings.cache_options)
        prompt_cache.block_policy = learned_policy(model, draft)
    elif (draft is None) != (not prompt_cache.draft):
        raise ValueError("the prompt cache was made for a different drafter (or for none)")
    verifier = settings.verifier.for_reply()
    proposer: Proposer = Proposer()
    if draft is not None:
        proposer = DrafterProposer(draft, target, prompt_cache.draft, verifier.propose)
    # Each cycle chooses a chain or a tree (`AdaptiveStrategy`) by default, with a drafter,
    # where nothing keeps it from trees (`strategy_note`); elsewhere the default is the
    # adaptive chain.
    mixed, note = choose_strategy(settings, block_policy, draft, target, prompt_cache)
    if (settings.tree_budget or mixed) and settings.prompt_lookup:
        proposer = LookupProposer(prompt_ids, proposer)
    state = ReplyState(target, prompt_cache, proposer, verifier)
    policy, depth = make_policy(settings, draft, target, prompt_cache, block_policy, mixed)
    if own_cache and block_policy is None:
        keep_learned(model, draft, policy)
    max_drafts = settings.block_size - 1 if settings.block_size else None
    eos = set(tokenizer.eos_token_ids)
    reply = Reply(state, policy, prompt_ids, max_tokens, eos, depth, max_drafts)
    reply.prefill_step_size = settings.prefill_step_size
    reply.prompt_progress = prompt_progress_callback
    commits = replies(batch or Batch(target, draft), reply)
    drafting = Drafting(reason=plain_reason(settings, draft), note=note)
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
            for t in commit.tokens:
                if t not in eos:
                    detokenizer.add_token(t)
            if commit.finish:
                detokenizer.finalize()
            logits = commit.logits
            yield GenerationResponse(
                text=detokenizer.last_segment,
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
            )
    finally:
        commits.close()


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
