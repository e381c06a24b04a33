"""Vectorisable exp, SwiGLU, attention and log-sum-exp for float32 work on the CPU, and
RMSNorm and RoPE compiled.

MLX's x86 CPU build runs element-wise ops one element at a time, and its `exp`
(also inside `sigmoid`, `softmax` and the SDPA fallback) calls libm's `fmaf`
six times per element, many times a multiply's cost (benchmarks/README.md, "What
is left of the premium: MLX's CPU `exp`"); a verify forward over many positions
takes over a million exps, in the SwiGLUs and the attention softmaxes.
Written as MLX ops (the same range reduction and Cephes polynomial, with the 2^n
scale built from its exponent bits) and compiled, the exp fuses into a few loops
the JIT compiler vectorises (benchmarks/README.md, "The exp in MLX ops:
`cpu_math`"), and stays within 1.4 units in the last place of the true value
(MLX's own is off by up to ~20 on large arguments).

Only arguments ≤ 0 are needed (a softmax or log-sum-exp after subtracting the
row maximum, a sigmoid through exp(-|x|)), so there is no overflow to handle; results
below float32's smallest normal number flush to 0. Math on arrays: what uses
it, and when, is its callers' business (`models/target.py`'s verify forward,
`decode/sampling.py`'s normalisations, `models/draft.py`'s block).

MLX's CPU backend has no fused RMSNorm or RoPE: `mx.fast.rms_norm` and
`mx.fast.rope` fall back to 8-20 small ops each, over a hundred such calls a forward,
every op costing microseconds beyond its arithmetic. Compiled once per shape (the offset
an array, so one trace serves every position), they fuse into a few loops with the same
bits (benchmarks/README.md, "Compiled norms and RoPE"). The RoPEs of one forward share
one table of cosines and sines (`shared_rope_tables`): 5 ops each instead of 13. `COMPILED_CLASSES`
gives norm and RoPE modules a class that calls them, for callers to swap in per instance
while they build a graph.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that n * _LN2_HI is exact
_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds to the nearest integer
_SMALLEST = -87.33654  # log of float32's smallest normal number


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """e^x for x <= 0 as p * 2^n: (p, the float32 bits of 2^n as int32). The bits become
    a float by a view, which a shapeless compiled function cannot hold: callers view
    between two compiled pieces."""
    x = mx.minimum(x, 0.0)
    normal = (x >= _SMALLEST).astype(x.dtype)
    x = mx.maximum(x, _SMALLEST)
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = x - n * _LN2_HI - n * _LN2_LO  # |r| <= ln(2) / 2
    p = _POLY[0]
    for c in _POLY[1:]:
        p = p * r + c
    p = p * r * r + r + 1.0  # e^r (Cephes' expf polynomial)
    return p * normal, (n.astype(mx.int32) + 127) << 23


_shifted_exp_parts = mx.compile(lambda x, shift: _exp_parts(x - shift), shapeless=True)


@mx.compile
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    p, bits = _exp_parts(-mx.abs(gate))
    e = p * bits.view(mx.float32)  # e^-|gate|: sigmoid(gate) is 1 / (1 + e) or e / (1 + e)
    positive = (gate >= 0).astype(gate.dtype)
    return gate * (positive + (1.0 - positive) * e) / (1.0 + e) * up


def _shifted_exp(x: mx.array, shift: mx.array | float) -> mx.array:
    """e^(x - shift) for x <= shift."""
    p, bits = _shifted_exp_parts(x, shift)
    return p * bits.view(mx.float32)


def exp_nonpositive(x: mx.array) -> mx.array:
    """e^x for float32 x <= 0 (x > 0 is taken as 0), vectorised."""
    return _shifted_exp(x, 0.0)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, as mlx-lm's SwiGLU MLPs compute it. Compiled once per shape (the
    bits' view needs one), which suits a verify forward's few row counts."""
    return _swiglu(gate, up)


