"""What each cycle of a reply verifies, resolved once from its settings: a policy.

A policy answers `plan()` before a cycle (a `Plan`: so many drafts, as a chain or a
tree), `fit`s a drafted tree to the nodes worth verifying, and `record`s what the cycle
verified, accepted and cost. A fixed block size or tree budget is a `FixedPlan`; the
adaptive ones (`adaptive.py`) choose by measured cost: `AdaptiveBlock` chains,
`AdaptiveTree` tree sizes, and `AdaptiveStrategy`, the library's default, either.

Cycles shared by several replies cost more per position than a reply's own, so they are
planned by a policy of the batch for that many rows (`scheduler.ByWidth`), which measures
the shared cycles' costs as a reply's own policy measures its cycles.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from ..models.distributed import world_group
from ..models.draft import DFlashDraft
from ..models.target import TargetAdapter
from ..settings import GenerationSettings
from .adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree, Cycle, Plan
from .prompt_cache import PromptCache


class Policy(Protocol):
    def plan(self) -> Plan:
        """What the next cycle verifies."""

    def fit(self, probabilities: list[float]) -> int:
        """How many of a drafted tree's nodes (path probabilities, best first) to verify."""

    def record(self, cycle: Cycle) -> None:
        """One finished cycle."""


@dataclass
class FixedPlan:
    """Every cycle the same: a chain of `drafts` drafts (0: plain steps) or a whole tree of
    up to that many nodes."""

    fixed: Plan

    def plan(self) -> Plan:
        return self.fixed

    def fit(self, probabilities: list[float]) -> int:
        return len(probabilities)

    def record(self, cycle: Cycle) -> None:
        pass


ADAPTIVE = (AdaptiveBlock, AdaptiveTree, AdaptiveStrategy)


def settings_unset(settings: GenerationSettings, block_policy: Policy | None) -> bool:
    """Whether the reply runs the library's default (nothing of its strategy set)."""
    unset = settings.block_size is None and not settings.tree_budget and block_policy is None
    return unset and settings.adaptive is None


def plain_reason(settings: GenerationSettings, draft: DFlashDraft | None) -> str:
    """Why a cycle of this reply would verify no draft."""
    if draft is None:
        return "no drafter"
    if settings.block_size == 1:
        return "block size 1 asked for"
    return "drafting did not pay here (measured cycle costs and acceptance)"


def strategy_note(
    draft: DFlashDraft | None, target: TargetAdapter, prompt_cache: PromptCache
) -> str | None:
    """Why the default runs adaptive chains instead of choosing chains or trees, in words
    (None: no drafter, or nothing kept it from trees)."""
    if draft is None:
        return None
    if draft.config.block_size < 2:
        return "the drafter's block holds no draft"
    if world_group() is not None:
        return "sharded (mlx.launch): adaptive chains, no trees"
    try:
        target.check_tree(prompt_cache.target)
    except ValueError as exc:
        return f"chains only: {exc}"
    return None


def choose_strategy(
    settings: GenerationSettings,
    block_policy: Policy | None,
    draft: DFlashDraft | None,
    target: TargetAdapter,
    prompt_cache: PromptCache,
) -> tuple[bool, str | None]:
    """Whether each cycle chooses a chain or a tree (the default with a drafter, where nothing
    keeps it from trees), and why the default runs chains only where something does."""
    default = settings_unset(settings, block_policy)
    note = strategy_note(draft, target, prompt_cache) if default else None
    mixed = isinstance(block_policy, AdaptiveStrategy) or (
        default and draft is not None and note is None
    )
    return mixed, note


def new_policy(
    settings: GenerationSettings,
    draft: DFlashDraft | None,
    target: TargetAdapter,
    prompt_cache: PromptCache,
) -> AdaptiveBlock | AdaptiveTree | AdaptiveStrategy | None:
    """The adaptive policy a reply under `settings` would start with (None: it would not
    adapt), for a caller that carries one from reply to reply
    (`stream_generate(block_policy=...)`), as the bench does."""
    mixed, _ = choose_strategy(settings, None, draft, target, prompt_cache)
    policy = make_policy(settings, draft, target, prompt_cache, None, mixed)[0]
    return policy if isinstance(policy, ADAPTIVE) else None


