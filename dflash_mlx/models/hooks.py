"""Per-forward hooks on the target (`native/swaps.py`): recording the hidden states of chosen
layers, checkpointing the caches a rollback re-runs, and tree forwards.

While one forward's graph is built (`hooked`), each tapped layer object, and each module
whose cache a rollback re-runs (the mixer a recurrent cache is passed to, deepseek_v41's
compressor: `TargetAdapter.checkpointed`), gets a subclass of its own class whose
`__call__` records the output (lazily: unevaluated arrays of the same graph, so recording
costs no extra evaluation) and checkpoints those caches (`rollback.CHECKPOINTED`); in a
tree forward the caches of the tree rows and the attention's RoPE modules get classes
that give the tree's mask and per-node positions. Every object gets its class back before
the forward runs. What the classes read (the outputs recorded, the trees) is this
forward's `Hooks`, held by the building thread alone: nothing is set on the objects, no
mlx-lm class is modified, and another thread's forward of the same model (mlx-lm's own
decoding) sees the classes compute as their own. When the layers are split over pipeline
ranks, `features` gathers the tapped layers to every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial, wraps
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..native.swaps import Swap, swapped
from .rollback import CHECKPOINTED, WindowKVCache, cache_parts

HOOKING = threading.Lock()  # one forward's graph built with swapped classes at a time
PIPELINE_OUTPUT = "output"  # the key of the backbone's output among a pipelined forward's
_BUILDING = threading.local()  # .hooks: the `Hooks` of the forward this thread builds


@dataclass
class TreeForward:
    """One tree row of a forward: each node's position and what it sees.

    `positions` (n,) are absolute (the cache offset + the node's depth); `visible`
    (n, n) is the ancestor mask among the nodes. `masked` shows afterwards whether the
    model asked the row's caches for its mask; the layers asking alike share one (`masks`).
    """

    positions: mx.array
    visible: mx.array
    masked: bool = False
    masks: dict[tuple, mx.array | None] = field(default_factory=dict)

    def mask(
        self, start: int, offset: int, n: int, window: int | None = None, keep: int = 0
    ) -> mx.array | None:
        """(n, keys) over the cached positions [start, offset) (after the first `keep`, which
        are cached too) and the nodes: every node sees the committed positions and its
        ancestors, those within `window` positions of its own (or among the first `keep`) if
        a window is given. None for a lone root, which sees all the cache returns, as
        mlx-lm's own one-position forward (whose attention may take no mask then:
        deepseek_v32's sparse path)."""
        if n != self.visible.shape[0]:
            raise ValueError(f"a tree forward of {self.visible.shape[0]} nodes got {n} positions")
        self.masked = True
        key = (start, offset, window, keep)
        if key not in self.masks:
            self.masks[key] = self._mask(start, offset, n, window, keep)
        return self.masks[key]

    def _mask(
        self, start: int, offset: int, n: int, window: int | None, keep: int
    ) -> mx.array | None:
        if n == 1:
            return None
        if window is None:
            context, visible = mx.ones((n, offset - start), dtype=mx.bool_), self.visible
        else:
            cached = mx.concatenate([mx.arange(min(keep, start)), mx.arange(start, offset)])
            context = self._near(cached, window, keep)
            visible = self.visible & self._near(self.positions, window, keep)
        return mx.concatenate([context, visible], axis=1)

    def _near(self, keys: mx.array, window: int, keep: int) -> mx.array:
        """(nodes, keys): whether each key is among the first `keep` or within `window`."""
        return (keys[None] < keep) | (self.positions[:, None] - keys[None] < window)


@dataclass
class Hooks:
    """What one forward's hooked classes read and write: the recorded modules' keys by
    module id (`recorded`: a layer index, `PIPELINE_OUTPUT`, or None for a module only
    checkpointed), the ids of the modules that checkpoint their caches, their outputs
    (`outputs`), each tree row's `TreeForward` by the ids of its cache parts, and the
    positions every row's queries take in a tree forward, flat over (rows, positions)."""

    recorded: dict[int, Any]
    checkpointing: set[int]
    trees: dict[int, TreeForward]
    positions: mx.array | None
    outputs: dict[Any, mx.array] = field(default_factory=dict)
    roped: set[int] = field(default_factory=set)


def _active() -> Hooks | None:
    return getattr(_BUILDING, "hooks", None)


def tree_of(cache: Any) -> TreeForward | None:
    """The tree of the forward being built through `cache`, if it is a tree row's."""
    hooks = _active()
    return None if hooks is None else hooks.trees.get(id(cache))


_HOOKED_CLASSES: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    """A subclass of `cls` that checkpoints the caches it is passed and records its output."""
    if cls not in _HOOKED_CLASSES:

        @wraps(cls.__call__)
        def __call__(self, *args, **kwargs):
            hooks = _active()
            if hooks is None or id(self) not in hooks.recorded:  # another thread's forward
                return cls.__call__(self, *args, **kwargs)
            if id(self) in hooks.checkpointing:
                for c in (*args, *kwargs.values()):
                    if isinstance(c, CHECKPOINTED) or _row_states(c):
                        c.checkpoint(args[0].shape[1], partial(_replay, cls, self, args, kwargs))
            out = cls.__call__(self, *args, **kwargs)
            key = hooks.recorded[id(self)]
            if key is not None:
                hooks.outputs[key] = feature(out)
            return out

        _HOOKED_CLASSES[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _HOOKED_CLASSES[cls]


def feature(out: mx.array | tuple) -> mx.array:
    """The hidden state a drafter reads from a layer's output (B, L, hidden).

    A layer with several residual streams (hyper-connections, deepseek_v41:
    (B, L, streams, hidden), first of a tuple) gives the mean over its streams:
    the auxiliary hidden state that vLLM's and ROCm ATOM's DeepSeek-V4 DSpark and
    DFlash paths hand the drafter, so what its published drafters were trained on.
    """
    h = out[0] if isinstance(out, tuple) else out
    return h.mean(axis=2) if h.ndim == 4 else h


def _row_states(cache: Any) -> bool:
    """Whether `cache` holds several rows' recurrent caches (`rows.RowStates`)."""
    return any(isinstance(c, CHECKPOINTED) for c in getattr(cache, "caches", None) or ())


def _replay(
    cls: type,
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    num_positions: int,
    row: int | None = None,
) -> Any:
    """Re-run `module` (unhooked) on the first positions of the input it last saw: of row
    `row` alone, through that row's own cache, where several rows shared the forward."""
    x, rest = args[0], args[1:]
    if row is not None:
        x = x[row : row + 1]
        rest = tuple(c.caches[row] if _row_states(c) else c for c in rest)
        kwargs = {k: c.caches[row] if _row_states(c) else c for k, c in kwargs.items()}
    return cls.__call__(module, x[:, :num_positions], *rest, **kwargs)


def features(outputs: dict[Any, mx.array], taps: list[int]) -> mx.array:
    """The outputs of the tapped layers `taps`, concatenated along the last axis in that order.

    When the layers are split over pipeline ranks each rank recorded its own tapped layers
    and the backbone's output (`PIPELINE_OUTPUT`): one `all_sum` (each layer's rank adds its
    output, the others zeros) gathers them to every rank, made to depend on the backbone's
    output so that it runs after the forward's own send, receive and gather on every rank
    alike, and evaluated at once: a receive of the next forward, which depends on nothing,
    must not be scheduled before it on one rank and after it on another.
    """
    if PIPELINE_OUTPUT not in outputs:
        return mx.concatenate([outputs[i] for i in taps], axis=-1)
    output = outputs[PIPELINE_OUTPUT]
    parts = [outputs.get(i, mx.zeros_like(output)) for i in taps]
    mine = mx.depends(mx.concatenate(parts, axis=-1), output)
    gathered = mx.distributed.all_sum(mine, stream=mx.cpu)
    mx.eval(gathered)
    return gathered


_TREE_CLASSES: dict[type, type] = {}


def _tree_class(cls: type) -> type:
    """The class a KV cache or a RoPE module has during a tree forward: a subclass of its own.

    The cache's `make_mask` gives its row's tree mask. The RoPE puts each query of a
    (rows, heads, n, dim) input at its own position: the CPU's compiled RoPE takes one
    offset per query (`cpu_math.COMPILED_CLASSES`); mx.fast.rope takes one offset per
    batch entry, so for it the node axis goes into the batch axis and back.
    """
    if cls not in _TREE_CLASSES:
        if issubclass(cls, KVCache):

            def make_mask(self, N: int, *args: Any, **kwargs: Any) -> mx.array:
                tree = tree_of(self)
                if tree is None:
                    return cls.make_mask(self, N, *args, **kwargs)
                return tree.mask(0, self.offset, N)

            body = {"make_mask": make_mask}
        elif issubclass(cls, WindowKVCache):

            def make_mask(self, N: int, window_size: int | None = None, **kwargs: Any) -> mx.array:
                tree = tree_of(self)
                if tree is None:
                    return cls.make_mask(self, N, window_size, **kwargs)
                start = self._first_visible()  # what update_and_fetch will keep
                window = window_size or self.window
                return tree.mask(start, self.offset, N, window, self.keep)

            body = {"make_mask": make_mask}
        else:
            # called twice per attention layer: what can be found once is found here
            own, places = cls.__call__, getattr(cls, "places_queries", False)

            def __call__(self, x, offset=0, *args, **kwargs):
                hooks = getattr(_BUILDING, "hooks", None)
                positions = None if hooks is None else hooks.positions
                if positions is None:
                    return own(self, x, offset, *args, **kwargs)
                shape = x.shape
                if len(shape) != 4 or shape[0] * shape[2] != positions.size:
                    raise ValueError(f"a tree forward cannot place an input of shape {shape}")
                hooks.roped.add(id(self))
                if places:  # the CPU's: no transposes
                    return own(self, x, positions, *args, **kwargs)
                rows, heads, n, dim = shape
                if rows == 1:
                    return own(self, x.swapaxes(0, -2), positions, *args, **kwargs).swapaxes(0, -2)
                placed = x.transpose(0, 2, 1, 3).reshape(rows * n, heads, 1, dim)
                out = own(self, placed, positions, *args, **kwargs)
                return out.reshape(rows, n, heads, dim).transpose(0, 2, 1, 3)

            body = {"__call__": __call__}
        _TREE_CLASSES[cls] = type(f"Tree{cls.__name__}", (cls,), body)
    return _TREE_CLASSES[cls]


def tree_swaps(swaps: list[Swap], ropes: list[nn.Module]) -> list[Swap]:
    """A tree forward's swaps: `swaps` with each of the `ropes` given the tree class of the
    class `swaps` gives it (or of its own), found once with them: a RoPE then changes class
    once per forward, not twice."""
    roping = {id(rope) for rope in ropes}
    out = [(m, cls, _tree_class(new) if id(m) in roping else new) for m, cls, new in swaps]
    swapped = {id(m) for m, _, _ in swaps}
    return out + [(r, type(r), _tree_class(type(r))) for r in ropes if id(r) not in swapped]


@contextmanager
def hooked(
    recorded: list[tuple[Any, nn.Module]],
    checkpointed: list[nn.Module],
    trees: list[tuple[list[Any], TreeForward]],
    ropes: list[nn.Module],
    positions: mx.array | None,
    model: str,
) -> Iterator[Hooks]:
    """While the block builds one forward's graph: the modules of `recorded` (key, module)
    record their outputs (`Hooks.outputs`, by key), the `checkpointed` modules checkpoint
    their caches, and with `trees` ((a row's caches, its TreeForward)) the rows' cache parts
    give their trees' masks and the `ropes` put the queries at `positions` (their tree
    classes come with the forward's other swaps: `tree_swaps`). Call it with those swaps in
    place (it subclasses the classes the objects have then) and `HOOKING` held. A model
    (type `model`) whose attention took neither the trees' masks nor their positions is
    refused after the forward, before anything is read from it.
    """
    keys = {id(m): key for key, m in recorded}
    for module in checkpointed:
        keys.setdefault(id(module), None)
    modules = {id(m): m for m in [*(m for _, m in recorded), *checkpointed]}
    parts = [(c, tree) for row, tree in trees for c in cache_parts(row)]
    hooks = Hooks(keys, {id(m) for m in checkpointed}, {id(c): t for c, t in parts}, positions)
    swaps: list[Swap] = [(m, type(m), _hooked_class(type(m))) for m in modules.values()]
    if trees:
        swaps += [(c, type(c), _tree_class(type(c))) for c, _ in parts]
    _BUILDING.hooks = hooks
    try:
        with swapped(swaps):
            yield hooks
    finally:
        _BUILDING.hooks = None
    if trees and (not all(t.masked for _, t in trees) or len(hooks.roped) != len(ropes)):
        raise ValueError(
            f"tree verification does not support target model type '{model}': "
            "its attention did not take the tree's positions and mask"
        )
