"""Few-rows products with MLX's affine-quantized weights on NVIDIA GPUs, rounded as decoding rounds.

MLX's CUDA backend multiplies 1-7 rows by a 4- or 8-bit weight with its quantized GEMV (qmv),
one pass over the weight per row, and 8 or more rows with a tensor-core kernel whose sums round
differently. In a verify forward the first costs a multiple of a decoding step's product at 2-4
rows (benchmarks/README.md, "The few-rows quantized kernel"), and the second breaks greedy
identity with one-token decoding.
This kernel reads each packed weight once for up to 16 rows and sums every row exactly as
qmv (MLX 0.32's `quantized/qmm/qmv.cu`) sums one:

- a warp makes one output column; in step s lane l takes the E elements from
  k = l E + s 32 E (E = 16 at 4 bits, 8 at 8 bits), then the tail k < K the same way;
- it dequantizes them once for all rows: q * scale + bias in the activations' dtype T,
  rounded once (MLX's `w * scale + bias` is a multiply and an add without a rounding mode,
  which ptxas fuses: compiled for sm_90a with CUDA 13.0, its SASS is one HFMA2 per pair);
- it adds x * w into its own E accumulators of each row: fused multiply-adds in T at 4 bits,
  in float32 at 8 bits, as qmv's;
- each lane adds its accumulators up in order in float32, the warp adds its lanes in a tree
  (lanes 16 apart, then 8, 4, 2, 1), and the sum is rounded to T once.

Every operation is one explicitly rounded instruction (`__hfma2`, `__fmaf_rn`), so the compiler
cannot contract or reorder them. `tests/qmv_model.py` is the same algorithm in numpy, step for
step, checked on the CPU; `pytest -m cuda tests/test_cuda_quantized.py` checks the kernel on a
GPU bit for bit against MLX's one-row product and the model.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16)
MAX_ROWS = 16  # beyond, MLX's tensor-core kernel is the cheaper product (and its own rounding)
ROWS_PER_WARP = 8  # a warp's accumulators: 8 rows x 8 registers at 4 bits
WARPS = 8  # per block of 256 threads

HEADER = """
template <typename T> struct Pair;
template <> struct Pair<__nv_bfloat16> {  // (a, b) and a float rounded to nearest even
  using type = __nv_bfloat162;
  static __device__ type of(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __nv_bfloat16 round(float a) { return __float2bfloat16_rn(a); }
};
template <> struct Pair<__half> {
  using type = __half2;
  static __device__ type of(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __half round(float a) { return __float2half_rn(a); }
};

// A lane's E dequantized weights of one step as E / 2 pairs: element k is bits
// (k % (32 / BITS)) * BITS up of word k / (32 / BITS); q * scale + bias in T, rounded once.
template <typename T, int BITS, int E>
__device__ __forceinline__ void dequantize(
    const uint32_t* words, T scale, T bias, typename Pair<T>::type* out) {
  using P = Pair<T>;
  constexpr int PER_WORD = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const auto s = P::of(float(scale), float(scale));
  const auto b = P::of(float(bias), float(bias));
  #pragma unroll
  for (int j = 0; j < E / 2; ++j) {
    const int e = 2 * j;
    const uint32_t q0 = (words[e / PER_WORD] >> ((e % PER_WORD) * BITS)) & MASK;
    const uint32_t q1 = (words[(e + 1) / PER_WORD] >> (((e + 1) % PER_WORD) * BITS)) & MASK;
    const auto q = P::of(float(q0), float(q1));
    out[j] = __hfma2(q, s, b);
  }
}

// acc += x * w for a lane's E elements of one row: 4 bits, accumulators in T (pairs).
template <typename T, int E>
__device__ __forceinline__ void add_products(
    const T* x, const typename Pair<T>::type* w, typename Pair<T>::type* acc) {
  using T2 = typename Pair<T>::type;
  #pragma unroll
  for (int v = 0; v < E / 8; ++v) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + 8 * v);
    const T2* xp = reinterpret_cast<const T2*>(&raw);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[4 * v + j] = __hfma2(xp[j], w[4 * v + j], acc[4 * v + j]);
    }
  }
}

