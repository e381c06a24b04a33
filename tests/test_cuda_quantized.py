"""The few-rows quantized product for MLX's CUDA backend (`kernels/cuda_quantized.py`).

On this CPU: its numpy model (`qmv_model.py`) against a literal transcription of MLX's
one-row CUDA kernel (qmv) and against `mx.quantized_matmul`, mutations of the model that
those checks must catch, the kernel source compiled for an H100 where nvcc is installed, and
the plumbing (verify and draft forwards give quantized layers the kernel, an exact stand-in
here). Where MLX has a CUDA GPU, the kernel itself: each row bit for bit MLX's one-row
product and the model's.
"""

import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import qmv_model
import test_families
from helpers import reference_greedy
from test_cuda_verify import as_cuda, assert_products_taken, run  # noqa: F401  (as_cuda: its fixture)
from test_families import FAMILIES, PROMPT, build, first_difference

from dflash_mlx.models import target as target_module
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.native.kernels import cuda as cuda_kernels
from dflash_mlx.native.kernels import cuda_quantized

MAX_TOKENS = 60
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}
tokenizer = test_families.tokenizer  # its fixture, shared


def quantized_weights(n_out: int, depth: int, bits: int, group_size: int, dtype, seed: int = 0):
    """(packed weight, scales, biases) of a random (n_out, depth) weight in MLX's affine layout."""
    mx.random.seed(seed)
    w = (mx.random.normal((n_out, depth)) * depth**-0.5).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=bits)


def activations(rows: int, depth: int, dtype, seed: int = 1) -> mx.array:
    mx.random.seed(seed)
    return mx.random.normal((rows, depth)).astype(dtype)


def as_float64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def model_product(x, packed, scales, biases, bits, group_size, dtype: str) -> np.ndarray:
    arrays = as_float64(x), np.array(packed), as_float64(scales), as_float64(biases)
    return qmv_model.qmv_rows(*arrays, bits, group_size, dtype)


