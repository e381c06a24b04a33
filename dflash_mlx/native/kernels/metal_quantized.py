"""Few-row affine quantized products on Apple GPUs, bit for bit MLX's one-row products.

Below its quantized-matmul threshold MLX runs 2..16 rows either as one GEMV per row (each
row reads the whole packed weight again) or, on newer GPUs, with a small-batch kernel whose
sums run in another order than decoding's one-row kernel. The kernel in
`metal/quantized_rows.metal` reads each packed weight once for all rows and sums every
row in the order of MLX's one-row kernel, so a verify forward's logits equal those of
plain decoding, bit for bit, and greedy output stays mlx-lm's. Verify forwards and the
drafter's block take it on Metal for `nn.QuantizedLinear` and a tied quantized LM head
(`few_rows_class`, `backends.verify_swaps` / `block_swaps`), after a one-time self-check
that it reproduces `mx.quantized_matmul` row by row, bit for bit, on this GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from . import metal, requested_backend

SOURCE_FILES = ("quantized_rows.h", "quantized_rows.metal")  # (header, body)
INPUT_NAMES = ("x", "w", "scales", "biases")
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MAX_ROWS = 16
COLUMNS_PER_THREADGROUP = 8  # two simdgroups of four output columns
# MLX's one-row product takes its `qmv_quad` kernel for these depths; the kernel leaves them.
QUAD_DEPTHS = (64, 128)
# (bits, group size, K, N) of the self-check, in each of DTYPES: both of MLX's one-row orders
# (qmv_fast, then qmv with a partial last block and a partial column tile).
SELF_CHECK_SHAPES = ((4, 64, 1024, 40), (8, 32, 352, 20))

# Swapped for the MSL emulator in the tests.
kernel_factory = mx.fast.metal_kernel

logger = logging.getLogger(__name__)
_self_check: dict[str, str | None] = {}


def load_sources() -> tuple[str, str]:
    """The (header, body) pair handed to mx.fast.metal_kernel."""
    return metal.read_sources(SOURCE_FILES)


def kernel_spec() -> dict:
    """Keyword arguments for mx.fast.metal_kernel that define the kernel."""
    return metal.spec("dflash_quantized_rows", INPUT_NAMES, load_sources())


def packs(bits: int, depth: int, n_out: int) -> int:
    """Packed words per lane per block in MLX's one-row kernel for this shape: 2 where MLX
    takes `qmv_fast` (N a multiple of 8, K of a whole 2-word block), else 1 (`qmv`)."""
    return 2 if n_out % 8 == 0 and depth % (64 * 32 // bits) == 0 else 1


def supports_weight(bits: int, group_size: int, mode: str, depth: int, has_biases: bool) -> bool:
    """Whether the kernel takes a quantized weight of this format and depth K."""
    return (
        mode == "affine"
        and has_biases
        and bits in BITS
        and group_size in GROUP_SIZES
        and depth % group_size == 0
        and depth not in QUAD_DEPTHS
    )


@cache
def launch(dtype: mx.Dtype, bits: int, group_size: int, rows: int, depth: int, n_out: int):
    """(template, grid, threadgroup) of one product: found once per shape, as graph building
    is on a verify cycle's critical path."""
    template = [
        ("T", dtype),
        ("BITS", bits),
        ("GS", group_size),
        ("PACKS", packs(bits, depth, n_out)),
        ("ROWS", rows),
    ]
    threadgroups = -(-n_out // COLUMNS_PER_THREADGROUP)
    return template, (32, 2 * threadgroups, 1), (32, 2, 1)


def kernel_call(x, w, scales, biases, group_size: int, bits: int) -> dict:
    """Keyword arguments of one kernel call for x (M, K), M in 1..MAX_ROWS."""
    rows, depth = x.shape
    n_out = w.shape[0]
    template, grid, threadgroup = launch(x.dtype, bits, group_size, rows, depth, n_out)
    return dict(
        inputs=[x, w, scales, biases],
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[(rows, n_out)],
        output_dtypes=[x.dtype],
    )


@cache
def _kernel(factory):
    return factory(**kernel_spec())


def quantized_rows(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True)` (affine) for 1..16 rows of
    x in x's dtype (`supports_weight`); each row as MLX's one-row product computes it."""
    depth = x.shape[-1]
    flat = x.reshape(-1, depth)
    call = kernel_call(flat, w, scales, biases, group_size, bits)
    out = _kernel(kernel_factory)(**call)[0]
    return out.reshape(*x.shape[:-1], w.shape[0])


def quantized_product(
    x: mx.array, params: dict, group_size: int, bits: int, mode: str, kernel: bool = True
) -> mx.array:
    """`x @ W.T` (no bias) for the quantized weight in `params` ("weight", "scales",
    "biases": a quantized layer, or its arrays): with `kernel`, by the kernel over 2..16
    rows of the scales' dtype, else by MLX. The format must be one `supports_weight` takes."""
    rows = x.size // x.shape[-1]
    if kernel and 2 <= rows <= MAX_ROWS and x.dtype == params["scales"].dtype:
        return quantized_rows(
            x, params["weight"], params["scales"], params["biases"], group_size, bits
        )
    return mx.quantized_matmul(
        x,
        params["weight"],
        scales=params["scales"],
        biases=params.get("biases"),
        transpose=True,
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def quantized_linear(layer: nn.Module, x: mx.array) -> mx.array:
    """A quantized layer's `x @ W.T` (no bias) by `quantized_product`, for layers
    `few_rows_class` accepted."""
    return quantized_product(x, layer, layer.group_size, layer.bits, layer.mode)


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose products over 2..16 rows take the kernel: the class of a
    supported layer while a verify or draft graph is built on Metal."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_linear(self, x)
        return y + self["bias"] if "bias" in self else y


class FewRowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied LM head) takes the kernel likewise."""

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_linear(self, x)


FEW_ROWS_CLASSES = {
    nn.QuantizedLinear: FewRowsQuantizedLinear,
    nn.QuantizedEmbedding: FewRowsQuantizedEmbedding,
}


def few_rows_class(module: nn.Module) -> type | None:
    """The class `module` takes while a graph is built on Metal, or None to keep its own:
    quantized linear layers and embeddings (those classes exactly) in a format the kernel
    takes."""
    swap = FEW_ROWS_CLASSES.get(type(module))
    if swap is None:
        return None
    depth = module["scales"].shape[-1] * module.group_size
    fmt = (module.bits, module.group_size, module.mode, depth, "biases" in module)
    return swap if supports_weight(*fmt) else None


def self_check() -> str | None:
    """Compare the kernel with MLX's one-row products on this GPU, bit for bit.

    Returns None when every row of every case is identical, else why not (a compile
    error or the first mismatch).
    """
    keys = mx.random.split(mx.random.key(0), 2)
    for bits, group_size, depth, n_out in SELF_CHECK_SHAPES:
        weight = mx.random.normal((n_out, depth), key=keys[0])
        w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
        for dtype in DTYPES:
            x = mx.random.normal((5, depth), key=keys[1]).astype(dtype)
            s, b = scales.astype(dtype), biases.astype(dtype)
            try:
                got = quantized_rows(x, w, s, b, group_size, bits)
                want = mx.concatenate(
                    [
                        mx.quantized_matmul(x[i : i + 1], w, s, b, group_size=group_size, bits=bits)
                        for i in range(x.shape[0])
                    ]
                )
                same = mx.array_equal(got, want).item()
            except Exception as e:  # noqa: BLE001 - any failure disables the kernel
                return f"{type(e).__name__}: {e}"
            if not same:
                return f"not MLX's one-row product ({bits}-bit, group {group_size}, {dtype})"
    return None


def _failure() -> str | None:
    """Why the kernel cannot be used in this process, or None if it can."""
    if not mx.metal.is_available():
        return "Metal is not available"
    if "result" not in _self_check:
        failure = self_check()
        if failure is not None:
            logger.warning("Metal few-row quantized kernel disabled (%s)", failure)
        _self_check["result"] = failure
    return _self_check["result"]


def enabled() -> bool:
    """Whether verify and draft forwards take the kernel: MLX runs on Metal, the self-check
    passed and DFLASH_MLX_KERNELS is not "reference" (with "metal" a failure raises)."""
    backend = requested_backend()
    if backend == "reference" or not mx.metal.is_available():
        return False
    failure = _failure()
    if failure is not None and backend == "metal":
        raise RuntimeError(f"Metal few-row quantized kernel unavailable: {failure}")
    return failure is None


def few_rows_head(head: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The quantized LM head `head` (no bias) as the drafter's block multiplies by it on
    Metal, through the kernel, or None where the kernel does not take it."""
    if "bias" in head or not few_rows_class(head):
        return None
    return partial(quantized_linear, head)