def _unnormalised_softmax_from(x: mx.array, top: mx.array) -> tuple[mx.array, mx.array]:
    """(e^(x - top), its sum) over the last axis, for `top` >= every x in its row."""
    e = _shifted_exp(x, top)
    return e, e.sum(axis=-1, keepdims=True)


def _unnormalised_softmax(x: mx.array) -> tuple[mx.array, mx.array]:
    """(e^(x - max x), its sum) over the last axis."""
    return _unnormalised_softmax_from(x, x.max(axis=-1, keepdims=True))


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis."""
    e, total = _unnormalised_softmax(x)
    return e / total


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(e^x)) over the last axis, kept as an axis of 1 (-inf for a row of -inf)."""
    top = mx.maximum(x.max(axis=-1, keepdims=True), -mx.finfo(x.dtype).max)
    _, total = _unnormalised_softmax_from(x, top)
    return top + mx.log(total)


@mx.compile
def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """`mx.fast.rms_norm`, compiled (one trace per shape and eps)."""
    return _rms_norm(x, weight, eps)


@mx.compile
def _rope(x, offset, dims, traditional, base, scale, freqs):
    return mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs
    )


@lru_cache(maxsize=16)
def _unit_pairs(dims: int, traditional: bool) -> np.ndarray:
    """Rotation pairs (1, 0): mx.fast.rope turns them into its own cosines (first of
    each pair) and sines (second), bit for bit."""
    pairs = np.zeros((dims // 2, 2) if traditional else (2, dims // 2), dtype=np.float32)
    pairs[(slice(None), 0) if traditional else 0] = 1.0
    return pairs.reshape(dims)


@mx.compile
def _rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """`x` rotated by the table over its first 2 x (cos's last axis) features, as
    mx.fast.rope's fallback rotates them, the rest kept: one compiled call per RoPE."""
    dims = 2 * cos.shape[-1]
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    else:
        x1, x2 = x[..., : dims // 2], x[..., dims // 2 : dims]
    first, second = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if traditional:
        parts = [mx.stack([first, second], axis=-1).reshape(*x.shape[:-1], dims)]
    else:
        parts = [first, second]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1)


_tables = threading.local()


@contextmanager
def shared_rope_tables() -> Iterator[None]:
    """While a forward's graph is built on this thread, its RoPEs at one offset over one
    length share one table of cosines and sines: a SmolLM2 forward has 60 RoPEs at the
    same positions, each ~8 ops of table of its own otherwise."""
    outer = getattr(_tables, "memo", None)
    _tables.memo = {}
    try:
        yield
    finally:
        _tables.memo = outer


def _rope_table(
    x: mx.array, dims: int, traditional: bool, base, scale, offset: int | mx.array, freqs
) -> tuple[mx.array, mx.array]:
    """(cos, sin), (rows, 1, T, dims / 2): what mx.fast.rope rotates the 4-d `x` by,
    shared within `shared_rope_tables`. An offset of one entry per row and position (a
    tree's nodes) is taken as one row per position and placed back. The memo holds each
    key's offset and freqs, so no id in its keys can be reused while it lives."""
    array = isinstance(offset, mx.array)
    rows, length = offset.size if array else 1, x.shape[-2]
    position = id(offset) if array else offset
    key = (position, id(freqs), length, rows, dims, traditional, base, scale, x.dtype)
    memo = getattr(_tables, "memo", None)
    found = None if memo is None else memo.get(key)
    if found is not None:
        return found[2]
    if not array:  # one trace serves every position
        offset = mx.array(offset, dtype=mx.int32)
    placed = length > 1 and rows == x.shape[0] * length
    unit = mx.array(_unit_pairs(dims, traditional)).astype(x.dtype)
    unit = mx.broadcast_to(unit, (rows, 1, 1 if placed else length, dims))
    table = _rope(unit, offset, dims, traditional, base, scale, freqs)
    if placed:
        table = table.reshape(x.shape[0], 1, length, dims)
    half = dims // 2
    if traditional:
        cos, sin = table[..., 0::2], table[..., 1::2]
    else:
        cos, sin = table[..., :half], table[..., half:]
    if memo is not None:
        memo[key] = (offset, freqs, (cos, sin))
    return cos, sin


def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: int | mx.array,
    freqs: mx.array | None = None,
) -> mx.array:
    """`mx.fast.rope` with its bits, from a table of cosines and sines compiled once per
    shape (an int offset becomes an array, so one trace serves every position) and shared
    by a forward's RoPEs (`shared_rope_tables`). `offset` may also hold one position per
    row and query (a tree forward's nodes), which mx.fast.rope cannot take."""
    shape = x.shape
    if len(shape) == 3:
        x = x[:, None]
    elif len(shape) > 4:
        x = x.reshape(shape[0], -1, *shape[-2:])
    cos, sin = _rope_table(x, dims, traditional, base, scale, offset, freqs)
    out = _rotate(x, cos, sin, traditional)
    return out if len(shape) == 4 else out.reshape(shape)


def _compiled_rms_norm(self: nn.RMSNorm, x: mx.array) -> mx.array:
    return _rms_norm(x, self["weight"], self.eps)


def _compiled_rope(self: nn.RoPE, x: mx.array, offset: int | mx.array = 0) -> mx.array:
    return rope(
        x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale, offset=offset
    )


def _compiled_freqs_rope(self: nn.Module, x: mx.array, offset: int | mx.array = 0) -> mx.array:
    """Llama3RoPE's and ProportionalRoPE's own call: mx.fast.rope over their frequencies."""
    return rope(
        x,
        self.dims,
        traditional=self.traditional,
        base=None,
        scale=1.0,
        offset=offset,
        freqs=self._freqs,
    )


# The class a norm or RoPE module of these classes takes, per instance, while a forward's
# graph is built on the CPU: its own call, with `rms_norm` / `rope`. The RoPEs place each
# query at its own position when given one offset per query (`places_queries`: a tree
# forward's hook then passes its nodes' positions as they are).
COMPILED_CLASSES = {
    cls: type(
        f"Compiled{cls.__name__}",
        (cls,),
        {"__call__": call, "places_queries": call is not _compiled_rms_norm},
    )
    for cls, call in (
        (nn.RMSNorm, _compiled_rms_norm),
        (nn.RoPE, _compiled_rope),
        (Llama3RoPE, _compiled_freqs_rope),
        (ProportionalRoPE, _compiled_freqs_rope),
    )
}


def compiled_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules among `modules` (and their submodules) that have a `COMPILED_CLASSES` class."""
    return [m for module in modules for m in module.modules() if type(m) in COMPILED_CLASSES]


@lru_cache(maxsize=8)
def _causal_mask(queries: int, keys: int) -> mx.array:
    """0 where query i may see key j (j <= keys - queries + i), -inf elsewhere: one array
    for all the layers of a forward, made from data (no graph to share between threads)."""
    seen = np.arange(keys - queries, keys)[:, None] >= np.arange(keys)[None]
    return mx.array(np.where(seen, 0.0, -np.inf).astype(np.float32))


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` without sinks, its softmax through `softmax`.

    queries (B, H, L, D); keys and values (B, H_kv, S, D) with H a multiple of
    H_kv (grouped-query heads attend their group's key); `mask` None, "causal"
    (query i sees the keys up to S - L + i), a boolean array (True: seen) or an
    additive one, broadcastable to (B, H, L, S).
    """
    B, H, L, D = queries.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    group = (B, kv_heads, H // kv_heads)
    scores = (queries * scale).reshape(*group, L, D) @ keys[:, :, None].swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = _causal_mask(L, S)
    if mask is not None:
        if mask.ndim > 2:
            mask = mx.broadcast_to(mask, (mask.shape[0] if mask.ndim == 4 else 1, H, L, S))
            mask = mask.reshape(mask.shape[0], kv_heads, H // kv_heads, L, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask.astype(scores.dtype)
    e, total = _unnormalised_softmax(scores)
    out = (e @ values[:, :, None]) / total  # normalised after: L x D divisions, not L x S
    return out.reshape(B, H, L, values.shape[-1])
