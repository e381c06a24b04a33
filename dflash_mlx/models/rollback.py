"""Target caches that can drop the rejected tail of a verified block.

mlx-lm's `KVCache` is trimmed by moving its offset back. Other cache kinds
cannot be, and are replaced by the classes here when the target's cache is made:

- `WindowKVCache` for sliding-window layers and `max_kv_size`'s caches (mlx-lm's
  `RotatingKVCache` overwrites the oldest entries in place, so once it has wrapped, a
  trim would leave a hole where a rejected draft evicted a still-needed entry).
- `QuantizingKVCache` for `kv_bits` (mlx-lm swaps each KVCache for a new
  `QuantizedKVCache` between forwards; a reply keeps its cache objects, and a verify
  forward must not span the switch).
- `RecurrentCache` for recurrent layers (GatedDeltaNet, short-convolution or
  Mamba state in an `ArraysCache`): the state after the last committed token exists only
  inside the verify forward.
- `ChunkCache` for chunked-attention layers (llama4's `ChunkedKVCache` drops
  the front of its chunk before each forward and clamps a longer trim
  silently, so a prompt cache could keep a wrong offset).
- `CacheGroup` for a layer's several caches (mlx-lm's `CacheList`: MLA latents
  beside sparse-attention index keys), which has no offset of its own.
- `CompressedWindowCache` for deepseek_v41's layer cache (sliding window,
  compressed KV groups, their index keys and the rows of the open group): a
  group that a rejected draft closed must be opened again.

All follow mlx-lm's cache protocol, so the model code runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_reduce
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    _BaseCache,
)
from mlx_lm.models.deepseek_v41 import LayerCache


class WindowKVCache(_BaseCache):
    """Sliding-window keys/values, with the first `keep` positions held too, kept in temporal
    order and trimmable after any forward.

    A one-position step at q sees the first `keep` positions and the `window` positions up
    to q: what mlx-lm's `RotatingKVCache(keep + window, keep)` holds during autoregressive
    decoding (sliding-window layers: keep 0; `max_kv_size`: keep 4). Before a forward of S
    positions starting at `offset`, only the positions its first query can see are kept:
    [0, keep) and [offset - window + 1, offset). A later query sees a subset of those plus
    the forward's own, and a rollback keeps at least the forward's first position, so
    nothing a query or a rejected draft's successor needs is ever evicted (mlx-lm's cache
    overwrites the oldest entries in place, so once it has wrapped, a trim would leave a
    hole). Each forward concatenates the kept positions with the new ones (what
    `RotatingKVCache` does for multi-token updates too); memory stays O(keep + window + S).

    Over several positions mlx-lm masks by buffer slot: query i of a prompt chunk sees the
    `keep + window` slots up to its own, so the kept first positions drop out of its view one
    by one. The masks here do the same, except inside `stepwise` (the verify forward), where
    each position sees what its own one-position step would. With keep 0 the two agree.
    """

    def __init__(self, window: int, keep: int = 0):
        self.window, self.keep = window, keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.dropped = 0  # positions dropped after the first `keep`: p >= keep is at p - dropped
        self.stepwise = False

    def _dropping(self) -> int:
        """How many positions after the first `keep` a forward from `offset` drops."""
        return max(0, self.offset - self.window + 1 - self.keep)

    def _first_visible(self) -> int:
        """The first position after the kept first ones that the next forward keeps."""
        return min(self.offset, self.keep + self._dropping())

    def held_positions(self) -> mx.array:
        """The positions of the keys the next forward keeps, in the order it keeps them."""
        kept = mx.arange(min(self.keep, self.offset))
        return mx.concatenate([kept, mx.arange(self._first_visible(), self.offset)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            dropped = self._dropping()
            head = min(self.keep, self.offset)  # the first positions, always kept
            lo, hi = self.keep + dropped - self.dropped, self.offset - self.dropped
            self.keys, self.values = (
                mx.concatenate([held[..., :head, :], held[..., lo:hi, :], new], axis=2)
                for held, new in ((self.keys, keys), (self.values, values))
            )
            self.dropped = dropped
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False
    ) -> mx.array | str | None:
        """The mask over the keys `update_and_fetch` will return for the next N positions."""
        if N == 1:
            return None
        held = self.offset - self._dropping()
        slots = window_size or self.keep + self.window
        if held + N <= slots and not return_array:
            return "causal"
        if self.stepwise and self.keep:
            keys = mx.concatenate([self.held_positions(), mx.arange(self.offset, self.offset + N)])
            queries = mx.arange(self.offset, self.offset + N)[:, None]
            return (keys <= queries) & ((keys < self.keep) | (keys > queries - self.window))
        return create_causal_mask(N, held, window_size=slots)

    def can_trim(self, n: int) -> bool:
        return n == self.offset or self.dropped <= max(
            0, self.offset - n - self.window + 1 - self.keep
        )

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(
                f"sliding-window cache holds positions {self.keep + self.dropped}.."
                f"{self.offset - 1}: cannot go back {n} positions"
            )
        self.offset -= n
        if self.offset == 0:
            self.keys = self.values = None
            self.dropped = 0
        return n

    def size(self) -> int:
        return min(self.offset, self.keep + self.window)

    @property
    def state(self) -> tuple[mx.array, mx.array] | list:
        return [] if self.keys is None else (self.keys, self.values)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


@contextmanager
def stepwise(caches: list[Any]) -> Iterator[None]:
    """Inside, a forward over several positions gives each the keys its own one-position step
    would see (`WindowKVCache`): the verify forward's positions are decoding steps, not a
    prompt chunk."""
    windows = [c for c in cache_parts(caches) if isinstance(c, WindowKVCache)]
    for c in windows:
        c.stepwise = True
    try:
        yield
    finally:
        for c in windows:
            c.stepwise = False


class QuantizingKVCache(KVCache):
    """mlx-lm's `KVCache` that turns into its `QuantizedKVCache` once it holds `start` positions.

    mlx-lm's `generate_step` quantizes a KVCache after a forward leaves it holding
    `quantized_kv_start` positions or more (`maybe_quantize_kv_cache`); every later step sees
    all keys quantized, its own too (it quantizes on store). Here the switch happens at the
    start of the next forward that writes to the cache, so that what counts is what the last
    rollback kept, and the cache stays the same object (a reply keeps its caches): it then
    has `bits`, which is how mlx-lm's attention tells a quantized cache, and stores as
    `QuantizedKVCache` does. Positions before the switch see float keys and those after it
    quantized ones, so no forward may span it (`forward_limit`); nor may a rollback go back
    before it, except to empty the cache.
    """

    def __init__(self, group_size: int, bits: int, start: int):
        super().__init__()
        self.quantization = (group_size, bits, start)

    @property
    def quantized(self) -> bool:
        return "bits" in vars(self)

    def positions_before_switch(self) -> int | None:
        """How many positions the next forward may take with float keys (None: any)."""
        start = self.quantization[2]
        return None if self.quantized or self.offset >= start else start - self.offset

    def quantize(self) -> None:
        """Switch to quantized keys and values, in place."""
        group_size, bits, _ = self.quantization
        quantized = self.to_quantized(group_size=group_size, bits=bits)
        self.keys, self.values = quantized.keys, quantized.values
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if not self.quantized and self.offset >= max(self.quantization[2], 1):
            self.quantize()
        if self.quantized:
            return QuantizedKVCache.update_and_fetch(self, keys, values)
        return super().update_and_fetch(keys, values)

    def keys_and_values(self) -> tuple[Any, Any]:
        return (QuantizedKVCache if self.quantized else KVCache).keys_and_values(self)

    def can_trim(self, n: int) -> bool:
        return not self.quantized or n == self.offset or self.offset - n >= self.quantization[2]

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(
                f"the KV cache is quantized from position {self.quantization[2]} on: "
                f"cannot go back {n} of its {self.offset} positions"
            )
        if n and n == self.offset:
            self.__init__(*self.quantization)
            return n
        return super().trim(n)

    @property
    def nbytes(self) -> int:
        return tree_reduce(lambda total, x: total + x.nbytes, (self.keys, self.values), 0)


Replay = Callable[[int], Any]


class RecurrentCache(ArraysCache):
    """A recurrent layer's state that can be rolled back into the last forward.

    Design: snapshot and replay. Before each forward the hook on the layer's
    mixer (the module the cache is passed to: GatedDeltaNet, short convolution,
    Mamba) calls `checkpoint`, which keeps references (no copies: MLX arrays are
    immutable and the mixer replaces them) to the state before the forward and
    a closure that re-runs the mixer on a prefix of the same input. `trim(n)`
    restores the snapshot and re-runs the first S - n positions. Only the
    cache's arrays are ever evaluated from the re-run, so lazy evaluation
    runs just the path that feeds the state (in_proj_qkv/a/b, conv,
    recurrence): the attention output, out_proj and the MLP/MoE are never
    computed, nor anything outside the mixer (Kimi's attention residuals). The
    re-run is queued lazily and evaluated together with the next verify, so it
    adds no synchronisation.

    Why not the alternatives: recording per-position states needs the
    recurrence's intermediate states, which mlx-lm's `gated_delta_update`
    does not expose (taking them would mean re-implementing the layer, and
    the SSM state is Hv x Dv x Dk floats per position, ~3 MB per layer for
    Qwen3.5-27B, times 16 positions). A fully accepted block costs nothing:
    the verify's own state is already right.

    On the CPU the replay costs a tenth to a third of the verify forward, as
    mlx-lm runs the recurrence one position at a time there (benchmarks/README.md,
    "Recurrent rollback cost (hybrid Qwen3.5 targets)").
    """

    def __init__(self, size: int):
        super().__init__(size)
        self.offset = 0
        self._checkpoint: tuple[list, int, int, Replay] | None = None

    def advance(self, N: int) -> None:
        super().advance(N)
        self.offset += N

    def checkpoint(self, num_positions: int, replay: Replay) -> None:
        """Remember the state before a forward of `num_positions` and how to re-run a prefix."""
        self._checkpoint = (list(self.cache), self.offset, num_positions, replay)

    def can_trim(self, n: int) -> bool:
        """Back to empty, or into the last forward if it was checkpointed (not one after it)."""
        if n in (0, self.offset):
            return True
        if self._checkpoint is None:
            return False
        _, offset, num_positions, _ = self._checkpoint
        return n <= num_positions and self.offset == offset + num_positions

    def trim(self, n: int) -> int:
        """Drop the last `n` positions; `trim(0)` just ends the last forward's checkpoint."""
        if n == 0:
            pass
        elif n == self.offset:
            self.cache = [None] * len(self.cache)
            self.offset = 0
        elif self.can_trim(n):
            state, offset, num_positions, replay = self._checkpoint
            self.cache, self.offset = list(state), offset
            if num_positions > n:
                replay(num_positions - n)
        else:
            raise ValueError(
                "a recurrent state can only be rolled back into its last forward "
                f"({self.offset} positions held, {n} to drop)"
            )
        self._checkpoint = None
        return n


class ChunkCache(ChunkedKVCache):
    """Chunked attention's keys/values (llama4), trimmable as far as its chunk is held.

    Before each forward mlx-lm keeps the last `chunk_size` positions, so after a
    forward the cache holds at least the committed positions of the chunk of the
    forward's first position, and a rollback into the forward keeps the chunk
    of every later query. Going back further (a prompt cache's shorter prefix)
    is allowed only while the new position's chunk is still wholly held; mlx-lm's
    own `trim` would clamp it silently.
    """

    def can_trim(self, n: int) -> bool:
        end = self.offset - n
        return n == self.offset or self.start_position <= end - end % self.chunk_size

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(
                f"chunked cache holds positions {self.start_position}..{self.offset - 1}: "
                f"cannot go back {n} positions"
            )
        if n == self.offset:
            self.keys = self.values = None
            self.offset = self.start_position = 0
            return n
        return super().trim(n)


class CacheGroup(CacheList):
    """One layer's several caches (mlx-lm's `CacheList`), each trimmed alike, with the
    offset of the first: MLA latents and the sparse-attention indexer's keys."""

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def can_trim(self, n: int) -> bool:
        return all(_can_trim(c, n) for c in self.caches)

    def trim(self, n: int) -> int:
        for c in self.caches:
            c.trim(n)
        return n


class CompressedWindowCache(LayerCache):
    """deepseek_v41's layer cache, trimmable into its last forward.

    mlx-lm's `LayerCache` holds the sliding window's last rows, the compressed
    KV of every closed group of `ratio` positions (with their indexer keys) and
    the rows of the open group. Here the window keeps the forward's rows beside
    the `window_size` before it (`window` shows the model its last
    `window_size`, as mlx-lm's), and the layer's compressor checkpoints the
    compressed state before each forward (`checkpoint`, from the hook that
    `hooks.hooked` gives it during each forward). `trim(n)` drops the window's last n rows,
    restores the checkpoint and re-runs the compressor on the forward's kept
    positions: that rebuilds the open group's rows, and the groups it closes
    keep the forward's own entries (a group's entry depends on its rows only).
    """

    kind = "compressed-attention"

    def __init__(self, window_size: int):
        super().__init__(window_size)  # its `window = None` empties `rows`
        self._checkpoint: tuple[tuple, int, int, Replay] | None = None

    @property
    def window(self) -> mx.array | None:
        return None if self.rows is None else self.rows[:, -self.window_size :]

    @window.setter
    def window(self, rows: mx.array | None) -> None:
        self.rows = rows

    def update_window(self, kv: mx.array) -> mx.array:
        """The window with `kv` appended; all of it is kept until the next trim."""
        window = kv if self.rows is None else mx.concatenate([self.window, kv], axis=1)
        self.rows = window
        self.offset += kv.shape[1]
        return window

    def checkpoint(self, num_positions: int, replay: Replay) -> None:
        """Remember the compressed state before this forward and how to re-run a prefix."""
        state = (self.compress_kv, self.index_k, self.pending_kv, self.pending_gate)
        self._checkpoint = (state, self.offset, num_positions, replay)

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        if n in (0, self.offset):
            return True
        held = 0 if self.rows is None else self.rows.shape[1]
        if n > held - min(self.window_size, self.offset - n):
            return False  # the window would lose rows a query still sees
        if self._checkpoint is None:  # a layer that compresses nothing has no state to undo
            return self.compress_kv is None and self.pending_kv is None
        _, offset, num_positions, _ = self._checkpoint
        return n <= num_positions and self.offset == offset

    def trim(self, n: int) -> int:
        """Drop the last `n` positions; `trim(0)` just ends the last forward's checkpoint."""
        if n == self.offset and n:
            self.__init__(self.window_size)
            return n
        if not self.can_trim(n):
            raise ValueError(
                "a compressed-attention cache can only be rolled back into its last forward "
                f"({self.offset} positions held, {n} to drop)"
            )
        if n:
            self.offset -= n
            self.rows = self.rows[:, : self.rows.shape[1] - n]
            if self._checkpoint is not None:
                self._reopen(n)
        self._checkpoint = None
        return n

    def _reopen(self, n: int) -> None:
        """The compressed state after the forward's first positions but the last `n`."""
        state, _, num_positions, replay = self._checkpoint
        entries, keys = self.compress_kv, self.index_k
        self.compress_kv, self.index_k, self.pending_kv, self.pending_gate = state
        if num_positions == n:
            return
        closed, _ = replay(num_positions - n)  # sets the open group's rows
        if closed is None:
            return
        kept = closed.shape[1] + (0 if state[0] is None else state[0].shape[1])
        self.compress_kv = entries[:, :kept]
        if keys is not None:  # an index key per entry
            self.index_k = keys[:, :kept]


CHECKPOINTED = (RecurrentCache, CompressedWindowCache)  # caches rolled back by a re-run


def cache_parts(caches: list[Any]) -> list[Any]:
    """The caches with each `CacheGroup` replaced by its own caches."""
    return [part for c in caches for part in getattr(c, "caches", [c])]


def trim_caches(caches: list[Any], length: int) -> int:
    """Trim every cache to `length` positions; if one cannot go back that far, empty all.

    Returns the length the caches now hold (`length` or 0).
    """
    if not all(c.offset <= length or _can_trim(c, c.offset - length) for c in caches):
        length = 0
    for c in caches:
        if c.offset > length:
            c.trim(c.offset - length)
    return length


def _can_trim(cache: Any, n: int) -> bool:
    """Ours know how far they can go back; mlx-lm's say whether they can at all."""
    can_trim = getattr(cache, "can_trim", None)
    return can_trim(n) if can_trim else cache.is_trimmable()


def forward_limit(caches: list[Any]) -> int | None:
    """The most positions the next forward may take (None: any): up to the switch of a
    `QuantizingKVCache`, which no forward may span."""
    limits = [
        c.positions_before_switch() for c in cache_parts(caches) if isinstance(c, QuantizingKVCache)
    ]
    return min(filter(None, limits), default=None)


def keep_path(caches: list[Any], start: int, nodes: list[int]) -> None:
    """After a tree forward from position `start`: keep only the accepted path.

    The K/V of tree node `nodes[i]` (at start + nodes[i]) moves to start + i and
    everything after the path is dropped, so the caches hold what a plain
    forward over the path's tokens would have written. KVCaches (a quantized one's
    keys and values are each three arrays) and WindowKVCaches (position p past the
    first kept ones at p - `cache.dropped`), also in a CacheGroup.
    """
    kept = len(nodes)
    moved = nodes != list(range(kept))  # else the path is in front already
    indices: dict[int, mx.array] = {}  # by first position: one for the layers alike
    for c in cache_parts(caches):
        if moved:
            first = start - getattr(c, "dropped", 0)  # the tree's first node in the arrays
            if first not in indices:
                indices[first] = mx.array([node + first for node in nodes])
            index = indices[first]
            for _, a in tree_flatten((c.keys, c.values)):
                a[..., first : first + kept, :] = mx.take(a, index, axis=2)
        c.trim(c.offset - start - kept)
