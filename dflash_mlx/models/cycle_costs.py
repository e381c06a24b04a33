"""What a cycle that verifies n positions costs on this backend, relative to a plain step,
without a clock: sampled runs cost their cycles' sizes from these tables so that a seed
reproduces its reply (`decode/adaptive.py`), and a DSpark drafter's confidence head cuts its
chain by them (`dspark.py`). `interpolated_cost` also costs sizes not measured yet from
those that were, in tables or in running averages of wall time.
"""

from __future__ import annotations

import mlx.core as mx

# A chain cycle's cost by block size (positions verified).
# CPU: SmolLM2-135M fp32 with OpenBLAS, the few-row kernel and the shipped drafter
# (benchmarks/README.md, "Few-row products packed as columns").
# GPU: the Qwen3-8B shape (bf16) on an H100 with the verify kernel, where a 2-position forward
# is about as dear as a 16-position one (benchmarks/README.md, "Verify forward on an H100");
# Metal is costed like it until measured.
FIXED_CYCLE_COSTS = {
    "cpu": {1: 1.0, 2: 1.15, 3: 1.15, 4: 1.15, 8: 1.2, 16: 1.35},
    "gpu": {1: 1.0, 2: 2.4, 16: 2.6},
}

# A tree cycle's cost by verified positions (budget + 1), measured as `FIXED_CYCLE_COSTS`
# were. CPU: trees with the prompt lookup (benchmarks/README.md, "Trees and prompt lookup").
# GPU: the Qwen3-8B shape on an H100 (benchmarks/README.md, "The few-rows kernel on an H100"),
# scaled so that the block-16 chain measured beside them costs what
# `FIXED_CYCLE_COSTS["gpu"]` says.
FIXED_TREE_COSTS = {
    "cpu": {7: 1.23, 9: 1.26, 13: 1.35},
    "gpu": {5: 2.68, 9: 3.1, 17: 3.29, 33: 3.43},
}


def backend() -> str:
    """The fixed cost tables' key for the default device."""
    return "cpu" if mx.default_device() == mx.cpu else "gpu"


def interpolated_cost(seconds: dict[int, float], n: int) -> float | None:
    """The cost of size n from those measured: its own, else linear between the nearest
    measured sizes, proportional below the smallest, flat above the largest (None: none yet)."""
    if n in seconds:
        return seconds[n]
    below = max((m for m in seconds if m < n), default=None)
    above = min((m for m in seconds if m > n), default=None)
    if below is None and above is None:
        return None
    if above is None:
        return seconds[below]
    if below is None:
        return seconds[above] * n / above
    share = (n - below) / (above - below)
    return (1 - share) * seconds[below] + share * seconds[above]
