"""Verify and draft forwards on NVIDIA GPUs: two CUDA kernels for what MLX does slowly there.

Verify attention. A verify forward attends n (2..64) new positions over the cached context
plus themselves. MLX's CUDA backend sends 4 or more bf16/fp16 queries to cuDNN's flash
attention, whose graphs it caches by shape, and every cycle has more keys than
the last, so its cycles spend host time that this kernel's do not; at a fixed shape
both cost the same (benchmarks/README.md, "Verify forward on an H100"). This kernel is
decoding's one-query-per-block scheme (one thread block per query row and head, warps
striding over the keys with an online softmax, merged once at the end) run for
every query of the block. Which of the n newest keys a query sees comes from
a (n, n) visibility matrix: lower-triangular for a chain (causal), the ancestor
mask for a tree; every earlier key is visible. Keys and values are read through
their strides, so a KV cache's slice of its buffer is not copied.

Few-rows products. MLX multiplies one row by a weight matrix with its own GEMV and 2 or
more rows with cuBLAS, which costs a multiple of the GEMV at a few rows and sets up a cuBLAS
plan on the host at every call. The few-rows kernel streams the weight once through
tensor-core MMAs (m16n8k16, fp32 sums) for up to 16 rows; verify and draft forwards on CUDA
take it for their linear layers and LM heads (`FewRowsLinear`, `backends.block_swaps`), which
it makes cheaper (benchmarks/README.md, "The few-rows kernel on an H100").

Both run through `mx.fast.cuda_kernel`; `supports` and `few_rows_supports` say which inputs
they take.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import cuda_quantized, requested_backend

THREADS = 256  # 8 warps per (query, head)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_QUERIES = 64

SOURCE = """
    constexpr int WARPS = THREADS / 32;
    constexpr int PER_LANE = D / 32;
    constexpr float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];
    __shared__ float warp_acc[WARPS][D];

    const int n = q_shape[2];
    const int q_heads = q_shape[1];
    const int kv_heads = k_shape[1];
    const int keys = k_shape[2];
    const int prefix = keys - n;
    const int row = blockIdx.x;  // (batch, head, query), query fastest
    const int i = row % n;
    const int h = (row / n) % q_heads;
    const int b = row / (n * q_heads);
    const int kvh = h / (q_heads / kv_heads);
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;

    const T* qp = q + b * q_strides[0] + h * q_strides[1] + i * q_strides[2] + lane * PER_LANE;
    const T* kp = k + b * k_strides[0] + kvh * k_strides[1] + lane * PER_LANE;
    const T* vp = v + b * v_strides[0] + kvh * v_strides[1] + lane * PER_LANE;
    const float s = scale[0];
    float qv[PER_LANE];
    float acc[PER_LANE];
    for (int j = 0; j < PER_LANE; ++j) {
        qv[j] = static_cast<float>(qp[j]) * s;
        acc[j] = 0.0f;
    }
    float running_max = NEG_INF;
    float running_sum = 0.0f;
    for (int key = warp; key < keys; key += WARPS) {
        if (key >= prefix && !visible[i * n + (key - prefix)]) {
            continue;  // the whole warp skips: key is the same in every lane
        }
        const T* kr = kp + key * k_strides[2];
        float score = 0.0f;
        for (int j = 0; j < PER_LANE; ++j) {
            score += qv[j] * static_cast<float>(kr[j]);
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            score += __shfl_xor_sync(0xffffffff, score, offset);
        }
        const float new_max = fmaxf(running_max, score);
        const float rescale = expf(running_max - new_max);
        const float p = expf(score - new_max);
        running_sum = running_sum * rescale + p;
        const T* vr = vp + key * v_strides[2];
        for (int j = 0; j < PER_LANE; ++j) {
            acc[j] = acc[j] * rescale + p * static_cast<float>(vr[j]);
        }
        running_max = new_max;
    }
    if (lane == 0) {
        warp_max[warp] = running_max;
        warp_sum[warp] = running_sum;
    }
    for (int j = 0; j < PER_LANE; ++j) {
        warp_acc[warp][lane * PER_LANE + j] = acc[j];
    }
    __syncthreads();
    float total_max = NEG_INF;
    for (int w = 0; w < WARPS; ++w) {
        total_max = fmaxf(total_max, warp_max[w]);
    }
    for (int d = threadIdx.x; d < D; d += THREADS) {
        float num = 0.0f;
        float den = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float weight = warp_max[w] == NEG_INF ? 0.0f : expf(warp_max[w] - total_max);
            num += warp_acc[w][d] * weight;
            den += warp_sum[w] * weight;
        }
        out[((b * n + i) * q_heads + h) * D + d] = static_cast<T>(num / den);
    }
