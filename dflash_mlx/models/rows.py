"""One target forward over several replies, each through its own caches.

A batched cycle verifies every active reply's positions in one forward: the rows'
positions (B, n) go through every projection, norm and MLP together, so each weight is
read once for all of them, while attention runs row by row on each row's own KV cache
with the function and mask that row's own forward would use. No row sees another's
keys, each cache keeps its row's own length (a rejected draft is trimmed from its row
alone, and a reply joins or leaves without copying anyone's cache), and a row's
attention is its solo forward's.

The model code runs unchanged: each layer is handed a `RowCaches` as its cache. Its
`offset` is the rows' offsets as one array (RoPE takes one offset per batch row),
`update_and_fetch` appends each row's keys and values to that row's cache, and
`make_mask` gives each row's own mask (`RowMasks`); while the graph is built the
attention modules call `attention` below in place of mlx-lm's
`scaled_dot_product_attention` (`backends.verify_swaps(..., attention=)`).

A row may verify a tree: its caches then give that tree's mask and the RoPEs put each
row's queries at their own positions (`hooks.hooked`), beside chain rows whose masks are
causal.

A recurrent layer (Qwen3.5's and Qwen3-Next's GatedDeltaNet) is handed a `RowStates`: its
rows' states stacked along the batch, as mlx-lm's mixer runs a batch, each new state split
back to its row, and each row's `RecurrentCache` checkpointed with a replay of that row's
own input alone, so that every row rolls back as far as it rejected.

Only targets whose every cache is a plain `KVCache` or a `RecurrentCache` batch so
(`batchable`): windowed and compressed caches keep state a row-by-row attention cannot
reach.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from . import backends
from .rollback import RecurrentCache


class RowMasks(list):
    """Each row's attention mask, as that row's own cache made it."""


class RowCaches:
    """One layer's caches of several rows, passed to the layer as its cache."""

    def __init__(self, caches: list[Any], offset: mx.array):
        self.caches, self.offset = caches, offset
        self.fetched: list[tuple[mx.array, mx.array]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append row i's keys and values to row i's cache; `attention` reads what each
        row's cache then holds (the arrays returned are the new keys and values alone)."""
        self.fetched = [
            c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            for i, c in enumerate(self.caches)
        ]
        return keys, values

    def make_mask(self, N: int, **kwargs: Any) -> RowMasks:
        return RowMasks(c.make_mask(N, **kwargs) for c in self.caches)


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: RowCaches,
    scale: float,
    mask: RowMasks,
    sinks: mx.array | None = None,
) -> mx.array:
    """Each row's queries against its own cache, by the function its own forward calls."""
    positions = queries.shape[2]
    solo = scaled_dot_product_attention
    if positions > 1:
        solo = backends.REPLACEMENTS.get(backends.current(), {}).get(
            "scaled_dot_product_attention", (None, solo)
        )[1]
    out = [
        solo(queries[i : i + 1], k, v, c, scale, mask[i], sinks)
        for i, ((k, v), c) in enumerate(zip(cache.fetched, cache.caches))
    ]
    return mx.concatenate(out)


class RowStates:
    """One recurrent layer's caches of several rows, passed to its mixer as one cache."""

    lengths = None  # mlx-lm's per-row lengths: every row runs all the forward's positions

    def __init__(self, caches: list[RecurrentCache]):
        self.caches = caches

    def __getitem__(self, index: int) -> mx.array | None:
        """The rows' states stacked (a row without one yet: zeros, as the mixer starts)."""
        states = [c[index] for c in self.caches]
        known = next((s for s in states if s is not None), None)
        if known is None:
            return None
        return mx.concatenate([mx.zeros_like(known) if s is None else s for s in states])

    def __setitem__(self, index: int, value: mx.array) -> None:
        for i, c in enumerate(self.caches):
            c[index] = value[i : i + 1]

    def advance(self, n: int) -> None:
        for c in self.caches:
            c.advance(n)

    def make_mask(self, N: int, **kwargs: Any) -> None:
        return None  # no row is padded

    def checkpoint(self, num_positions: int, replay: Callable[..., Any]) -> None:
        """Each row's checkpoint, its replay re-running the mixer on that row's input alone."""
        for i, c in enumerate(self.caches):
            c.checkpoint(num_positions, partial(replay, row=i))


def batchable(cache: list[Any]) -> bool:
    """Whether a reply with these target caches can share a batched forward."""
    return all(type(c) in (KVCache, RecurrentCache) for c in cache)


def row_caches(caches: list[list[Any]]) -> list[RowCaches]:
    """Per layer, the rows' caches (`caches[row][layer]`) as one `RowCaches`; the layers
    share one offsets array where their offsets agree, so RoPE tables are shared too."""
    shared: dict[tuple[int, ...], mx.array] = {}
    layers: list[RowCaches | RowStates] = []
    for per_row in zip(*caches):
        if isinstance(per_row[0], RecurrentCache):
            layers.append(RowStates(list(per_row)))
            continue
        offsets = tuple(c.offset for c in per_row)
        if offsets not in shared:
            shared[offsets] = mx.array(offsets, dtype=mx.int32)
        layers.append(RowCaches(list(per_row), shared[offsets]))
    return layers