def make_policy(
    settings: GenerationSettings,
    draft: DFlashDraft | None,
    target: TargetAdapter,
    prompt_cache: PromptCache,
    block_policy: Policy | None,
    mixed: bool = False,
) -> tuple[Policy, int]:
    """The policy `settings` ask for and how deep a tree may go, or a one-line ValueError.
    Adapting, the policy is `block_policy` if given, else the prompt cache's, else a new
    one (kept in the prompt cache for the next call); with `mixed` (the default where
    nothing keeps it from trees), chains or trees each cycle."""
    if mixed:
        return _strategy(settings, draft, prompt_cache, block_policy), draft.config.block_size - 1
    tree_budget, block_size = settings.tree_budget, settings.block_size
    if draft is None and block_size not in (None, 1):
        raise ValueError(f"block_size {block_size} needs a drafter (without one it is 1)")
    if tree_budget and draft is None and not settings.prompt_lookup:
        raise ValueError("tree verification needs a drafter or the prompt lookup")
    adaptive = settings.adaptive
    if adaptive is None:
        adaptive = block_size is None and not tree_budget
    elif adaptive and tree_budget and world_group() is not None:
        raise ValueError("adaptive tree sizes time each rank apart; they cannot run sharded")
    if block_size is None:
        block_size = draft.config.block_size if draft else 1
    if tree_budget and draft is None:
        block_size = tree_budget + 1  # the prompt lookup's chain alone, as deep as the budget
    if tree_budget:
        target.check_tree(prompt_cache.target)
    wanted = ("tree budget", tree_budget) if tree_budget else ("block size", block_size)
    if isinstance(block_policy, ADAPTIVE) and block_policy.setting != wanted:
        raise ValueError(
            f"the block policy was made for {' '.join(map(str, block_policy.setting))}, "
            f"not {' '.join(map(str, wanted))}"
        )
    if isinstance(block_policy, AdaptiveBlock) and block_policy.timed != settings.timed:
        made_for = "greedy decoding" if block_policy.timed else "sampling"
        raise ValueError(f"the block policy was made for {made_for}: make a new one")
    fixed = FixedPlan(Plan(tree_budget, True) if tree_budget else Plan(block_size - 1))
    if not adaptive or block_size == 1:
        return fixed, block_size - 1
    kept = block_policy or prompt_cache.block_policy
    stale = not isinstance(kept, ADAPTIVE) or kept.setting != wanted
    if stale or getattr(kept, "timed", settings.timed) != settings.timed:
        kept = settings.new_policy(block_size)
    prompt_cache.block_policy = kept
    return kept, block_size - 1


def _strategy(
    settings: GenerationSettings,
    draft: DFlashDraft,
    prompt_cache: PromptCache,
    block_policy: Policy | None,
) -> AdaptiveStrategy:
    """Chains or trees each cycle: an `AdaptiveStrategy` for the drafter's block (the given
    one, else the prompt cache's, else a new one)."""
    block_size = draft.config.block_size
    if block_policy is not None:
        if block_policy.block_size != block_size:
            raise ValueError(
                f"the block policy was made for {' '.join(map(str, block_policy.setting))}, "
                f"not the drafter's block size {block_size}"
            )
        if settings.block_size is not None or settings.tree_budget or settings.adaptive:
            raise ValueError("a policy of chains and trees takes no block size or tree budget")
        if block_policy.timed != settings.timed:
            made_for = "greedy decoding" if block_policy.timed else "sampling"
            raise ValueError(f"the block policy was made for {made_for}: make a new one")
    kept = block_policy or prompt_cache.block_policy
    fits = isinstance(kept, AdaptiveStrategy) and kept.block_size == block_size
    if not fits or kept.timed != settings.timed:
        kept = settings.new_strategy(block_size)
    prompt_cache.block_policy = kept
    return kept


# What the last reply of a target and drafter that brought no policy or prompt cache of its
# own learned of cycle costs and acceptance, for the next such reply: a script calling
# `stream_generate` in a loop, as with mlx-lm, explores once, not every call. Only policies
# timed by the clock are kept: their choices never change the output, where a policy costed
# from fixed tables must start afresh for a seeded run to repeat.
_learned: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, Policy]] = {}


def learned_policy(model: Any, draft: DFlashDraft | None) -> Policy | None:
    """The policy the last reply of `model` and `draft` kept (`keep_learned`), if any."""
    entry = _learned.get((id(model), id(draft)))
    if entry is None or entry[0]() is not model or entry[1]() is not draft:
        return None
    return entry[2]


def keep_learned(model: Any, draft: DFlashDraft | None, policy: Policy) -> None:
    """Keep a clock-timed adaptive `policy` for the next reply of `model` and `draft`
    (not under `mlx.launch`, where every rank must start alike)."""
    if draft is None or not getattr(policy, "timed", False) or world_group() is not None:
        return
    for key, (m, d, _) in list(_learned.items()):
        if m() is None or d() is None:
            del _learned[key]
    _learned[(id(model), id(draft))] = (weakref.ref(model), weakref.ref(draft), policy)
