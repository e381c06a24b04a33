"""Few-row products with MLX's affine 4- and 8-bit weights on the CPU, bit for bit MLX's own.

MLX's CPU `quantized_matmul` is not batched over rows: a product over 16 rows costs 16 one-row
products, so a verify forward of a model kept quantized cost many times one position
(benchmarks/README.md, "CPU: quantized models kept quantized"). `few_rows_qmm.c` reads each packed
weight once for up to 32 rows (16 where the CPU has AVX but not AVX-512), and sums each row's
terms in exactly the order and rounding of MLX's one-row product, so greedy output stays
mlx-lm's token for token.

It reaches MLX's lazy graph as a C++ primitive (`few_rows_qmm.cpp`): a subclass of MLX's
`UnaryPrimitive` whose CPU evaluation calls the C product on MLX's CPU stream, bound to Python
with nanobind in MLX's own nanobind domain, so `mx.array`s pass in and out as they are. That
is how MLX documents custom CPU ops; the alternatives break the graph (evaluating x and calling
C through ctypes: a synchronisation per layer) or exist only on a GPU (`mx.fast.metal_kernel`,
`mx.fast.cuda_kernel`). The extension is built once per machine against the installed wheel's
headers and library (cached: `mlx_extension.py`), then checked against `mx.quantized_matmul` for
4/8 bits x groups 32/64/128 before it is used: a build failure or a single differing bit (a
wheel whose product sums in another order, as MLX's SIMD path on ARM does) leaves MLX's own
product in place, and `status()` (`dflash-mlx info`) says why. DFLASH_MLX_NO_FEW_ROWS_QMM=1
turns it off.

Used per instance, while a verify forward's or a drafter block's graph is built on the CPU
(`backends.verify_swaps`, `backends.block_swaps`): quantized linear layers and tied quantized
heads take `FEW_ROWS_CLASSES`, whose calls take the few-row product for 2..`max_rows()` rows of
float32 and MLX's product otherwise (one row, mxfp4 and other modes, 2/3/5/6 bits, bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import mlx_extension
from .swaps import Swap

C_SOURCE = Path(__file__).with_name("few_rows_qmm.c")
CXX_SOURCE = Path(__file__).with_name("few_rows_qmm.cpp")
C_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC")  # no FMA: MLX's rounding
BITS, GROUP_SIZES = (4, 8), (32, 64, 128)

_reason = "not attempted"


def _differs_from_mlx(ext: ModuleType) -> str | None:
    """Where the extension's product differs from MLX's one-row products by any bit (odd N,
    K past a whole chunk, 2 and the most rows), in words, or None."""
    rng = np.random.default_rng(0)
    n, k = 40, 384
    for bits in BITS:
        for group in GROUP_SIZES:
            w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
            wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
            for rows in (2, ext.max_rows()):
                x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
                ours = ext.quantized_matmul(x, wq, scales, biases, bits, group)
                theirs = [
                    mx.quantized_matmul(row[None], wq, scales, biases, group_size=group, bits=bits)
                    for row in x
                ]
                if not np.array_equal(np.array(ours), np.array(mx.concatenate(theirs))):
                    return f"differs from MLX's product ({bits}-bit, group {group}, {rows} rows)"
    return None


@cache
def extension() -> ModuleType | None:
    """The built extension, checked against MLX's product on this machine; None where it is
    disabled, cannot be built or differs (the reason is kept for `status`)."""
    global _reason
    ext, why = mlx_extension.load_checked(
        "few_rows_qmm",
        C_SOURCE,
        CXX_SOURCE,
        C_FLAGS,
        "DFLASH_MLX_NO_FEW_ROWS_QMM",
        _differs_from_mlx,
    )
    if ext is None:
        _reason = f"{why}; MLX's product"
        return None
    _reason = f"in use for 2-{ext.max_rows()} rows, 4/8 bits"
    return ext


def status() -> str:
    """Which product quantized layers take over several rows on the CPU, in words."""
    extension()
    return _reason


def max_rows() -> int:
    """The most rows one few-row product takes (0 where there is none)."""
    ext = extension()
    return ext.max_rows() if ext else 0


def _layout_supported(module: nn.Module) -> bool:
    """Whether `module`'s weights are in a layout the product takes: affine, 4 or 8 bits,
    group 32/64/128, float32 scales and biases."""
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.bits in BITS
        and module.group_size in GROUP_SIZES
        and "biases" in module
        and module["scales"].dtype == mx.float32
        and module["biases"].dtype == mx.float32
        and module["weight"].ndim == 2
    )


def quantized_matmul(x: mx.array, module: nn.Module, weights: dict | None = None) -> mx.array:
    """`x` times the transposed quantized `weights` (default: `module`'s own; `module` gives
    the layout), as `mx.quantized_matmul` computes it, bit for bit: over 2..`max_rows()` rows
    of a float32 x on the CPU by the few-row product, otherwise by MLX's."""
    w = module if weights is None else weights
    rows = x.size // x.shape[-1] if x.ndim else 0
    ext = extension()
    if (
        ext is not None
        and 2 <= rows <= ext.max_rows()
        and x.dtype == mx.float32
        and x.shape[-1] == w["weight"].shape[1] * 32 // module.bits
        and mx.default_device() == mx.cpu
        and _layout_supported(module)
    ):
        return ext.quantized_matmul(
            x, w["weight"], w["scales"], w["biases"], module.bits, module.group_size
        )
    return mx.quantized_matmul(
        x,
        w["weight"],
        scales=w["scales"],
        biases=w.get("biases"),
        transpose=True,
        group_size=module.group_size,
        bits=module.bits,
        mode=getattr(module, "mode", "affine"),
    )


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose products over several rows take the few-row product."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self)
        return y + self["bias"] if "bias" in self else y


class FewRowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied LM head) takes it likewise."""

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(x, self)


FEW_ROWS_CLASSES = {
    nn.QuantizedLinear: FewRowsQuantizedLinear,
    nn.QuantizedEmbedding: FewRowsQuantizedEmbedding,
}


def few_rows_class(module: nn.Module) -> type | None:
    """The class `module` takes while a CPU graph over several rows is built, or None to keep
    its own: MLX's quantized linear layers and embeddings (those classes exactly) in a layout
    the product takes, where the product is built and checked."""
    swap = FEW_ROWS_CLASSES.get(type(module))
    if swap is None or not _layout_supported(module):
        return None
    return swap if extension() is not None else None


def swaps(modules: list[nn.Module]) -> list[Swap]:
    """The swaps (`swaps.py`) that give the modules inside `modules` their `few_rows_class`."""
    return [(m, type(m), few) for n in modules for m in n.modules() if (few := few_rows_class(m))]


def head(module: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """A quantized LM head or tied embedding as the function of x it is with the few-row
    product (for a drafter's block through the target's head), or None where it takes none."""
    few = few_rows_class(module)
    if few is None:
        return None
    return partial(few.__call__ if few is FewRowsQuantizedLinear else few.as_linear, module)