def mlx_qmv_one_row(x, packed, scales, biases, bits: int, group_size: int, dtype: str):
    """MLX's qmv_kernel_impl for one row, written out element by element from its source:
    lane l's E sums, its tiles at l E + r 32 E and the tail, then `sum += sums[i]` and
    cooperative groups' xor butterfly. Bytes unpacked low nibble first."""
    rnd = qmv_model.round_to
    e = 16 if bits == 4 else 8
    depth, per_warp = x.size, 32 * e
    data = np.ascontiguousarray(packed).view(np.uint8)
    out = []
    for col in range(scales.shape[0]):
        lanes = []
        for lane in range(32):
            sums = [np.float32(0.0) if bits == 8 else 0.0] * e
            tiles = [lane * e + r * per_warp for r in range(depth // per_warp)]
            rest = depth % per_warp
            if rest and lane * e + depth - rest < depth:
                tiles.append(lane * e + depth - rest)
            for idx in tiles:
                scale, bias = scales[col, idx // group_size], biases[col, idx // group_size]
                for i in range(e):
                    j = idx + i
                    if bits == 4:
                        byte = int(data[col, j // 2])
                        q = byte >> 4 if j % 2 else byte & 15
                    else:
                        q = int(data[col, j])
                    w = rnd(np.float64(q * scale + bias), dtype)
                    if bits == 8:
                        sums[i] = np.float32(sums[i] + np.float32(x[j] * w))
                    else:
                        sums[i] = rnd(np.float64(x[j] * w + sums[i]), dtype)
            total = np.float32(0.0)
            for s in sums:
                total = np.float32(total + np.float32(s))
            lanes.append(total)
        mask = 16
        while mask:
            lanes = [np.float32(lanes[lane] + lanes[lane ^ mask]) for lane in range(32)]
            mask //= 2
        out.append(rnd(np.float64(lanes[0]), dtype))
    return np.array(out)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_to_is_mlx_rounding(dtype):
    rng = np.random.default_rng(0)
    values = np.concatenate(
        [
            rng.normal(size=4000) * 10.0 ** rng.integers(-6, 4, 4000),
            [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11],  # ties in either format
        ]
    ).astype(np.float32)
    expected = as_float64(mx.array(values).astype(DTYPES[dtype]))
    assert np.array_equal(qmv_model.round_to(values.astype(np.float64), dtype), expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 128), (8, 64), (8, 128)])
def test_model_is_mlx_one_row_qmv_per_row(bits, group_size, dtype):
    """Two full steps or more and a tail of lanes (K = 1152), a few columns; each of 3 rows run
    together equals the transcription run on that row alone."""
    packed, scales, biases = quantized_weights(3, 1152, bits, group_size, DTYPES[dtype])
    x = activations(3, 1152, DTYPES[dtype])
    got = model_product(x, packed, scales, biases, bits, group_size, dtype)
    args = (np.array(packed), as_float64(scales), as_float64(biases), bits, group_size, dtype)
    for r in range(3):
        assert np.array_equal(got[r], mlx_qmv_one_row(as_float64(x)[r], *args))


def relative_error(got: np.ndarray, x, packed, scales, biases, bits, group_size) -> float:
    """Against MLX's product on the CPU with float32 activations, scales and biases (its
    product in bf16 sums in bf16 throughout: 8 % off on these shapes)."""
    x, scales, biases = (a.astype(mx.float32) for a in (x, scales, biases))
    ref = mx.quantized_matmul(
        x, packed, scales, biases, transpose=True, group_size=group_size, bits=bits
    )
    ref = as_float64(ref)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


TOLERANCE = {4: 1e-2, 8: 1e-2}


def case(bits: int, dtype: str = "bfloat16", group_size: int = 64):
    """(x, packed, scales, biases, bits, group_size): 16 rows, 64 columns, K = 1152."""
    packed, scales, biases = quantized_weights(64, 1152, bits, group_size, DTYPES[dtype])
    return activations(16, 1152, DTYPES[dtype]), packed, scales, biases, bits, group_size


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_model_rows_are_one_row_runs_and_close_to_mlx(bits, dtype):
    args = case(bits, dtype)
    got = model_product(*args, dtype)
    x, rest = args[0], args[1:]
    for r in (0, 7, 15):
        assert np.array_equal(got[r : r + 1], model_product(x[r : r + 1], *rest, dtype))
    assert relative_error(got, *args) < TOLERANCE[bits]


def sequential_sum(lanes: np.ndarray) -> np.ndarray:
    total = np.zeros(lanes.shape[:-1], np.float32)
    for i in range(lanes.shape[-1]):
        total = total + lanes[..., i]
    return total


def cancelling_case(dtype: str = "bfloat16", rows: int = 4, n_out: int = 64):
    """8 bits, groups of 64, K = 1152, where the order of the warp's additions shows in T: lane
    0's and lane 16's first elements (k = 0 and 128) have the same weights and x = +-2^20 there,
    so their sums cancel in the tree's first level but swallow the other lanes' bits in a
    sequential sum."""
    rng = np.random.default_rng(3)
    q = rng.integers(0, 256, (n_out, 1152), dtype=np.uint8)
    scales = qmv_model.round_to(rng.uniform(2**-7, 2**-6, (n_out, 18)), dtype)
    biases = qmv_model.round_to(-rng.uniform(0.5, 1.5, (n_out, 18)), dtype)
    q[:, 128:192], scales[:, 2], biases[:, 2] = q[:, :64], scales[:, 0], biases[:, 0]
    x = qmv_model.round_to(rng.normal(size=(rows, 1152)), dtype)
    x[:, 0], x[:, 128] = 2.0**20, -(2.0**20)
    as_mx = [mx.array(a, dtype=DTYPES[dtype]) for a in (x, scales, biases)]
    return as_mx[0], mx.array(q.view(np.uint32)), as_mx[1], as_mx[2], 8, 64


@pytest.mark.parametrize("bits", [4, 8])
def test_mutations_of_the_model_fail_the_checks(monkeypatch, bits):
    """A scale read from the neighbouring group, or a group's products left out, breaks
    closeness to MLX. Lanes added in another order, or the dequantization rounded twice, keep
    it but break equality with MLX's qmv (the transcription here, MLX itself on the GPU): the
    lanes' order shows in T only where sums cancel (`cancelling_case`)."""
    x, packed, scales, biases, _, group_size = args = case(bits)
    shifted = mx.roll(scales, 1, axis=1)
    wrong_scale = model_product(x, packed, shifted, biases, bits, group_size, "bfloat16")
    assert relative_error(wrong_scale, *args) > 10 * TOLERANCE[bits]
    without_group = x.astype(mx.float32)
    without_group[:, group_size : 2 * group_size] = 0  # as if the second group were skipped
    dropped = model_product(without_group.astype(x.dtype), *args[1:], "bfloat16")
    assert relative_error(dropped, *args) > 10 * TOLERANCE[bits]

    rnd = qmv_model.round_to
    twice = model_product(*args, "bfloat16")
    with monkeypatch.context() as patch:
        patch.setattr(qmv_model, "dequantize", lambda q, s, b, d: rnd(rnd(q * s, d) + b, d))
        twice, once = model_product(*args, "bfloat16"), twice
    assert relative_error(twice, *args) < TOLERANCE[bits]
    assert (twice != once).mean() > 0.1

    cancelling = cancelling_case()
    x, packed, scales, biases, bits, group_size = cancelling
    weights = np.array(packed), as_float64(scales), as_float64(biases)
    qmv = mlx_qmv_one_row(as_float64(x)[0], *weights, bits, group_size, "bfloat16")
    assert np.array_equal(model_product(*cancelling, "bfloat16")[0], qmv)
    with monkeypatch.context() as patch:
        patch.setattr(qmv_model, "warp_sum", sequential_sum)
        sequential = model_product(*cancelling, "bfloat16")[0]
    assert (sequential != qmv).mean() > 0.1


PRELUDE = """
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int v[10]; __device__ int operator[](int i) const { return v[i]; } };
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize(
    "dtype, bits, group_size, rows, groups",
    [("__nv_bfloat16", 4, 64, 8, 2), ("__half", 8, 32, 3, 1)],
)
def test_kernel_source_compiles_for_an_h100_without_spills(
    tmp_path, dtype, bits, group_size, rows, groups
):
    """As `mx.fast.cuda_kernel` wraps it (parameters, template constants), for sm_90a."""
    constants = dict(BITS=bits, GROUP=group_size, ROWS=rows, GROUPS=groups, WARPS=8)
    signature = (
        f"const {dtype}* x, const __grid_constant__ Shape x_shape, const __grid_constant__ int "
        "x_ndim, const uint32_t* w, const __grid_constant__ Shape w_shape, "
        f"const {dtype}* scales, const {dtype}* biases, {dtype}* out"
    )
    body = "".join(f"  constexpr int {k} = {v};\n" for k, v in constants.items())
    source = (
        f"{PRELUDE}{cuda_quantized.HEADER}__global__ void kernel({signature}) {{\n"
        f"  using T = {dtype};\n{body}{cuda_quantized.SOURCE}}}\n"
    )
    (tmp_path / "kernel.cu").write_text(source)
    command = ["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "kernel.cu"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 bytes spill stores" in done.stderr, done.stderr[-2000:]


@pytest.fixture
def quantized_products(as_cuda, monkeypatch):  # noqa: F811
    """As `as_cuda`, and the quantized kernel runs (here: an exact stand-in, MLX's product,
    taking float32 scales too); returns (rows, id of the weight) of every product."""
    calls = []

    def recording(x, weight, scales, biases, bits, group_size):
        calls.append((x.size // x.shape[-1], id(weight)))
        return mx.quantized_matmul(
            x, weight, scales, biases, transpose=True, group_size=group_size, bits=bits
        )

    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    monkeypatch.setattr(cuda_quantized, "DTYPES", (mx.float32, *cuda_quantized.DTYPES))
    monkeypatch.setattr(cuda_quantized, "quantized_matmul", recording)
    return calls


@pytest.mark.parametrize("name, tied", [("llama", False), ("qwen3", True)])
def test_verify_and_draft_quantized_products_take_the_kernel(
    tokenizer, quantized_products, name, tied
):
    """Every quantized linear layer of the target's blocks and of the drafter, and the LM head
    (a quantized linear or, tied, the quantized embedding): products of 2+ rows go to the
    kernel, one row to MLX's; the output stays mlx-lm's; the classes are back afterwards."""
    model = build(name, fields=dict(FAMILIES[name][1], head_dim=32, tie_word_embeddings=tied))
    draft = init_draft(model, num_layers=2, block_size=8)
    nn.quantize(model, group_size=32, bits=4)
    nn.quantize(draft, group_size=32, bits=4)
    expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
    classes = {id(m): type(m) for m in [*model.modules(), *draft.modules()]}
    tokens = run(model, draft, tokenizer, block_size=8)
    assert tokens == expected[:MAX_TOKENS], (
        f"first difference at {first_difference(tokens, expected)}"
    )
    head = target_module.TargetAdapter(model).head
    assert isinstance(head, nn.QuantizedEmbedding if tied else nn.QuantizedLinear)
    assert_products_taken(model, draft, quantized_products, nn.QuantizedLinear)
    assert classes == {id(m): type(m) for m in [*model.modules(), *draft.modules()]}


def test_takes_names_what_the_kernel_takes():
    layer = nn.QuantizedLinear(256, 64, bias=False, group_size=64, bits=4)
    assert not cuda_quantized.takes(layer)  # float32 scales
    layer.set_dtype(mx.bfloat16)
    assert cuda_quantized.takes(layer)
    assert cuda_kernels.few_rows_class(layer) is cuda_quantized.FewRowsQuantizedLinear
    three_bits = nn.QuantizedLinear(256, 64, bias=False, group_size=64, bits=3)
    three_bits.set_dtype(mx.bfloat16)
    assert not cuda_quantized.takes(three_bits)
    fp4 = nn.QuantizedLinear(256, 64, bias=False, mode="mxfp4")
    fp4.set_dtype(mx.bfloat16)
    assert not cuda_quantized.takes(fp4)
    embedding = nn.QuantizedEmbedding(100, 256, group_size=32, bits=8)
    embedding.set_dtype(mx.float16)
    assert cuda_kernels.few_rows_class(embedding) is cuda_quantized.FewRowsQuantizedEmbedding


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [2, 7, 16])
@pytest.mark.parametrize("n_out, depth", [(1024, 4096), (300, 1152)])
def test_kernel_rows_are_mlx_one_row_products_bit_for_bit(
    dtype, bits, group_size, rows, n_out, depth
):
    """Each row of the kernel's product equals MLX's product of that row alone (its qmv), and
    on the small shape (a tail of lanes, N not a multiple of 8) the numpy model's."""
    packed, scales, biases = quantized_weights(n_out, depth, bits, group_size, DTYPES[dtype])
    x = activations(rows, depth, DTYPES[dtype])
    got = cuda_quantized.quantized_matmul(x, packed, scales, biases, bits, group_size)
    for r in range(rows):
        one = mx.quantized_matmul(
            x[r : r + 1], packed, scales, biases, transpose=True, group_size=group_size, bits=bits
        )
        assert mx.array_equal(got[r : r + 1], one).item(), f"row {r}"
    if n_out < 1024:
        expected = model_product(x, packed, scales, biases, bits, group_size, dtype)
        assert np.array_equal(as_float64(got), expected)
