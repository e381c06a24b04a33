"""Target caches that can drop the rejected tail of a verified block.

mlx-lm's `KVCache` is trimmed by moving its offset back. Other cache kinds
cannot be, and are replaced by the classes here when the target's cache is made:

- `WindowKVCache` for sliding-window layers (mlx-lm's `RotatingKVCache`
  overwrites the oldest entries in place, so once it has wrapped, a trim
  would leave a hole where a rejected draft evicted a still-needed entry).
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

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, _BaseCache
from mlx_lm.models.deepseek_v41 import LayerCache


class WindowKVCache(_BaseCache):
    """Sliding-window keys/values, kept in temporal order and trimmable after any forward.

    Before a forward of S positions starting at `offset`, only the positions
    its first query can see are kept: [offset - window + 1, offset). A later
    query sees a subset of those plus the forward's own, and a rollback keeps
    at least the forward's first position, so nothing a query or a rejected
    draft's successor needs is ever evicted. The attention mask limits every
    query to exactly its `window` positions, i.e. what mlx-lm's
    `RotatingKVCache` holds during autoregressive decoding. Each forward
    concatenates the kept window-1 positions with the new ones (what
    `RotatingKVCache` does for multi-token updates too); memory stays
    O(window + block).
    """

    def __init__(self, window: int):
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.start = 0  # absolute position of keys[..., 0, :]

    def _first_visible(self) -> int:
        return max(0, self.offset - self.window + 1)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        first = self._first_visible()
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            lo, hi = first - self.start, self.offset - self.start
            self.keys = mx.concatenate([self.keys[..., lo:hi, :], keys], axis=2)
            self.values = mx.concatenate([self.values[..., lo:hi, :], values], axis=2)
        self.start = first
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False
    ) -> mx.array | str | None:
        """The mask over the keys `update_and_fetch` will return for the next N positions."""
        if N == 1:
            return None
        kept = self.offset - self._first_visible()
        if kept + N <= self.window and not return_array:
            return "causal"
        return create_causal_mask(N, kept, window_size=window_size or self.window)

    def can_trim(self, n: int) -> bool:
        return n == self.offset or self.start <= max(0, self.offset - n - self.window + 1)

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            raise ValueError(
                f"sliding-window cache holds positions {self.start}..{self.offset - 1}: "
                f"cannot go back {n} positions"
            )
        self.offset -= n
        if self.offset == 0:
            self.keys = self.values = None
            self.start = 0
        return n

    def size(self) -> int:
        return min(self.offset, self.window)

    @property
    def state(self) -> tuple[mx.array, mx.array] | list:
        return [] if self.keys is None else (self.keys, self.values)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


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
    `hooks.capture` puts on it). `trim(n)` drops the window's last n rows,
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


def keep_path(caches: list[Any], start: int, nodes: list[int]) -> None:
    """After a tree forward from position `start`: keep only the accepted path.

    The K/V of tree node `nodes[i]` (at start + nodes[i]) moves to start + i and
    everything after the path is dropped, so the caches hold what a plain
    forward over the path's tokens would have written. KVCaches and
    WindowKVCaches (whose arrays begin at position `cache.start`), also in a CacheGroup.
    """
    kept = len(nodes)
    for c in cache_parts(caches):
        first = start - getattr(c, "start", 0)  # the tree's first node in the arrays
        if nodes != list(range(kept)):  # the path is not already in front
            index = mx.array(nodes) + first
            c.keys[..., first : first + kept, :] = mx.take(c.keys, index, axis=2)
            c.values[..., first : first + kept, :] = mx.take(c.values, index, axis=2)
        c.trim(c.offset - start - kept)
