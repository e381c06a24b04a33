"""Verify attention on NVIDIA GPUs: a few queries over a KV cache, one CUDA kernel.

A verify forward attends n (2..64) new positions over the cached context plus
themselves. MLX's CUDA backend sends 4 or more bf16/fp16 queries to cuDNN's flash
attention, whose graphs it caches by shape, and every cycle has more keys than
the last. In side-by-side runs on an H100 (Qwen3-8B's shape) the cycles through
cuDNN spent 4.9-6.2 ms on the host beyond their forwards, through this kernel
0.3-1.1 ms; at a fixed shape both cost the same. This kernel is decoding's
one-query-per-block scheme (one thread block per query row and head, warps
striding over the keys with an online softmax, merged once at the end) run for
every query of the block. Which of the n newest keys a query sees comes from
a (n, n) visibility matrix: lower-triangular for a chain (causal), the ancestor
mask for a tree; every earlier key is visible. Keys and values are read through
their strides, so a KV cache's slice of its buffer is not copied.

Runs through `mx.fast.cuda_kernel`; `supports` says which inputs it takes.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

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


@cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], mx.float32)


@cache
def causal(n: int) -> mx.array:
    """The chain's visibility among its n positions: each sees itself and those before.
    Made from numpy data: a cached lazy graph would be shared by generations in threads."""
    return mx.array(np.tril(np.ones((n, n), dtype=bool)))
