"""What each cycle of a reply verifies, resolved once from its settings: a `DecodingPlan`.

`resolve` is where policies are made. A policy answers `plan()` before a cycle (a `Plan`:
so many drafts, as a chain or a tree) and `record`s what the cycle verified, accepted and
cost. A fixed block size or tree budget is a `FixedPlan`; the adaptive ones (`adaptive.py`)
choose by measured cost: `AdaptiveBlock` chains, `AdaptiveTree` tree sizes, and
`AdaptiveStrategy`, the library's default, either.

Cycles shared by several replies cost more per position than a reply's own, so they are
planned by a policy of the batch for that many rows (`resolve_width`, once per width by
`scheduler.ByWidth`), which measures the shared cycles' costs as a reply's own policy
measures its cycles.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from ..models.cycle_costs import FIXED_CYCLE_COSTS, FIXED_TREE_COSTS, backend
from ..models.distributed import world_group
from ..models.draft import DFlashDraft
from ..models.target import TargetAdapter
from .adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree, Cycle, Plan, for_rows
from .settings import GenerationSettings


class Policy(Protocol):
    def plan(self) -> Plan:
        """What the next cycle verifies."""

    def record(self, cycle: Cycle) -> None:
        """One finished cycle."""

    def drop_trees(self) -> bool:
        """Plan chains only from now on, where the target refused the first tree forward and
        chains are this policy's to choose (else False: the refusal is the caller's error)."""


@dataclass
class FixedPlan:
    """Every cycle the same: a chain of `drafts` drafts (0: plain steps) or a whole tree of
    up to that many nodes."""

    fixed: Plan

    def plan(self) -> Plan:
        return self.fixed

    def record(self, cycle: Cycle) -> None:
        pass

    def drop_trees(self) -> bool:
        return False


FIRST = FixedPlan(Plan(0))  # a reply's first cycle: the target's token after its prompt
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


def strategy_note(draft: DFlashDraft | None, target: TargetAdapter, caches: list) -> str | None:
    """Why the default runs adaptive chains instead of choosing chains or trees, in words
    (None: no drafter, or nothing kept it from trees)."""
    if draft is None:
        return None
    if draft.config.block_size < 2:
        return "the drafter's block holds no draft"
    if world_group() is not None:
        return "sharded (mlx.launch): adaptive chains, no trees"
    try:
        target.check_tree(caches)
    except ValueError as exc:
        return f"chains only: {exc}"
    return None


@dataclass(frozen=True)
class DecodingPlan:
    """How one reply's cycles are planned: the policy that plans each, how deep a tree may go,
    a cap on the drafts of a shared cycle (None: the policy's), whether the prompt lookup
    grafts onto its trees, why a cycle would verify no draft, and why the default runs chains
    only where something keeps it from trees (None: nothing does, or not the default)."""

    policy: Policy
    depth: int
    max_drafts: int | None
    lookup: bool
    plain_reason: str
    note: str | None = None

    @property
    def adapts(self) -> bool:
        """Whether its policy learns from the cycles (worth keeping for the next reply)."""
        return isinstance(self.policy, ADAPTIVE)


def resolve(
    settings: GenerationSettings,
    draft: DFlashDraft | None,
    target: TargetAdapter,
    caches: list,
    block_policy: Policy | None = None,
    kept: Policy | None = None,
) -> DecodingPlan:
    """The plan `settings` ask for over the target's `caches`, or a one-line ValueError.
    `block_policy` is the caller's (checked against the settings); else an adaptive reply
    goes on from `kept` (a prompt cache's, or the last call's) where it was made for the same
    setting, else from a new policy. With a drafter and nothing set, each cycle chooses a chain
    or a tree (`AdaptiveStrategy`) where nothing keeps it from trees, else the adaptive
    chain."""
    default = settings_unset(settings, block_policy)
    note = strategy_note(draft, target, caches) if default else None
    mixed = isinstance(block_policy, AdaptiveStrategy) or (
        default and draft is not None and note is None
    )
    if mixed:
        policy, depth = _strategy(settings, draft, block_policy, kept), draft.config.block_size - 1
    else:
        policy, depth = _sized(settings, draft, target, caches, block_policy, kept)
    return DecodingPlan(
        policy,
        depth,
        max_drafts=settings.block_size - 1 if settings.block_size else None,
        lookup=bool((settings.tree_budget or mixed) and settings.prompt_lookup),
        plain_reason=plain_reason(settings, draft),
        note=note,
    )


def resolve_width(own: Policy, depth: int, rows: int, nearest: Policy | None) -> Policy:
    """The policy of a batch's shared cycles of `rows` rows for replies planned by `own`: it
    starts from the nearest width's (`nearest`), else from `own` if that adapts, else from an
    `AdaptiveStrategy` up to `own`'s fixed chain or tree (chains and trees of at most as many
    drafts, trees no deeper than `depth`); it keeps what was learned of acceptance and
    measures its own cycles' costs (`adaptive.for_rows`)."""
    start = nearest
    if start is None and isinstance(own, FixedPlan):
        fixed = own.fixed
        budget = fixed.drafts if fixed.tree else 0
        start = AdaptiveStrategy(min(depth, fixed.drafts) + 1, tree_budget=budget)
    return for_rows(start or own, rows)


