"""The DFlash speculative loop.

Each cycle the drafter proposes a block ([last committed token] + mask tokens →
block_size - 1 draft tokens) in one forward, conditioned on the target's
features of every committed position; the target verifies [last token] +
drafts in one forward; the longest prefix where the draft equals the target's
own choice is committed, plus the target's token after it. The target cache is
trimmed back to the committed positions and the verified features of those
positions become the drafter's new context. With greedy sampling the output is
exactly the target's own greedy output.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .adaptive import FIXED_CYCLE_COSTS, AdaptiveBlock, AdaptiveTree
from .distributed import world_group
from .draft import DFlashDraft
from .lookup import ContextLookup
from .rollback import keep_path, trim_caches
from .sampling import LogitsProcessor, Sampler, Verdict, Verifier, make_verifier
from .target import RestrictedHead, TargetAdapter
from .tree import (
    Tree,
    ancestor_mask,
    build_selector_tree,
    build_tree,
    graft,
    ranked_edges,
    top_candidates,
    walk,
)

PREFILL_STEP = 2048


@dataclass
class PendingTree:
    """A tree cycle's queued verify forward: the tree, the cache offset it starts at, the
    target's logits, its choices (None with logits processors: those are made during the
    walk) and the prompt lookup's chain tokens' nodes (`tree.graft`)."""

    tree: Tree
    start: int
    logits: mx.array
    choices: mx.array | None
    chain: list[int]


@dataclass
class GenerationResponse:
    """One verify cycle's output (the first response carries the prefill's token).

    Args:
        text: the new text segment.
        tokens: token ids committed in this cycle (an EOS that stopped generation included).
        accepted: draft tokens accepted in this cycle.
        proposed: draft tokens proposed in this cycle (block size - 1; 0 for the prefill).
        prompt_tokens, prompt_tps: prompt length and prefill speed.
        generation_tokens, generation_tps: tokens generated so far and their rate.
        peak_memory: peak memory so far in GB.
        finish_reason: None, "stop" (EOS) or "length" (max_tokens).
        logprobs: (len(tokens), vocab) the target's log-probabilities (after the logits
            processors, before temperature) at each token's position, as mlx-lm's
            `logprobs`; lazy, so computed only if read.
    """

    text: str
    tokens: list[int]
    accepted: int
    proposed: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    logprobs: mx.array | None = None

    @property
    def token(self) -> int:
        """The last committed token, as in mlx-lm's response."""
        return self.tokens[-1]


@dataclass
class PromptCache:
    """Target and drafter caches kept across calls, e.g. the turns of a chat.

    `tokens` are the positions both caches hold. A later prompt that starts with
    them is prefilled only from where it differs; anything beyond (a reply cut
    short, a re-rendered template) is trimmed away first. `block_policy` is what
    the adaptive block size (or tree size) learned so far, so the next call goes on from it.
    """

    target: list
    draft: list
    tokens: list[int] = field(default_factory=list)
    block_policy: AdaptiveBlock | AdaptiveTree | None = None

    def reuse(self, prompt: list[int]) -> int:
        """Trim both caches to the longest prefix shared with `prompt`; return its length.

        The length is 0 (a full prefill) when a recurrent or sliding-window cache
        cannot go back that far.
        """
        shared = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while shared < limit and self.tokens[shared] == prompt[shared]:
            shared += 1
        shared = trim_caches(self.target + self.draft, shared)
        self.tokens = self.tokens[:shared]
        return shared


def make_prompt_cache(model: nn.Module, draft: DFlashDraft | None) -> PromptCache:
    """An empty cache to pass as `prompt_cache=` to successive `stream_generate` calls."""
    return PromptCache(TargetAdapter(model).make_cache(), draft.make_cache() if draft else [])


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str | list[int] | mx.array) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif isinstance(prompt, mx.array):
        ids = prompt.reshape(-1).tolist()
    else:
        ids = list(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if not all(isinstance(t, int) for t in ids):
        raise ValueError("a token-id prompt must contain only integers")
    return ids


def check_compatible(target: TargetAdapter, draft: DFlashDraft) -> None:
    """Fail early, naming the mismatch, when a drafter was not made for this target."""
    cfg = draft.config
    n_layers = len(target.layers)
    out_of_range = [i for i in cfg.target_layer_ids if not 0 <= i < n_layers]
    if out_of_range:
        raise ValueError(
            f"drafter taps target layers {out_of_range}, but the target has {n_layers} layers"
        )
    n_features = len(cfg.target_layer_ids)
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter fc expects {n_features} target layers x hidden size {cfg.hidden_size} "
            f"= {n_features * cfg.hidden_size} features, but the target's hidden size is "
            f"{target.hidden_size} ({n_features * target.hidden_size} features)"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocab size {cfg.vocab_size} != target vocab size {target.vocab_size}"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
            f"(size {target.vocab_size})"
        )


