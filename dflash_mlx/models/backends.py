"""Which code a forward takes on this backend: the one place that decides.

`current()` names the backend: "cpu" (MLX's CPU: `cpu_math`'s vectorised exps
and compiled norms and RoPEs), "cuda" (MLX's CUDA backend with this package's
kernels: the verify-attention kernel and the few-rows products of
`native/kernels/cuda.py`), "metal" (Metal with the few-row quantized products of
`native/kernels/metal_quantized.py`), or None (DFLASH_MLX_KERNELS=reference on a GPU, or
Metal whose kernel failed its self-check: mlx-lm's and MLX's code as it is). The
target's verify forward (`TargetAdapter.forward`) and the drafter's block
(`DFlashDraft`) ask here for their swaps (`native/swaps.py`): modules change class while
a graph is built, so the model code runs unchanged and other models see mlx-lm's
classes.

On the CPU, MLX's `exp` is scalar: over 16 positions and a long context the
SwiGLUs' and softmaxes' exps are a large part of a verify forward, so the modules
calling mlx-lm's `swiglu` or `scaled_dot_product_attention` take `cpu_math`'s;
norms and RoPEs run compiled in every forward, one position included (mlx-lm's
bits from fewer ops). On CUDA, MLX sends 4 or more bf16/fp16 queries to cuDNN,
whose graphs are cached by shape while every cycle has more keys than the last:
attention takes the verify kernel, and plain linear layers and the LM head the
few-rows kernel in place of cuBLAS (measurements: benchmarks/README.md, "cpu_math",
"Compiled norms and RoPE", "Verify forward on an H100"). On Metal, quantized linear layers
and LM heads take a kernel that reads each packed weight once for 2-16 rows and sums every
row as MLX's one-row product does, so verify logits equal decoding's bit for bit. On every
backend, DeepSeek-V3.2's sparse attention (glm_moe_dsa) computes each verify query as
decoding does (`sparse_attention.py`): mlx-lm writes one query and several two ways, and
a top-k selection can turn their rounding into other keys. For the same reason a target with
such an attention verifies with decoding's bits throughout: its forward keeps mlx-lm's SwiGLU
and SDPA (whose exps `cpu_math` and the CUDA kernel round otherwise) and takes only the few-row
products that sum as MLX's one-row product does (`BITWISE_FEW_ROWS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from ..native import cpu_attention, cpu_math, few_rows_quantized
from ..native.kernels import cuda as cuda_kernels
from ..native.kernels import metal_quantized
from ..native.swaps import Swap, rebound_class, swapped
from . import hooks, sparse_attention

PATHS = {
    "cpu": "cpu_math exps, compiled norms and RoPE",
    "cuda": "CUDA verify-attention and few-rows product kernels",
    "metal": "Metal few-row quantized product kernel",
    None: "mlx-lm's forward",
}


def current() -> str | None:
    """ "cpu", "cuda", "metal" or None: see the module docstring."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if cuda_kernels.enabled():
        return "cuda"
    if metal_quantized.enabled():
        return "metal"
    return None


