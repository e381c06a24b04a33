"""Per-instance hooks on the target while a reply is generated (`swaps.py`): capturing
the hidden states of chosen layers, and tree forwards.

Capture (`capture`): each tapped layer object, and each module whose cache a
rollback re-runs (the mixer a recurrent cache is passed to, deepseek_v41's compressor:
`TargetAdapter.checkpointed`), gets a subclass of
its own class whose `__call__` records the output (lazily: the layer outputs are
kept as unevaluated arrays of the same graph, so capturing costs no extra
evaluation) and checkpoints those caches (`rollback.CHECKPOINTED`), and gets its
class back when the capture ends. No mlx-lm class is modified, so other models see
mlx-lm unchanged. A model is captured by one generation at a time (a second is
refused); forwards through caches other than the capture's (mlx-lm's own decoding
of the same model) are not recorded. When the layers are split over pipeline
ranks, `PipelineSink` gathers the tapped layers to every rank.

Tree forwards (`tree_attention`) swap the classes of the caches and RoPE modules
the same way, for that one forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial, wraps
from threading import Lock
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, _BaseCache

from . import backends, cpu_math
from .rollback import CHECKPOINTED, WindowKVCache, cache_parts
from .swaps import swap_in, swap_out, swapped

_HOOKED_CLASSES: dict[type, type] = {}
_HOOK_ATTRIBUTES = ("_dflash_sink", "_dflash_index", "_dflash_caches", "_dflash_checkpoints")
HOOKING = Lock()  # makes "is a layer hooked? then hook it" one step across threads


def _hooked_class(cls: type) -> type:
    """A subclass of `cls` that checkpoints the caches it is passed and records its output."""
    if cls not in _HOOKED_CLASSES:

        @wraps(cls.__call__)
        def __call__(self, *args, **kwargs):
            passed = (*args, *kwargs.values())
            for c in passed if self._dflash_checkpoints else ():
                if isinstance(c, CHECKPOINTED):
                    c.checkpoint(args[0].shape[1], partial(_replay, cls, self, args, kwargs))
            out = cls.__call__(self, *args, **kwargs)
            foreign = self._dflash_caches is not None and any(
                isinstance(c, _BaseCache) and id(c) not in self._dflash_caches for c in passed
            )
            if self._dflash_sink is not None and not foreign:
                self._dflash_sink[self._dflash_index] = feature(out)
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


def _replay(cls: type, module: nn.Module, args: tuple, kwargs: dict, num_positions: int) -> Any:
    """Re-run `module` (unhooked) on the first positions of the input it last saw."""
    return cls.__call__(module, args[0][:, :num_positions], *args[1:], **kwargs)


class PipelineSink(dict):
    """Captured layer outputs when the layers are split over pipeline ranks.

    Each rank records its own tapped layers and the backbone's output; reading a
    tapped layer gathers all of them to every rank with one `all_sum` (each
    layer's rank adds its output, the others zeros), made to depend on the
    backbone's output so that it runs after the forward's own send, receive and
    gather on every rank alike, and evaluated at once, before any later forward.
    """

    OUTPUT = "output"

    def __init__(self, layer_ids: list[int]):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.gathered: tuple[mx.array, mx.array] | None = None  # (for this output, features)

    def __getitem__(self, i: int) -> mx.array:
        output = dict.__getitem__(self, self.OUTPUT)
        if self.gathered is None or self.gathered[0] is not output:
            parts = [dict.get(self, j, mx.zeros_like(output)) for j in self.layer_ids]
            mine = mx.depends(mx.concatenate(parts, axis=-1), output)
            self.gathered = (output, mx.distributed.all_sum(mine, stream=mx.cpu))
            mx.eval(self.gathered[1])  # now: a receive of the next forward, which depends on
            # nothing, must not be scheduled before it on one rank and after it on another
        k, width = self.layer_ids.index(i), output.shape[-1]
        return self.gathered[1][..., k * width : (k + 1) * width]


@dataclass
class TreeForward:
    """What a tree forward's hooks hand to the model: each node's position and what it sees.

    `positions` (n,) are absolute (the cache offset + the node's depth); `visible`
    (n, n) is the ancestor mask among the nodes. The counters show afterwards
    whether the model took both (see `TargetAdapter.tree_attention`).
    """

    positions: mx.array
    visible: mx.array
    roped: set[int] = field(default_factory=set)
    masked: bool = False

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


_TREE_CLASSES: dict[type, type] = {}


def _tree_class(cls: type) -> type:
    """The class a KV cache or a RoPE module has during a tree forward: a subclass of its own.

    The cache's `make_mask` gives the tree's mask. The RoPE puts node i of a
    (1, heads, n, dim) input at positions[i]: mx.fast.rope takes one offset per
    batch row, so the node axis goes into the batch axis and back.
    """
    if cls not in _TREE_CLASSES:
        if issubclass(cls, KVCache):

            def make_mask(self, N: int, *args: Any, **kwargs: Any) -> mx.array:
                return self._dflash_tree.mask(0, self.offset, N)

            body = {"make_mask": make_mask}
        elif issubclass(cls, WindowKVCache):

            def make_mask(self, N: int, window_size: int | None = None, **kwargs: Any) -> mx.array:
                start = self._first_visible()  # what update_and_fetch will keep
                window = window_size or self.window
                return self._dflash_tree.mask(start, self.offset, N, window, self.keep)

            body = {"make_mask": make_mask}
        else:

            def __call__(self, x, offset=0, *args, **kwargs):
                tree = self._dflash_tree
                if x.shape[0] != 1 or x.shape[-2] != tree.positions.size:
                    raise ValueError(f"a tree forward cannot place an input of shape {x.shape}")
                tree.roped.add(id(self))
                own = cls
                if backends.current() == "cpu" and cls in cpu_math.COMPILED_CLASSES:
                    own = cpu_math.COMPILED_CLASSES[cls]  # the verify forward's compiled RoPE
                out = own.__call__(self, x.swapaxes(0, -2), tree.positions, *args, **kwargs)
                return out.swapaxes(0, -2)

            body = {"__call__": __call__}
        _TREE_CLASSES[cls] = type(f"Tree{cls.__name__}", (cls,), body)
    return _TREE_CLASSES[cls]


@contextmanager
def tree_attention(
    cache: list[Any], ropes: list[nn.Module], depths: list[int], visible: mx.array, model: str
) -> Iterator[TreeForward]:
    """Make the next forward through `cache` a tree forward, per instance.

    Its inputs are tree nodes: node i is placed at the cache offset + `depths[i]`
    and sees the committed cache and the nodes `visible[i]` (its ancestors).
    The model code runs unchanged: the caches' class is swapped for one whose
    `make_mask` gives the tree mask and each attention's RoPE (`ropes`) for one that
    takes per-node positions (mlx-lm's attention asks `cache.make_mask` for
    its mask and ropes at `cache.offset`); both get their classes back after.
    A model (type `model`) that took neither (its attention computes them otherwise)
    is refused after the forward, before anything is read from it.
    """
    tree = TreeForward(cache[0].offset + mx.array(depths), visible)
    objects = [*cache_parts(cache), *ropes]
    for obj in objects:
        object.__setattr__(obj, "_dflash_tree", tree)
    try:
        with swapped([(obj, type(obj), _tree_class(type(obj))) for obj in objects]):
            yield tree
    finally:
        for obj in objects:
            object.__delattr__(obj, "_dflash_tree")
    if not tree.masked or len(tree.roped) != len(ropes):
        raise ValueError(
            f"tree verification does not support target model type '{model}': "
            "its attention did not take the tree's positions and mask"
        )


@contextmanager
def capture(
    layers: list[nn.Module | None],
    layer_ids: list[int],
    checkpointed: list[nn.Module],
    cache: list[Any] | set[int] | None = None,
    pipelined: nn.Module | None = None,
) -> Iterator[dict[Any, mx.array]]:
    """Record the outputs (`feature`) of `layers[i]` for i in `layer_ids` on every forward
    while the context is open, and have the `checkpointed` modules checkpoint the caches
    they are passed so that a rollback can re-run the committed prefix. With `cache`, a
    forward through other caches is not recorded (a set: the ids of the caches, which the
    caller may change while the capture is open). `pipelined`: the backbone, when the
    layers are split over pipeline ranks (None in `layers`: another rank's). A second
    capture of the same layers while one is open raises RuntimeError.
    """
    sink: dict[Any, mx.array] = PipelineSink(layer_ids) if pipelined is not None else {}
    caches = cache if isinstance(cache, set) or cache is None else {id(c) for c in cache}
    with HOOKING:
        if any(type(m) in _HOOKED_CLASSES.values() for m in [*layers, *checkpointed]):
            raise RuntimeError(
                "this model is already being generated with (in another thread or another "
                "open generator); run one generation per model at a time"
            )
        recorded = [(i, layers[i]) for i in sorted(set(layer_ids))]
        if pipelined is not None:  # its output: after the forward's collectives on every rank
            recorded.append((PipelineSink.OUTPUT, pipelined))
        hooks = {id(m): (i, m) for i, m in recorded if m is not None}  # None: another rank's
        for module in checkpointed:
            hooks.setdefault(id(module), (None, module))
        hooks = list(hooks.values())
        checkpointing = {id(m) for m in checkpointed}
        for i, layer in hooks:
            object.__setattr__(layer, "_dflash_checkpoints", id(layer) in checkpointing)
            object.__setattr__(layer, "_dflash_sink", None if i is None else sink)
            object.__setattr__(layer, "_dflash_index", i)
            object.__setattr__(layer, "_dflash_caches", caches)
        hooked = swap_in([(layer, type(layer), _hooked_class(type(layer))) for _, layer in hooks])
    try:
        yield sink
    finally:
        with HOOKING:
            swap_out(hooked)
            for _, layer in hooks:
                for name in _HOOK_ATTRIBUTES:
                    object.__delattr__(layer, name)