def stream_generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    block_size: int | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Sampler | None = None,
    prompt_cache: PromptCache | None = None,
    acceptance: str = "speculative",
    adaptive: bool | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    tree_budget: int | None = None,
    block_policy: AdaptiveBlock | AdaptiveTree | None = None,
    prompt_lookup: bool = True,
) -> Iterator[GenerationResponse]:
    """Generate with DFlash speculative decoding, one response per verify cycle.

    `block_size` defaults to the drafter's; 1 means plain autoregressive decoding
    through the same loop; `draft=None` decodes so without paying for a drafter
    (no layer hooks, no drafter forwards). Sampling follows mlx-lm's
    `make_sampler` (greedy at temperature 0); a custom `sampler` maps
    log-probabilities to token ids.
    When sampling, `acceptance="speculative"` accepts drafts by speculative
    sampling (exact in distribution); `"match"` only when a draft equals the
    target's own sample (also the rule for a custom `sampler`).
    `prompt_cache` (from `make_prompt_cache`) carries the caches across calls:
    pass the whole conversation as `prompt`; only the new part is prefilled.
    `adaptive` picks each cycle's block size, up to `block_size`, to maximise
    the expected tokens per second from the acceptance and cycle times measured
    so far (block 1 when drafting does not pay; see `adaptive.py`); it is on by
    default when no `block_size` is given. The output is the same either way,
    but which random draws a sampled cycle consumes depends on its size, so a
    sampled run costs the sizes from a fixed per-backend table instead of the
    clock: a seeded sampled run stays reproducible. So does every run under
    `mlx.launch`, where all ranks must choose the same sizes (trees there never
    adapt).
    `block_policy` (an `AdaptiveBlock` for this block size, or an `AdaptiveTree`
    for this tree budget) keeps what adapting learned: pass the same one to
    successive calls with one target and drafter so that each starts from the
    last (a `prompt_cache` carries its own).
    `logits_processors` are mlx-lm's (`make_logits_processors`: penalties, logit
    bias), applied at every verified position to the tokens before it, so the
    output is still the target's own (greedy: mlx-lm's with the same processors).
    `tree_budget` verifies a tree of up to that many draft tokens per cycle
    instead of one chain (`tree.py`): the budget's most likely continuations
    under the drafter's per-position distributions (a DFlash 2 drafter's: its
    selector's, each token given the one before), up to `block_size` - 1 deep,
    all in one target forward (not for targets with recurrent layers). When
    sampling, a tree node is accepted when the target's own sample at its
    parent is its token (the "match" rule, exact whatever `acceptance` says);
    logits processors see each node's own path. With `adaptive` the budget is
    the largest tree: each cycle verifies the first b nodes that maximise the
    expected tokens per second, from the drafter's confidence in that cycle's
    nodes and the cycle times measured so far (`AdaptiveTree`). `prompt_lookup`
    grafts onto each tree what followed the last token where it occurred before
    in the prompt or the reply (`lookup.py`), within the budget; without a drafter
    (`draft=None`), `tree_budget` verifies that chain alone, up to that deep
    (prompt lookup decoding).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if draft is None and block_size not in (None, 1):
        raise ValueError(f"block_size {block_size} needs a drafter (without one it is 1)")
    if tree_budget is not None and tree_budget < 1:
        raise ValueError(f"tree_budget must be at least 1, got {tree_budget}")
    if tree_budget and draft is None and not prompt_lookup:
        raise ValueError("tree verification needs a drafter or the prompt lookup")
    timed = clock_may_choose(temperature, sampler)
    if adaptive is None:
        adaptive = block_size is None and not tree_budget
    elif adaptive and tree_budget and world_group() is not None:
        raise ValueError("adaptive tree sizes time each rank apart; they cannot run sharded")
    if block_size is None:
        block_size = draft.config.block_size if draft else 1
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if tree_budget and draft is None:
        block_size = tree_budget + 1  # the prompt lookup's chain alone, as deep as the budget
    target = TargetAdapter(model)
    if draft is not None:
        check_compatible(target, draft)
    prompt_ids = encode_prompt(tokenizer, prompt)
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the target's vocabulary")
    if target.max_context:
        if len(prompt_ids) >= target.max_context:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the target's context holds "
                f"{target.max_context}"
            )
        max_tokens = min(max_tokens, target.max_context - len(prompt_ids))
    verifier = make_verifier(
        temperature, top_p, top_k, min_p, sampler, acceptance, logits_processors
    )
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, draft)
    elif (draft is None) != (not prompt_cache.draft):
        raise ValueError("the prompt cache was made for a different drafter (or for none)")
    if tree_budget:
        target.check_tree(prompt_cache.target)
    wanted = ("tree budget", tree_budget) if tree_budget else ("block size", block_size)
    if block_policy is not None and policy_setting(block_policy) != wanted:
        made_for = " ".join(map(str, policy_setting(block_policy)))
        raise ValueError(
            f"the block policy was made for {made_for}, not {' '.join(map(str, wanted))}"
        )
    if isinstance(block_policy, AdaptiveBlock) and block_policy.timed != timed:
        made_for = "greedy decoding" if block_policy.timed else "sampling"
        raise ValueError(f"the block policy was made for {made_for}: make a new one")
    policy = None
    if adaptive and block_size > 1:
        kept = block_policy or prompt_cache.block_policy
        if kept is None or policy_setting(kept) != wanted or getattr(kept, "timed", timed) != timed:
            kept = AdaptiveTree(tree_budget) if tree_budget else new_block_policy(block_size, timed)
        policy = prompt_cache.block_policy = kept
    return _speculate(
        target,
        draft,
        prompt_cache,
        tokenizer,
        prompt_ids,
        block_size,
        policy,
        max_tokens,
        verifier,
        tree_budget,
        prompt_lookup,
    )


def clock_may_choose(temperature: float, sampler: Sampler | None) -> bool:
    """Whether measured times may choose the block sizes: only where the sizes change
    nothing but speed. A sampled cycle consumes random draws by its size, and ranks in
    lockstep (`mlx.launch`) must choose alike; both cost the sizes from a fixed table."""
    return temperature == 0 and sampler is None and world_group() is None


def new_block_policy(block_size: int, timed: bool) -> AdaptiveBlock:
    """A block policy costing sizes by the clock, or by the backend's fixed table."""
    if timed:
        return AdaptiveBlock(block_size)
    backend = "cpu" if mx.default_device() == mx.cpu else "gpu"
    return AdaptiveBlock(block_size, fixed_costs=FIXED_CYCLE_COSTS[backend])