def _sized(
    settings: GenerationSettings,
    draft: DFlashDraft | None,
    target: TargetAdapter,
    caches: list,
    block_policy: Policy | None,
    kept: Policy | None,
) -> tuple[Policy, int]:
    """A fixed or adaptive chain or tree, as the settings size it, and how deep a tree may go."""
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
        target.check_tree(caches)
    wanted = ("tree budget", tree_budget) if tree_budget else ("block size", block_size)
    if isinstance(block_policy, ADAPTIVE) and block_policy.setting != wanted:
        raise ValueError(
            f"the block policy was made for {' '.join(map(str, block_policy.setting))}, "
            f"not {' '.join(map(str, wanted))}"
        )
    if isinstance(block_policy, AdaptiveBlock) and block_policy.timed != settings.timed:
        made_for = "greedy decoding" if block_policy.timed else "sampling"
        raise ValueError(f"the block policy was made for {made_for}: make a new one")
    if not adaptive or block_size == 1:
        fixed = Plan(tree_budget, True) if tree_budget else Plan(block_size - 1)
        return FixedPlan(fixed), block_size - 1
    policy = block_policy or kept
    stale = not isinstance(policy, ADAPTIVE) or policy.setting != wanted
    if stale or getattr(policy, "timed", settings.timed) != settings.timed:
        policy = _sizes(settings, block_size)
    return policy, block_size - 1


def _sizes(settings: GenerationSettings, block_size: int) -> AdaptiveBlock | AdaptiveTree:
    """A fresh size policy: trees sized up to the budget, or chains up to `block_size`,
    costed by the clock or by the backend's fixed table (`settings.timed`)."""
    if settings.tree_budget:
        return AdaptiveTree(settings.tree_budget)
    if settings.timed:
        return AdaptiveBlock(block_size)
    return AdaptiveBlock(block_size, fixed_costs=FIXED_CYCLE_COSTS[backend()])


def _strategy(
    settings: GenerationSettings,
    draft: DFlashDraft,
    block_policy: Policy | None,
    kept: Policy | None,
) -> AdaptiveStrategy:
    """Chains or trees each cycle: an `AdaptiveStrategy` for the drafter's block (the given
    one, else `kept` where it fits, else a new one costed by the clock or by the backend's
    fixed tables)."""
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
    policy = block_policy or kept
    fits = isinstance(policy, AdaptiveStrategy) and policy.block_size == block_size
    if fits and policy.timed == settings.timed:
        return policy
    if settings.timed:
        return AdaptiveStrategy(block_size)
    fixed = FIXED_CYCLE_COSTS[backend()], FIXED_TREE_COSTS[backend()]
    return AdaptiveStrategy(block_size, fixed_costs=fixed)


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