"""


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="dflash_verify_attention",
        input_names=["q", "k", "v", "visible", "scale"],
        output_names=["out"],
        source=SOURCE,
        ensure_row_contiguous=False,
    )


def cuda_available() -> bool:
    """Whether this MLX has its CUDA backend and a GPU for it."""
    cuda = getattr(mx, "cuda", None)  # MLX builds before the CUDA backend have none
    return cuda is not None and cuda.is_available()


def is_available() -> bool:
    """Whether MLX runs on its CUDA backend here (the kernel needs it)."""
    return mx.default_device() == mx.gpu and cuda_available()


def enabled() -> bool:
    """Whether the CUDA kernels are used: MLX runs on its CUDA backend and DFLASH_MLX_KERNELS
    does not say "reference"."""
    return is_available() and requested_backend() != "reference"


def supports(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the kernel takes these inputs: one float dtype, head dim 32..256 (a multiple
    of 32) shared by keys and values, at most MAX_QUERIES queries."""
    head_dim = queries.shape[-1]
    return (
        queries.dtype in DTYPES
        and keys.dtype == values.dtype == queries.dtype
        and keys.shape[-1] == values.shape[-1] == head_dim
        and head_dim % 32 == 0
        and 32 <= head_dim <= 256
        and 1 <= queries.shape[2] <= min(MAX_QUERIES, keys.shape[2])
        and queries.shape[1] % keys.shape[1] == 0
    )


def verify_attention(
    queries: mx.array, keys: mx.array, values: mx.array, visible: mx.array, scale: float
) -> mx.array:
    """Softmax attention of queries (B, Hq, n, D) over keys/values (B, Hkv, S, D), S >= n.

    Key j < S - n is visible to every query; key S - n + t to query i iff
    `visible[i, t]` (a (n, n) bool array). The feature axis must have unit stride (as in
    mlx-lm's attention: queries a transposed view, keys and values a slice of the cache's
    buffer; other strides are read as they are, nothing is copied). Returns (B, Hq, n, D)
    in the queries' dtype.
    """
    batch, q_heads, n, head_dim = queries.shape
    if visible.dtype != mx.bool_:
        visible = visible.astype(mx.bool_)
    (out,) = _kernel()(
        inputs=[queries, keys, values, visible, _scale(scale)],
        template=[("T", queries.dtype), ("D", head_dim), ("THREADS", THREADS)],
        grid=(batch * q_heads * n * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(batch, n, q_heads, head_dim)],
        output_dtypes=[queries.dtype],
    )
    return out.transpose(0, 2, 1, 3)