def policy_setting(policy: AdaptiveBlock | AdaptiveTree) -> tuple[str, int]:
    """What a policy was made for: ("block size", n) or ("tree budget", n)."""
    if isinstance(policy, AdaptiveTree):
        return "tree budget", policy.max_budget
    return "block size", policy.block_size


def _speculate(
    target: TargetAdapter,
    draft: DFlashDraft | None,
    prompt_cache: PromptCache,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    block_size: int,
    policy: AdaptiveBlock | AdaptiveTree | None,
    max_tokens: int,
    verifier: Verifier,
    tree_budget: int | None = None,
    prompt_lookup: bool = True,
) -> Iterator[GenerationResponse]:
    model, cfg = target.model, draft.config if draft else None
    cache, draft_cache = prompt_cache.target, prompt_cache.draft
    reused = prompt_cache.reuse(prompt)
    eos = set(tokenizer.eos_token_ids)
    draft_head = target.draft_head(cfg.draft_vocab) if cfg else None
    # A tree only ranks the drafter's tokens: over a draft vocabulary, its columns alone.
    restricted = isinstance(draft_head, RestrictedHead)
    tree_head = draft_head.rows if restricted else draft_head
    tree_vocab = draft_head.token_ids if restricted else None
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    capture = target.capture(cfg.target_layer_ids, cache) if cfg else nullcontext({})
    lookup = ContextLookup(prompt) if tree_budget and prompt_lookup else None

    with capture as captured, wired_limit(model):

        def append_context(positions: int | list[int] | None) -> None:
            """Feed the drafter the captured features of the last forward's first `positions`
            (or, after a tree, of the accepted path's nodes)."""
            if draft is not None:
                features = mx.concatenate([captured[i] for i in cfg.target_layer_ids], axis=-1)
                rows = mx.array(positions) if isinstance(positions, list) else slice(positions)
                draft.append_context(features[:, rows], draft_cache)

        def launch(last_id: mx.array, n: int) -> tuple[mx.array, Verdict]:
            """Queue a cycle's draft and verify forwards on the last committed token (on the
            device: it may not have been read yet); the host goes on meanwhile."""
            context = prompt_cache.tokens + last_id.tolist() if verifier.processors else None
            if n > 1:
                block = mx.concatenate([last_id, mx.full((n - 1,), cfg.mask_token_id)])
                drafts, draft_logprobs = draft.propose(
                    block, target.embed_tokens, draft_head, draft_cache, verifier.propose, context
                )
                verify = mx.concatenate([last_id, drafts.astype(last_id.dtype)])
            else:
                drafts, draft_logprobs, verify = mx.array([], dtype=mx.uint32), None, last_id
            logits = target.forward(verify, cache)
            verdict = verifier.verify(drafts, draft_logprobs, logits, context)
            mx.async_eval(drafts, verdict.choices, verdict.matches)
            return drafts, verdict

        # The tree cycle (`tree_budget`): draft, build the tree, verify all its nodes at once;
        # then walk the target's choices and keep the accepted path in the caches.

        def drafted_tree(last: int, n: int) -> Tree:
            """The drafter's tree of up to `tree_budget` nodes after `last`, n - 1 deep."""
            block = mx.concatenate([mx.array([last]), mx.full((n - 1,), cfg.mask_token_id)])
            if "candidate_selector" in draft:  # DFlash 2: scored as its selector walks
                parts = block, target.embed_tokens, draft_head, draft_cache
                return build_selector_tree(
                    last, *ranked_edges(*draft.selector_edges(*parts)), tree_budget
                )
            logits = draft.draft_logits(block, target.embed_tokens, tree_head, draft_cache)
            return build_tree(last, *top_candidates(logits, tree_budget, tree_vocab), tree_budget)

        def launch_tree(last: int, n: int) -> PendingTree:
            """The tree's verify forward, queued, and what its walk needs (`PendingTree`).

            A tree is at most `tree_budget` deep: the drafter drafts no further. The prompt
            lookup's chain (`lookup.py`) is grafted on (without a drafter, it is the tree); the
            policy, if any, keeps the tree's first nodes only."""
            tree, n, chain = Tree([last], [-1], [0]), min(n, tree_budget + 1), []
            if n > 1:
                if draft is not None:
                    tree = drafted_tree(last, n)
                if lookup:
                    tree, chain = graft(tree, *lookup.proposal(n - 1), tree_budget)
                if policy:
                    tree = tree.first(policy.budget(tree.probabilities()) + 1)
                    chain = [node if node < len(tree) else -1 for node in chain]
            start = cache[0].offset
            with target.tree_attention(cache, tree.depths, ancestor_mask(tree.parents)):
                logits = target.forward(mx.array(tree.tokens), cache)
            # The target's own choice at every node: its argmax, or its sample (a node is then
            # accepted when the target's sample at its parent is the node's token: every
            # committed token is the target's own sample, so the output is exact in distribution).
            # Logits processors see each node's own path: its choice is made during the walk.
            choices = None if verifier.processors else verifier.propose(logits)[0]
            mx.async_eval(logits if choices is None else choices)
            return PendingTree(tree, start, logits, choices, chain)

        def settle_tree(pending: PendingTree) -> tuple[list[int], mx.array, int, int]:
            """Commit the accepted path: (tokens, their logits, accepted, proposed)."""
            tree, logits = pending.tree, pending.logits
            processed: dict[int, mx.array] = {}

            def choose_processed(node: int) -> int:
                context = prompt_cache.tokens + [tree.tokens[n] for n in tree.path(node)]
                row = verifier.process(logits[node : node + 1], context, mx.array([], mx.uint32))
                processed[node] = row
                return verifier.propose(row)[0].item()

            choices = pending.choices
            path, after = walk(
                tree, choose_processed if choices is None else choices.tolist().__getitem__
            )
            if processed:
                logits = mx.concatenate([processed[node] for node in path])
            else:
                logits = logits[mx.array(path)]
            if lookup:
                lookup.record(pending.chain, path)
            keep_path(cache, pending.start, path)
            append_context(path)
            tokens = [tree.tokens[node] for node in path]
            prompt_cache.tokens.extend(tokens)
            return tokens[1:] + [after], logits, len(path) - 1, len(tree) - 1

        tic = time.perf_counter()
        # All but the last prompt token in chunks whose logits are never computed; then the
        # last one alone, as mlx-lm does: the LM head never sees more than one row.
        for start in range(reused, len(prompt) - 1, PREFILL_STEP):
            chunk = prompt[start : min(start + PREFILL_STEP, len(prompt) - 1)]
            model(mx.array(chunk)[None], cache=cache)
            append_context(None)
            mx.eval([c.state for c in cache + draft_cache])
        logits = model(mx.array(prompt[-1:])[None], cache=cache)
        append_context(None)
        first = verifier.verify(mx.array([], dtype=mx.uint32), None, logits[0, -1:], prompt)
        committed, committed_logits = first.choices.tolist(), first.logits
        prompt_tps = (len(prompt) - reused) / (time.perf_counter() - tic)
        prompt_cache.tokens = list(prompt)
        tic = synced = time.perf_counter()
        generated, accepted, proposed = 0, 0, 0
        queued = None  # (n, the cycle): launched before the plain step before it was read

        def next_block_size(generated: int) -> int:
            return min(policy.next_block_size() if policy else block_size, max_tokens - generated)

        while True:
            stop = next((i for i, t in enumerate(committed) if t in eos), None)
            if stop is not None:
                committed, committed_logits = committed[: stop + 1], committed_logits[: stop + 1]
            generated += len(committed)
            finish = (
                "stop" if committed[-1] in eos else "length" if generated >= max_tokens else None
            )
            if finish and queued:  # queued on the token that ended the reply: drop its work
                target.rollback(cache, queued[0])
            elif not finish and tree_budget:
                if lookup:
                    lookup.extend(committed)
                n = block_size if not policy or policy.draft_next() else 1
                pending_tree = launch_tree(committed[-1], min(n, max_tokens - generated))
            elif queued:
                n, (drafts, verdict) = queued
            elif not finish:
                n = next_block_size(generated)
                drafts, verdict = launch(mx.array(committed[-1:]), n)
            for t in committed:
                if t not in eos:
                    detokenizer.add_token(t)
            if finish:
                detokenizer.finalize()
            yield GenerationResponse(
                text=detokenizer.last_segment,
                tokens=committed,
                accepted=accepted,
                proposed=proposed,
                prompt_tokens=len(prompt),
                prompt_tps=prompt_tps,
                generation_tokens=generated,
                generation_tps=generated / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                logprobs=committed_logits - mx.logsumexp(committed_logits, axis=-1, keepdims=True),
            )
            if finish:
                return
            if tree_budget:
                committed, committed_logits, accepted, proposed = settle_tree(pending_tree)
                if policy:
                    policy.record(
                        pending_tree.tree.probabilities(), accepted, time.perf_counter() - synced
                    )
                synced = time.perf_counter()
                continue

            queued = None
            if n == 1 and generated < max_tokens - 1 and not verifier.processors:
                # A plain step keeps its input position whatever token it computes: book it
                # and queue the next cycle on that token (still on the device) before the
                # host reads it, as mlx-lm's decoding does, so that on a GPU building the next
                # graph overlaps this step's computation.
                target.rollback(cache, 0)
                append_context(1)
                prompt_cache.tokens.extend(committed[-1:])
                size = next_block_size(generated + 1)
                queued = size, launch(verdict.choices[:1].astype(mx.int32), size)
            draft_ids, match_flags = drafts.tolist(), verdict.matches.tolist()
            proposed, accepted = n - 1, 0
            while accepted < proposed and match_flags[accepted]:
                accepted += 1
            if policy:
                policy.record(n, accepted + 1, time.perf_counter() - synced)
            synced = time.perf_counter()
            if not queued:
                target.rollback(cache, n - accepted - 1)
                append_context(accepted + 1)
                prompt_cache.tokens.extend(committed[-1:] + draft_ids[:accepted])
            committed = draft_ids[:accepted] + [verdict.token_after(accepted)]
            committed_logits = verdict.logits[: accepted + 1]


def generate(
    model: nn.Module,
    draft: DFlashDraft | None,
    tokenizer: TokenizerWrapper,
    prompt: str | list[int] | mx.array,
    verbose: bool = False,
    **kwargs,
) -> str:
    """The whole generated text; with `verbose`, stream it and print stats like mlx-lm."""
    text, cycles, accepted, proposed = "", 0, 0, 0
    response = None
    for response in stream_generate(model, draft, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
        cycles += 1
        accepted += response.accepted
        proposed += response.proposed
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        tau = (response.generation_tokens - 1) / max(cycles - 1, 1)
        rate = accepted / max(proposed, 1)
        print(f"Acceptance: {tau:.2f} tokens per cycle, {rate:.1%} of draft tokens accepted")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
