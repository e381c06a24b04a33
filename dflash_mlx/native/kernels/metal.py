"""The Metal block-attention kernel: its sources, launch geometry and self-check."""

from functools import cache
from pathlib import Path

import mlx.core as mx

from .reference import reference_attention

# Package data; in a source checkout this is a link to the top-level metal/.
SOURCE_DIR = Path(__file__).parent / "metal"
SOURCE_FILES = ("block_attention.h", "block_attention.metal")  # (header, body)
THREADS = 256
INPUT_NAMES = ("q", "kc", "vc", "kb", "vb", "n_ctx", "scale")
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# Per-threadgroup fp32 staging budget (floats) for each of the Q, K and V tiles,
# which keeps the kernel under the 32 KB of threadgroup memory.
TILE_FLOATS = 2048

# Swapped for the MSL emulator in tests/test_kernels_metal.py.
kernel_factory = mx.fast.metal_kernel


def read_sources(files: tuple[str, str]) -> tuple[str, str]:
    """The (header, body) pair of a kernel's two files in SOURCE_DIR."""
    header, body = ((SOURCE_DIR / name).read_text() for name in files)
    return header, body


def load_sources() -> tuple[str, str]:
    """The (header, body) pair handed to mx.fast.metal_kernel."""
    return read_sources(SOURCE_FILES)


def spec(name: str, input_names, sources: tuple[str, str], **options) -> dict:
    """Keyword arguments for mx.fast.metal_kernel: one output, `out`."""
    header, body = sources
    return dict(
        name=name,
        input_names=list(input_names),
        output_names=["out"],
        source=body,
        header=header,
        **options,
    )


def supports(*arrays: mx.array) -> bool:
    """Whether the kernel handles these inputs (one float dtype, head dim 32..256)."""
    head_dim = arrays[0].shape[-1]
    dtype = arrays[0].dtype
    return (
        dtype in DTYPES
        and all(a.dtype == dtype for a in arrays)
        and head_dim % 32 == 0
        and 32 <= head_dim <= 256
    )


def launch_config(
    batch: int, n_q_heads: int, n_kv_heads: int, block_len: int, head_dim: int, dtype: mx.Dtype
) -> tuple[list, tuple[int, int, int], tuple[int, int, int]]:
    """Template arguments, grid and threadgroup for one call (see the .metal header)."""
    rows = n_q_heads // n_kv_heads * block_len
    n_simd = THREADS // 32
    key_tile = min(32, TILE_FLOATS // head_dim)
    row_tile = min(32, TILE_FLOATS // head_dim // n_simd * n_simd, -(-rows // n_simd) * n_simd)
    template = [("T", dtype), ("D", head_dim), ("TK", key_tile), ("RB", row_tile), ("NT", THREADS)]
    grid = (THREADS * -(-rows // row_tile), n_kv_heads, batch)
    return template, grid, (THREADS, 1, 1)


def kernel_spec() -> dict:
    """Keyword arguments for mx.fast.metal_kernel that define the kernel."""
    return spec("dflash_block_attention", INPUT_NAMES, load_sources(), ensure_row_contiguous=False)


def kernel_call(queries, ctx_keys, ctx_values, block_keys, block_values, scale: float) -> dict:
    """Keyword arguments of one kernel call; K/V are bound in place (strided views are fine)."""
    b, n_q_heads, block_len, head_dim = queries.shape
    n_ctx = ctx_keys.shape[2]
    if n_ctx == 0:
        # An empty buffer cannot be bound; the kernel reads no context row anyway.
        ctx_keys, ctx_values = block_keys, block_values
    template, grid, threadgroup = launch_config(
        b, n_q_heads, block_keys.shape[1], block_len, head_dim, queries.dtype
    )
    inputs = [queries, ctx_keys, ctx_values, block_keys, block_values]
    inputs += [mx.array([n_ctx], dtype=mx.int32), mx.array([scale], dtype=mx.float32)]
    return dict(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )


@cache
def _kernel(factory):
    return factory(**kernel_spec())


def metal_attention(
    queries: mx.array,
    ctx_keys: mx.array,
    ctx_values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    scale: float,
) -> mx.array:
    """Run the kernel (see block_attention for the shapes)."""
    call = kernel_call(queries, ctx_keys, ctx_values, block_keys, block_values, scale)
    return _kernel(kernel_factory)(**call)[0]


def self_check() -> str | None:
    """Compare the kernel with the reference on small random inputs.

    Returns None when they agree, else why not (a compile error or a mismatch).
    """
    keys = mx.random.split(mx.random.key(0), 5)
    shapes = [(1, 4, 16, 64), (1, 2, 37, 64), (1, 2, 37, 64), (1, 2, 16, 64), (1, 2, 16, 64)]
    base = [mx.random.normal(s, key=k) for s, k in zip(shapes, keys, strict=True)]
    for dtype, tol in ((mx.float32, 1e-4), (mx.float16, 1e-2), (mx.bfloat16, 5e-2)):
        args = [a.astype(dtype) for a in base]
        expected = reference_attention(*args, scale=0.125)
        try:
            got = metal_attention(*args, scale=0.125)
            err = mx.abs(got.astype(mx.float32) - expected.astype(mx.float32)).max().item()
        except Exception as e:  # noqa: BLE001 - any failure disables the kernel
            return f"{type(e).__name__}: {e}"
        if not err <= tol:
            return f"max abs error {err:.3g} > {tol:g} for {dtype}"
    return None
