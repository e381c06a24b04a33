"""Per-instance class swaps: the one mechanism by which this package changes what an
mlx-lm or MLX module does. A module changes class, not its class's code: other models
and other instances see mlx-lm's and MLX's classes unchanged. Used for the target's
verify forward (`models/backends.py`), its per-forward hooks and tree rows (`models/hooks.py`), the
drafter's block (`backends.block_swaps`) and the bench's timers.

Most swaps give a subclass its own `__call__` or method. Where mlx-lm's `__call__`
calls a module-level function that a backend replaces (`swiglu`,
`scaled_dot_product_attention` inside an attention or MLP), no per-instance override
reaches the call without rewriting the method: `rebound_class` makes a subclass whose
`__call__` is the same code object reading those names from a copy of its globals.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import FunctionType
from typing import Any

Swap = tuple[Any, type, type]  # (module, its own class, the class it takes)


# past `nn.Module.__setattr__`, whose checks cost more than the swap: a forward swaps
# hundreds of modules in and out
_set = object.__setattr__


def swap_in(swaps: list[Swap]) -> list[Swap]:
    """Give each module of `swaps` the class it takes; the swaps done. A module that is not
    of its own class (another thread has swapped it) is left alone: both compute alike."""
    taken = [swap for swap in swaps if type(swap[0]) is swap[1]]
    for m, _, new in taken:
        _set(m, "__class__", new)
    return taken


def swap_out(taken: list[Swap]) -> None:
    """Give the modules `swap_in` swapped their own classes back."""
    for m, cls, _ in taken:
        _set(m, "__class__", cls)


@contextmanager
def swapped(swaps: list[Swap]) -> Iterator[None]:
    """Inside the block each module of `swaps` has the class it takes, after it its own."""
    taken = swap_in(swaps)
    try:
        yield
    finally:
        swap_out(taken)


_REBOUND: dict[tuple[type, str], type | None] = {}


def rebound_class(cls: type, replacements: dict[str, tuple[Any, Any]], tag: str) -> type | None:
    """A subclass of `cls` whose `__call__` reads `replacements` ({name: (theirs, ours)})
    in place of the globals its code calls, or None when it calls none of them. The
    code object and closure are `cls.__call__`'s; mlx-lm's module and class stay as they
    are. Cached by class and `tag` (one tag per set of replacements)."""
    if (cls, tag) not in _REBOUND:
        call, rebound_cls = cls.__call__, None
        if isinstance(call, FunctionType):
            bound = {
                name: ours
                for name, (theirs, ours) in replacements.items()
                if name in call.__code__.co_names and call.__globals__.get(name) is theirs
            }
            if bound:
                code, defaults, closure = call.__code__, call.__defaults__, call.__closure__
                rebound = FunctionType(
                    code, {**call.__globals__, **bound}, call.__name__, defaults, closure
                )
                rebound.__kwdefaults__ = call.__kwdefaults__
                rebound_cls = type(f"{tag}{cls.__name__}", (cls,), {"__call__": rebound})
        _REBOUND[(cls, tag)] = rebound_cls
    return _REBOUND[(cls, tag)]
