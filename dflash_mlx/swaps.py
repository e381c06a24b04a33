"""Per-instance class swaps while a graph is built: the one mechanism behind the target's
verify forward (`target.py`), the drafter's block on CUDA (`kernels/cuda.py`) and the
compiled norms and RoPE on the CPU (`cpu_math.py`). A module changes class, not its
class's code: other models and other instances see mlx-lm's and MLX's classes unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.nn as nn

Swap = tuple[nn.Module, type, type]  # (module, its own class, the class it takes)


@contextmanager
def swapped(swaps: list[Swap]) -> Iterator[None]:
    """Inside the block each module of `swaps` has the class it takes, after it its own. A
    module that is not of its own class (another thread has swapped it) is left alone:
    both classes compute alike."""
    taken = [(m, cls, new) for m, cls, new in swaps if type(m) is cls]
    for m, _, new in taken:
        m.__class__ = new
    try:
        yield
    finally:
        for m, cls, _ in taken:
            m.__class__ = cls