// The same at 8 bits: accumulators in float32 (x * w is exact there).
template <typename T, int E>
__device__ __forceinline__ void add_products(
    const T* x, const typename Pair<T>::type* w, float* acc) {
  using T2 = typename Pair<T>::type;
  #pragma unroll
  for (int v = 0; v < E / 8; ++v) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + 8 * v);
    const T2* xp = reinterpret_cast<const T2*>(&raw);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 8 * v + 2 * j;
      acc[i] = __fmaf_rn(__low2float(xp[j]), __low2float(w[i / 2]), acc[i]);
      acc[i + 1] = __fmaf_rn(__high2float(xp[j]), __high2float(w[i / 2]), acc[i + 1]);
    }
  }
}

// A lane's accumulators added up in element order, in float32.
template <typename T2, int E>
__device__ __forceinline__ float lane_sum(const T2* acc) {
  float sum = 0.0f;
  #pragma unroll
  for (int j = 0; j < E / 2; ++j) {
    sum = __fadd_rn(sum, __low2float(acc[j]));
    sum = __fadd_rn(sum, __high2float(acc[j]));
  }
  return sum;
}

template <typename T2, int E>
__device__ __forceinline__ float lane_sum(const float* acc) {
  float sum = 0.0f;
  #pragma unroll
  for (int i = 0; i < E; ++i) {
    sum = __fadd_rn(sum, acc[i]);
  }
  return sum;
}

template <typename T>
__device__ __forceinline__ void set_zero(typename Pair<T>::type& a) { a = Pair<T>::of(0.0f, 0.0f); }
template <typename T>
__device__ __forceinline__ void set_zero(float& a) { a = 0.0f; }

template <bool B, typename Yes, typename No> struct Choose { using type = Yes; };
template <typename Yes, typename No> struct Choose<false, Yes, No> { using type = No; };
"""

# The start of both few-rows kernels (this one and `cuda.py`'s): x (..., K) is M rows of K,
# w (N, ...) makes N output columns.
ROWS_PREAMBLE = """
    const int K = x_shape[x_ndim - 1];
    int M = 1;
    for (int i = 0; i < x_ndim - 1; ++i) {
        M *= x_shape[i];
    }
    const int N = w_shape[0];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
"""

SOURCE = (
    ROWS_PREAMBLE
    + """
    // out (M, N) = x (M, K) @ dequantize(w).T, M <= GROUPS * ROWS: the module docstring says
    // how, tests/qmv_model.py mirrors it. A warp takes one column and ROWS rows; the GROUPS
    // warps of a column sit in one block, so its weight comes from DRAM once.
    using T2 = typename Pair<T>::type;
    constexpr int E = BITS == 4 ? 16 : 8;
    constexpr int STEP = 32 * E;
    constexpr int ACC = BITS == 4 ? E / 2 : E;
    using Acc = typename Choose<BITS == 4, T2, float>::type;
    const int col = blockIdx.x * (WARPS / GROUPS) + warp / GROUPS;
    const int first_row = (warp % GROUPS) * ROWS;
    const int rows = min(ROWS, M - first_row);
    if (col >= N || rows <= 0) {
        return;  // the whole warp: col and rows are the same in every lane
    }
    const uint32_t* wc = w + (size_t)col * (K / (32 / BITS));
    const T* sc = scales + (size_t)col * (K / GROUP);
    const T* bc = biases + (size_t)col * (K / GROUP);
    const T* xr = x + (size_t)first_row * K;
    Acc acc[ROWS][ACC];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        #pragma unroll
        for (int i = 0; i < ACC; ++i) {
            set_zero<T>(acc[r][i]);
        }
    }
    auto step = [&](int k) {
        T2 wq[E / 2];
        dequantize<T, BITS, E>(wc + k / (32 / BITS), sc[k / GROUP], bc[k / GROUP], wq);
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < rows) {
                add_products<T, E>(xr + (size_t)r * K + k, wq, acc[r]);
            }
        }
    };
    for (int s = 0; s < K / STEP; ++s) {
        step(lane * E + s * STEP);
    }
    const int tail = lane * E + K - K % STEP;
    if (tail < K) {
        step(tail);
    }
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r < rows) {
            float sum = lane_sum<T2, E>(acc[r]);
            for (int mask = 16; mask > 0; mask /= 2) {  // cooperative groups' reduce
                sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffff, sum, mask));
            }
            if (lane == 0) {
                out[(size_t)(first_row + r) * N + col] = Pair<T>::round(sum);
            }
        }
    }
