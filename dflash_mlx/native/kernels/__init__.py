"""Attention of the drafter's block over the cached context plus the block itself.

`block_attention` runs a custom Metal kernel on Apple GPUs (after a one-time
self-check) and an MLX-ops reference elsewhere. The backend can be forced by
argument or by the DFLASH_MLX_KERNELS environment variable.
"""

import logging
import os

import mlx.core as mx

from . import metal
from .reference import reference_attention

ENV_VAR = "DFLASH_MLX_KERNELS"
BACKENDS = ("auto", "metal", "reference")

logger = logging.getLogger(__name__)
_self_check: dict[str, str | None] = {}


def requested_backend(backend: str = "auto") -> str:
    """`backend`, or for "auto" what DFLASH_MLX_KERNELS asks for ("reference": no custom
    kernels anywhere, the drafter's block attention nor the CUDA verify attention)."""
    if backend == "auto":
        backend = os.environ.get(ENV_VAR) or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"Unknown kernels backend {backend!r}; expected one of {BACKENDS}")
    return backend


def _metal_failure() -> str | None:
    """Why the Metal kernel cannot be used in this process, or None if it can."""
    if not mx.metal.is_available():
        return "Metal is not available"
    if "result" not in _self_check:
        failure = metal.self_check()
        if failure is not None:
            logger.warning("Metal block-attention kernel disabled (%s); using reference", failure)
        _self_check["result"] = failure
    return _self_check["result"]


def active_backend(backend: str = "auto") -> str:
    """The backend `block_attention(..., backend=backend)` uses: "metal" or "reference".

    "auto" (unless DFLASH_MLX_KERNELS says otherwise) picks Metal when it is
    available and its self-check passed; a forced "metal" raises instead.
    """
    return _active(requested_backend(backend))


def _active(backend: str) -> str:
    """`active_backend` of a backend already requested (`requested_backend`)."""
    if backend == "reference":
        return "reference"
    failure = _metal_failure()
    if failure is None:
        return "metal"
    if backend == "metal":
        raise RuntimeError(f"Metal block-attention kernel unavailable: {failure}")
    return "reference"


def block_attention(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    scale: float,
    backend: str = "auto",
) -> mx.array:
    """Non-causal attention of the block's queries over context then block keys.

    queries (B, Hq, L, D); ctx_keys/values (B, Hkv, S, D), S >= 0, possibly a
    strided slice of a cache buffer; block_keys/values (B, Hkv, L, D); Hq is a
    multiple of Hkv. Returns (B, Hq, L, D) in the queries' dtype.
    """
    args = (queries, ctx_keys, ctx_values, block_keys, block_values)
    backend = requested_backend(backend)
    if _active(backend) == "metal":
        if metal.supports(*args):
            return metal.metal_attention(*args, scale=scale)
        if backend == "metal":
            raise ValueError(
                f"Metal kernel does not support {queries.dtype}, head dim {queries.shape[-1]}"
            )
    return reference_attention(*args, scale=scale)


__all__ = ["BACKENDS", "ENV_VAR", "active_backend", "block_attention", "reference_attention"]
