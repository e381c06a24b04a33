"""How a reply is decoded: block size, trees, adaptation, sampling, limits.

One `GenerationSettings` is validated when it is made, then handed as it is
from the CLI, the server, chat, bench and the demo to `stream_generate`; the
keyword arguments of `stream_generate` build one the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from .adaptive import (
    FIXED_CYCLE_COSTS,
    FIXED_TREE_COSTS,
    AdaptiveBlock,
    AdaptiveStrategy,
    AdaptiveTree,
)
from .distributed import world_group
from .sampling import LogitsProcessor, Sampler, Verifier, make_verifier


@dataclass(frozen=True)
class GenerationSettings:
    """`block_size` defaults to the drafter's (1: plain decoding through the same loop);
    `tree_budget` verifies trees of up to that many draft tokens instead of chains;
    `adaptive` sizes each cycle by measured cost; with none of the three set, each cycle
    chooses a chain or a tree by measured cost (`AdaptiveStrategy`); `prompt_lookup`
    grafts the prompt lookup's chain onto every tree.
    Sampling follows mlx-lm's `make_sampler`; `acceptance` is the rule for sampled
    drafts (`sampling.py`; "coupled" leaves the reply independent of the cycles' shapes, so
    the clock may choose them); `logits_processors` are mlx-lm's. With a `seed` (0 to
    2**32 - 1) every random draw comes from these settings' own stream from that seed
    instead of MLX's global state, so a seeded reply is the same whatever samples beside
    it; replies made with one settings object continue its stream, and a copy with
    changes (`but`) starts its own."""

    max_tokens: int = 256
    block_size: int | None = None
    tree_budget: int | None = None
    adaptive: bool | None = None
    prompt_lookup: bool = True
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    sampler: Sampler | None = None
    acceptance: str = "coupled"
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    seed: int | None = None
    # the rule that proposes drafts and accepts them under these sampling settings
    verifier: Verifier = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.tree_budget is not None and self.tree_budget < 1:
            raise ValueError(f"tree_budget must be at least 1, got {self.tree_budget}")
        object.__setattr__(self, "logits_processors", list(self.logits_processors or []))
        verifier = make_verifier(  # the sampling settings' own checks too
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.sampler,
            self.acceptance,
            self.logits_processors,
            self.seed,
        )
        object.__setattr__(self, "verifier", verifier)

    def but(self, **changes: Any) -> GenerationSettings:
        """A copy with `changes` (validated again)."""
        return replace(self, **changes) if changes else self

    @property
    def timed(self) -> bool:
        """Whether measured times may choose the block sizes: only where the sizes change
        nothing but speed: greedy, or sampled under the coupled rule (keyed by position). A
        cycle sampled by another rule consumes random draws by its size, and ranks in
        lockstep (`mlx.launch`) must choose alike; both cost the sizes from a fixed table."""
        shapeless = self.temperature == 0 or self.acceptance == "coupled"
        return shapeless and self.sampler is None and world_group() is None

    def new_policy(self, block_size: int) -> AdaptiveBlock | AdaptiveTree:
        """A fresh size policy: trees sized up to the budget, or chains up to `block_size`,
        costed by the clock or by the backend's fixed table (`timed`)."""
        if self.tree_budget:
            return AdaptiveTree(self.tree_budget)
        if self.timed:
            return AdaptiveBlock(block_size)
        return AdaptiveBlock(block_size, fixed_costs=FIXED_CYCLE_COSTS[backend()])

    def new_strategy(self, block_size: int) -> AdaptiveStrategy:
        """A fresh choice between chains up to `block_size` and trees, costed by the clock or
        by the backend's fixed tables (`timed`)."""
        if self.timed:
            return AdaptiveStrategy(block_size)
        fixed = FIXED_CYCLE_COSTS[backend()], FIXED_TREE_COSTS[backend()]
        return AdaptiveStrategy(block_size, fixed_costs=fixed)


def backend() -> str:
    """The fixed cost tables' key for the default device."""
    return "cpu" if mx.default_device() == mx.cpu else "gpu"