"""
)


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="dflash_few_rows_qmv",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
    )


@cache
def _launch(
    dtype: mx.Dtype, bits: int, group_size: int, rows: int, n_out: int
) -> tuple[list, tuple, tuple]:
    """(template, grid, threadgroup): up to ROWS_PER_WARP rows a warp, the warps of a column
    in one block."""
    groups = -(-rows // ROWS_PER_WARP)
    template = [
        ("T", dtype),
        ("BITS", bits),
        ("GROUP", group_size),
        ("ROWS", -(-rows // groups)),
        ("GROUPS", groups),
        ("WARPS", WARPS),
    ]
    columns = WARPS // groups  # per block
    return template, (-(-n_out // columns) * 32 * WARPS, 1, 1), (32 * WARPS, 1, 1)


def takes(layer: nn.Module) -> bool:
    """Whether the kernel takes this quantized layer's weights: affine mode with biases, 4 or 8
    bits, groups of 32/64/128, bf16/fp16 scales, a 2-D weight."""
    return (
        getattr(layer, "mode", None) == "affine"
        and layer.bits in BITS
        and layer.group_size in GROUP_SIZES
        and layer.get("biases") is not None
        and layer["weight"].dtype == mx.uint32
        and layer["weight"].ndim == 2
        and layer["scales"].dtype in DTYPES
    )


def quantized_matmul(
    x: mx.array,
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    group_size: int,
) -> mx.array:
    """`mx.quantized_matmul(x, weight, scales, biases, transpose=True, ...)` for 1..MAX_ROWS
    rows of x (x in the scales' dtype; the weights as `takes` says), each row rounded as MLX's
    one-row product on CUDA rounds it."""
    launch = _launch(x.dtype, bits, group_size, x.size // x.shape[-1], weight.shape[0])
    return rows_product(_kernel(), [x, weight, scales, biases], launch, x, weight.shape[0])


def rows_product(kernel, inputs: list, launch: tuple, x: mx.array, n_out: int) -> mx.array:
    """The one output of a few-rows `kernel` (this module's or `cuda.py`'s) over `inputs`,
    launched as `launch` = (template, grid, threadgroup): (..., n_out) for x (..., K), in x's
    dtype."""
    template, grid, threads = launch
    return kernel(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=threads,
        output_shapes=[(*x.shape[:-1], n_out)],
        output_dtypes=[x.dtype],
    )[0]


def product(layer: nn.Module, x: mx.array) -> mx.array:
    """`x` times the transposed weights of `layer` (a quantized linear layer or embedding that
    the kernel `takes`): the kernel over 2..MAX_ROWS rows of x in the scales' dtype, MLX's
    product otherwise (one row: its qmv already). No bias."""
    scales = layer["scales"]
    if x.dtype == scales.dtype and 2 <= x.size // x.shape[-1] <= MAX_ROWS:
        return quantized_matmul(
            x, layer["weight"], scales, layer["biases"], layer.bits, layer.group_size
        )
    return mx.quantized_matmul(
        x,
        layer["weight"],
        scales=scales,
        biases=layer["biases"],
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )


class FewRowsQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose products over 2..16 rows take the kernel: the class of a layer
    the kernel `takes` while a verify forward's or the drafter's block's graph is built on CUDA
    (`kernels.cuda.few_rows_class`)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(self, x)
        return y + self["bias"] if "bias" in self else y


class FewRowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied LM head) takes the kernel likewise."""

    def as_linear(self, x: mx.array) -> mx.array:
        return product(self, x)


CLASSES = {
    nn.QuantizedLinear: FewRowsQuantizedLinear,
    nn.QuantizedEmbedding: FewRowsQuantizedEmbedding,
}


def few_rows_class(module: nn.Module) -> type | None:
    """The class `module` takes while a graph is built on CUDA, or None: quantized linear layers
    and embeddings (that class exactly, not sharded) whose weights the kernel `takes`."""
    swap = CLASSES.get(type(module))
    return swap if swap is not None and takes(module) else None