FEW_ROWS_SOURCE = (
    cuda_quantized.ROWS_PREAMBLE
    + """
    // out (M, N) = x (M, K) @ w (N, K).T for M <= 16, with tensor-core MMAs. A block of
    // THREADS threads makes 8 * N_TILES output columns; its warps take turns along K in
    // steps of 32 and add their partial sums up in shared memory at the end (a fixed
    // order: the result does not depend on timing). Each warp loads UNROLL steps before
    // multiplying them, to keep more bytes in flight. In a step, lane (g, t) loads 8
    // consecutive elements at k = step + 8 t from weight row g of each 8-row tile (and
    // from rows g and g + 8 of x): four lanes read 64 contiguous bytes of a row. Two
    // m16n8k16 MMAs consume them; their 16 k-slots are mapped to those 32 k the same
    // way for x and w, so each sums over exactly the step's k.
    constexpr int WARPS = THREADS / 32;
    constexpr int COLS = 8 * N_TILES;
    __shared__ float partial[WARPS][16][COLS];
    const int g = lane / 4;
    const int t = lane % 4;
    const int n0 = blockIdx.x * COLS;
    float acc[N_TILES][4] = {};
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int first = warp * 32; first < K; first += UNROLL * WARPS * 32) {
        uint4 xa[UNROLL], xb[UNROLL], wv[UNROLL][N_TILES];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // all loads of UNROLL steps first: more in flight
            const int k = first + u * WARPS * 32 + t * 8;
            const bool in_k = k < K;
            const T* row = x + (size_t)g * K + k;
            xa[u] = in_k && g < M ? *reinterpret_cast<const uint4*>(row) : zero;
            xb[u] = in_k && g + 8 < M ? *reinterpret_cast<const uint4*>(row + 8 * K) : zero;
            #pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
                const int c = n0 + nt * 8 + g;
                const uint4* p = reinterpret_cast<const uint4*>(w + (size_t)c * K + k);
                wv[u][nt] = in_k && c < N ? __ldg(p) : zero;
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint4 a = xa[u];
            const uint4 b = xb[u];
            #pragma unroll
            for (int nt = 0; nt < N_TILES; ++nt) {
                const uint4 v = wv[u][nt];
                mma16816<BF16>(acc[nt], a.x, b.x, a.y, b.y, v.x, v.y);
                mma16816<BF16>(acc[nt], a.z, b.z, a.w, b.w, v.z, v.w);
            }
        }
    }
    #pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt) {
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            partial[warp][g][nt * 8 + t * 2 + j] = acc[nt][j];
            partial[warp][g + 8][nt * 8 + t * 2 + j] = acc[nt][2 + j];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * COLS; i += THREADS) {
        const int r = i / COLS;
        const int c = n0 + i % COLS;
        if (r < M && c < N) {
            float sum = 0.0f;
            #pragma unroll
            for (int w_ = 0; w_ < WARPS; ++w_) {
                sum += partial[w_][r][i % COLS];
            }
            out[(size_t)r * N + c] = static_cast<T>(sum);
        }
    }
"""
)

FEW_ROWS_HEADER = """
// d += a (16 x 16, row-major fragment) * b (16 x 8, column-major fragment), fp32 accumulators.
template <bool BF16>
__device__ __forceinline__ void mma16816(
    float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
"""

# At 17-32 rows (a second tile) the kernel lost to cuBLAS in Qwen3-8B's MLP, so it takes one
# tile's worth (benchmarks/README.md, "The few-rows kernel on an H100").
FEW_ROWS_MAX = 16
FEW_ROWS_DTYPES = (mx.float16, mx.bfloat16)
FEW_ROWS_THREADS = 256
FEW_ROWS_UNROLL = 2


@cache
def _few_rows_kernel():
    return mx.fast.cuda_kernel(
        name="dflash_few_rows_matmul",
        input_names=["x", "w"],
        output_names=["out"],
        source=FEW_ROWS_SOURCE,
        header=FEW_ROWS_HEADER,
    )


