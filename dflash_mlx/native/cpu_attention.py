"""The verify forward's attention on the CPU: several query positions over a long KV cache.

Over many positions and a long KV cache a verify forward cost several one-position forwards,
most of it in the attention softmaxes' exps, which MLX's CPU backend takes one element at a time
(still dear through `cpu_math`'s compiled polynomial). `verify_attention.c` packs a KV head's
group of query rows (its heads x positions) as the lanes of vectors, so the scores, the running
maximum, the exps (`cpu_math`'s polynomial) and their sums run over whole vectors, and reads
every key and value once for the group, a tile at a time (flash attention's rescaling), with
the keys of a long cache split between OpenMP threads (benchmarks/README.md, "Long context").

Its own extension, an MLX primitive (`verify_attention.cpp`) built as `few_rows_quantized.py`'s
is (`mlx_extension.py`): unlike that product it need not match MLX's bits (the softmax is
`cpu_math`'s already, float32 rounding apart), so it is built with FMA, checked against a
float64 reference rather than MLX, and either can be used or off without the other. A build
failure or a failed check leaves `cpu_math.attention` in place and `status()` (`dflash-mlx
info`) says why; DFLASH_MLX_NO_CPU_ATTENTION=1 turns it off.

Called by `backends._cpu_sdpa` for float32 queries with no mask, a causal one or a boolean one
(a tree's ancestors); other masks and dtypes take `cpu_math.attention`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np

from . import cpu_math, mlx_extension

C_SOURCE = Path(__file__).with_name("verify_attention.c")
CXX_SOURCE = Path(__file__).with_name("verify_attention.cpp")
C_FLAGS = ("-O3", "-march=native", "-fPIC")

_reason = "not attempted"


def reference(queries, keys, values, scale: float, visible) -> np.ndarray:
    """Attention in float64 numpy: queries (B, H, L, D), keys and values (B, H_kv, S, D),
    `visible` a boolean array broadcastable to (B, H, L, S)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (queries, keys, values))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.where(visible, scale * q @ k.swapaxes(-1, -2), -np.inf)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def causal_visible(queries: int, keys: int) -> np.ndarray:
    """(queries, keys): query i sees the keys up to keys - queries + i."""
    return np.arange(keys - queries, keys)[:, None] >= np.arange(keys)[None]


def _check(ext: ModuleType) -> str | None:
    """Where the kernel strays from float64 attention by more than 1e-5 of the largest value
    (GQA; causal, tree and no mask; a strided view of a longer cache; keys split between
    threads), or None."""
    rng = np.random.default_rng(0)
    for L, S, mask in ((5, 40, "causal"), (16, 3000, "tree"), (3, 700, None)):
        q = rng.standard_normal((1, 6, L, 64)).astype(np.float32)
        cache = rng.standard_normal((2, 1, 2, S + 9, 64)).astype(np.float32)
        k, v = (mx.array(c)[:, :, :S] for c in cache)
        visible = causal_visible(L, S) if mask else np.ones((L, S), bool)
        if mask == "tree":
            visible[:, S - L :] &= rng.random((L, L)) < 0.5
            visible[:, S - L :] |= np.eye(L, dtype=bool)
        given = mx.array(visible) if mask == "tree" else None
        ours = np.array(ext.verify_attention(mx.array(q), k, v, 0.125, given, mask == "causal"))
        exact = reference(q, np.array(k), np.array(v), 0.125, visible)
        if np.max(np.abs(ours - exact)) > 1e-5 * np.max(np.abs(exact)):
            return f"differs from float64 attention ({mask or 'no'} mask, {L} queries, {S} keys)"
    return None


@cache
def extension() -> ModuleType | None:
    """The built extension, checked on this machine; None where it is disabled, cannot be
    built or fails its check (the reason is kept for `status`)."""
    global _reason
    ext, why = mlx_extension.load_checked(
        "verify_attention", C_SOURCE, CXX_SOURCE, C_FLAGS, "DFLASH_MLX_NO_CPU_ATTENTION", _check
    )
    if ext is None:
        _reason = f"{why}; cpu_math's"
        return None
    _reason = "in use for float32 with causal, boolean or no masks"
    return ext


def status() -> str:
    """Which attention a verify forward over several positions takes on the CPU, in words."""
    extension()
    return _reason


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
) -> mx.array:
    """`cpu_math.attention`'s result (same arguments and masks): by the kernel for float32 with
    no mask, "causal" or a boolean mask, on the CPU, where it is built; else by `cpu_math`."""
    ext = extension()
    boolean = isinstance(mask, mx.array) and mask.dtype == mx.bool_
    if (
        ext is None
        or not (boolean or mask is None or (isinstance(mask, str) and mask == "causal"))
        or mx.default_device() != mx.cpu
        or queries.ndim != 4
        or any(a.dtype != mx.float32 for a in (queries, keys, values))
    ):
        return cpu_math.attention(queries, keys, values, scale, mask)
    return ext.verify_attention(
        queries, keys, values, scale, mask if boolean else None, mask is not None
    )