def _cpu_sdpa(queries, keys, values, cache, scale, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` by `cpu_attention` (its kernel, else `cpu_math`'s
    softmax) where it applies."""
    if sinks is not None or hasattr(cache, "bits") or queries.dtype != mx.float32:
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return cpu_attention.attention(queries, keys, values, scale, mask)


def _cpu_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """mlx-lm's `swiglu` by `cpu_math`'s float32 exp where it applies: a half-precision MLP
    keeps mlx-lm's, so its forward stays in its own dtype as decoding's does."""
    if gate.dtype != mx.float32:
        return swiglu(gate, up)
    return cpu_math.swiglu(gate, up)


def _cuda_sdpa(queries, keys, values, cache, scale, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, with the CUDA verify kernel for a causal block
    (MLX's semantics: the last n keys are the block's) and for a tree over a plain KV cache."""
    tree = hooks.tree_of(cache)
    usable = (
        sinks is None
        and not hasattr(cache, "bits")
        and cuda_kernels.supports(queries, keys, values)
    )
    if usable and tree is None and isinstance(mask, str) and mask == "causal":
        visible = cuda_kernels.causal(queries.shape[2])
    elif usable and tree is not None and isinstance(cache, KVCache):
        visible = tree.visible  # the whole cache is visible to every node, and its ancestors
    else:
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return cuda_kernels.verify_attention(queries, keys, values, visible, scale)


# A module whose `__call__` calls these mlx-lm functions (as globals of its own module)
# calls the replacements instead during a verify forward on that backend.
REPLACEMENTS = {
    "cpu": {
        "swiglu": (swiglu, _cpu_swiglu),
        "scaled_dot_product_attention": (scaled_dot_product_attention, _cpu_sdpa),
    },
    "cuda": {"scaled_dot_product_attention": (scaled_dot_product_attention, _cuda_sdpa)},
}
TAGS = {"cpu": "CpuMath", "cuda": "CudaVerify"}


# The few-row product class a layer takes on each backend that has one (None: keep its own).
FEW_ROWS_CLASS = {
    "cpu": few_rows_quantized.few_rows_class,
    "cuda": cuda_kernels.few_rows_class,
    "metal": metal_quantized.few_rows_class,
}


# The backends whose few-row products give each row MLX's one-row bits.
BITWISE_FEW_ROWS = ("cpu", "metal")


# The LM head as the drafter's block (2-16 rows) multiplies by it, per backend (None: MLX's).
FEW_ROWS_HEAD = {
    "cpu": few_rows_quantized.head,
    "cuda": cuda_kernels.few_rows_head,
    "metal": metal_quantized.few_rows_head,
}


def verify_swaps(
    modules: list[nn.Module | None],
    backend: str | None,
    positions: int,
    attention: Callable[..., mx.array] | None = None,
) -> list[Swap]:
    """The swaps of a target forward over `positions` on `backend`, for the modules inside
    `modules` (None: another pipeline rank's layer): on the CPU the norms and RoPEs
    (compiled) and, over several positions, SwiGLU, SDPA and the quantized layers and LM head
    (`few_rows_quantized.few_rows_class`); on CUDA, over several positions, SDPA and the linear
    layers and LM head, plain or quantized (`kernels.cuda.few_rows_class`); on Metal, over
    several positions, the quantized ones (`metal_quantized.few_rows_class`). Over several
    positions a sparse attention computes each query as decoding does (`sparse_class`), and
    the forward of a target with one takes no swap that changes bits (`BITWISE_FEW_ROWS`).
    `attention` replaces mlx-lm's `scaled_dot_product_attention` everywhere (a batched forward's,
    `rows.attention`, which calls the backend's own per row).
    """
    several = positions > 1
    present = [m for module in filter(None, modules) for m in module.modules()]
    # a top-k selection turns any rounding into other keys: decoding's bits everywhere
    bitwise = several and any(isinstance(m, sparse_attention.SPARSE_ATTENTIONS) for m in present)
    few_rows_class = FEW_ROWS_CLASS.get(backend)
    if bitwise and backend not in BITWISE_FEW_ROWS:
        few_rows_class = None
    replacing = None if bitwise else backend
    swaps = []
    for m in present:
        if several and few_rows_class and (few := few_rows_class(m)):
            swaps.append((m, type(m), few))
        elif backend == "cpu" and type(m) in cpu_math.COMPILED_CLASSES:
            swaps.append((m, type(m), cpu_math.COMPILED_CLASSES[type(m)]))
        elif several and attention is None and (decoding := sparse_class(m, replacing)):
            swaps.append((m, type(m), decoding))
        elif verify := verify_class(type(m), replacing, several, attention):
            swaps.append((m, type(m), verify))
    return swaps


def sparse_class(module: nn.Module, backend: str | None) -> type | None:
    """The class a sparse attention takes over several positions: each query as decoding
    computes it (`sparse_attention.py`), with the backend's own swap for tree forwards."""
    if not isinstance(module, sparse_attention.SPARSE_ATTENTIONS):
        return None
    cls = type(module)
    return sparse_attention.verify_class(verify_class(cls, backend) or cls)


def verify_class(
    cls: type,
    backend: str | None,
    several: bool = True,
    attention: Callable[..., mx.array] | None = None,
) -> type | None:
    """The class a module of class `cls` takes in a verify forward on `backend` (over
    several positions, or one) for the functions it calls, or None when it calls none that
    is replaced there; `attention` replaces mlx-lm's SDPA too."""
    replacements = dict(REPLACEMENTS.get(backend, {})) if several else {}
    tag = TAGS.get(backend, "") if several else ""
    if attention is not None:
        replacements["scaled_dot_product_attention"] = (scaled_dot_product_attention, attention)
        tag = f"Rows{tag}"
    return rebound_class(cls, replacements, tag) if replacements else None


def block_swaps(modules: list[nn.Module], backend: str | None) -> list[Swap]:
    """The swaps of the drafter's block (2-16 rows) on `backend`: on the CPU its norms and
    RoPEs run compiled and its quantized layers take the few-row product, on CUDA its linear
    layers (plain or quantized) take a few-rows kernel, on Metal its quantized ones."""
    if backend == "cpu":
        compiled = [
            (m, type(m), cpu_math.COMPILED_CLASSES[type(m)])
            for m in cpu_math.compiled_modules(modules)
        ]
        return compiled + few_rows_quantized.swaps(modules)
    if backend == "cuda":
        return [
            (m, type(m), few)
            for m in cuda_kernels.linears(modules)
            if (few := cuda_kernels.few_rows_class(m))
        ]
    if backend == "metal":
        return [
            (m, type(m), few)
            for module in modules
            for m in module.modules()
            if (few := metal_quantized.few_rows_class(m))
        ]
    return []


@contextmanager
def building(swaps: list[Swap]) -> Iterator[None]:
    """While a graph is built: `swaps` in place, and the RoPEs of the forward sharing one
    table of cosines and sines (`cpu_math.shared_rope_tables`)."""
    with swapped(swaps), cpu_math.shared_rope_tables():
        yield