@cache
def _few_rows_launch(dtype: mx.Dtype, n_out: int) -> tuple[list, tuple, tuple]:
    """(template, grid, threadgroup) of a product: two 8-column tiles a block where that
    still makes two blocks per multiprocessor of an H100 (132), else one."""
    col_tiles = 2 if n_out >= 16 * 264 else 1
    template = [
        ("T", dtype),
        ("BF16", dtype == mx.bfloat16),
        ("THREADS", FEW_ROWS_THREADS),
        ("N_TILES", col_tiles),
        ("UNROLL", FEW_ROWS_UNROLL),
    ]
    grid = (-(-n_out // (8 * col_tiles)) * FEW_ROWS_THREADS, 1, 1)
    return template, grid, (FEW_ROWS_THREADS, 1, 1)


def few_rows_weight(weight: mx.array) -> bool:
    """Whether the kernel takes `weight` (N, K) as the right operand: bf16/fp16, K % 8 == 0."""
    return weight.dtype in FEW_ROWS_DTYPES and weight.ndim == 2 and weight.shape[1] % 8 == 0


def few_rows_supports(x: mx.array, weight: mx.array) -> bool:
    """Whether `few_rows_matmul` takes these: `few_rows_weight`, x of its dtype and depth,
    1..16 rows."""
    depth = x.shape[-1]
    return (
        few_rows_weight(weight)
        and x.dtype == weight.dtype
        and weight.shape[1] == depth
        and 1 <= x.size // depth <= FEW_ROWS_MAX
    )


def few_rows_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` for a few rows of x (`few_rows_supports`): fp32 sums rounded once."""
    n_out = weight.shape[0]
    launch = _few_rows_launch(x.dtype, n_out)
    return cuda_quantized.rows_product(_few_rows_kernel(), [x, weight], launch, x, n_out)


def times_transposed(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T`, by the few-rows kernel over the 2..16 rows it takes. Only where the
    kernel runs (`enabled`): callers check that once, not per product."""
    if x.size // x.shape[-1] >= 2 and few_rows_supports(x, weight):
        return few_rows_matmul(x, weight)
    return x @ weight.T


class FewRowsLinear(nn.Linear):
    """`nn.Linear` whose products over 2..16 rows take the few-rows kernel: the class of a
    layer with a `few_rows_weight` while a graph is built on CUDA (`backends.block_swaps`, the
    verify forward's swaps). Graph building is on the critical path of a cycle, so the
    weight is checked once, at the swap, and each call only checks x."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        alike = x.dtype == weight.dtype and x.shape[-1] == weight.shape[1]
        if alike and 2 <= x.size // x.shape[-1] <= FEW_ROWS_MAX:
            y = few_rows_matmul(x, weight)
            return y + self["bias"] if "bias" in self else y
        return super().__call__(x)  # MLX's product (or its error, for a wrong shape)


class FewRowsEmbedding(nn.Embedding):
    """`nn.Embedding` whose `as_linear` (a tied LM head) takes the few-rows kernel likewise."""

    def as_linear(self, x: mx.array) -> mx.array:
        return times_transposed(x, self["weight"])


FEW_ROWS_CLASSES = {nn.Linear: FewRowsLinear, nn.Embedding: FewRowsEmbedding}


def few_rows_class(module: nn.Module) -> type | None:
    """The class `module` takes while a graph is built on CUDA, or None to keep its own: plain
    (not sharded) linear layers and embeddings with a `few_rows_weight`, and quantized ones
    that `cuda_quantized` takes."""
    swap = FEW_ROWS_CLASSES.get(type(module))
    if swap is not None and few_rows_weight(module["weight"]):
        return swap
    return cuda_quantized.few_rows_class(module)


def linears(modules: list[nn.Module]) -> list[nn.Module]:
    """The `nn.Linear` and `nn.QuantizedLinear` layers (those classes exactly: not sharded) in
    `modules`, for `backends.block_swaps`: found once, not at every forward."""
    kinds = (nn.Linear, nn.QuantizedLinear)
    return [m for module in modules for m in module.modules() if type(m) in kinds]


def few_rows_head(head: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The LM head `head` (a linear layer or embedding without bias) as the drafter's block
    multiplies by it on CUDA, through a few-rows kernel, or None where none takes it."""
    if "bias" in head or not few_rows_class(head):
        return None
    if isinstance(head, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return partial(cuda_quantized.product, head)
    return partial(times_transposed, weight=head["weight"])


@cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], mx.float32)


@cache
def causal(n: int) -> mx.array:
    """The chain's visibility among its n positions: each sees itself and those before.
    Made from numpy data: a cached lazy graph would be shared by generations in threads."""
    return mx.array(np.tril(np.ones((n, n), dtype=bool)))
