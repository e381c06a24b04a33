"""The CPU few-row quantized product (`few_rows_quantized.py`): every row bit for bit what MLX's
one-row `mx.quantized_matmul` gives, and what an independent reference of MLX's summation order
gives; the fallback to MLX's product where it does not apply; its place in the verify forward
and the drafter's block."""

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from dflash_mlx.models import backends
from dflash_mlx.native import few_rows_quantized
from dflash_mlx.native.few_rows_quantized import (
    FewRowsQuantizedEmbedding,
    FewRowsQuantizedLinear,
    few_rows_class,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU only")


@pytest.fixture(scope="module")
def ext():
    built = few_rows_quantized.extension()
    assert built is not None, few_rows_quantized.status()  # a compiler and nanobind are there
    return built


def quantized(n: int, k: int, bits: int, group: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    return mx.quantize(w, group_size=group, bits=bits)


def one_row_at_a_time(x: mx.array, wq, scales, biases, bits: int, group: int) -> np.ndarray:
    """MLX's product, one row per call: what mlx-lm's decoding computes."""
    rows = x.reshape(-1, x.shape[-1])
    out = [
        mx.quantized_matmul(r[None], wq, scales, biases, group_size=group, bits=bits) for r in rows
    ]
    return np.array(mx.concatenate(out)).reshape(*x.shape[:-1], -1)


def sequential_reference(x, wq, scales, biases, bits: int, group: int, drop_group=None):
    """MLX's CPU order written out in numpy: each weight dequantized as scale * q + bias, and
    x[k] * it added to one float32 sum, k in order; `drop_group` skips that group's terms."""
    q = np.array(wq).view(np.uint8)
    n = q.shape[0]
    q = np.stack([q & 15, q >> 4], -1).reshape(n, -1) if bits == 4 else q
    s, b = (np.repeat(np.array(a), group, axis=1) for a in (scales, biases))
    w = (s * q.astype(np.float32)).astype(np.float32) + b
    rows = np.array(x).reshape(-1, x.shape[-1])
    total = np.zeros((rows.shape[0], n), np.float32)
    for k in range(rows.shape[1]):
        if drop_group is None or k // group != drop_group:
            total = total + rows[:, k : k + 1] * w[None, :, k]
    return total.reshape(*x.shape[:-1], n)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_row_is_mlx_one_row_product_bit_for_bit(ext, bits, group):
    n, k = 77, 5 * group  # odd weight rows (a partial tile), K past a whole chunk for group 64+
    wq, scales, biases = quantized(n, k, bits, group)
    rng = np.random.default_rng(bits * group)
    for rows in [*range(1, 17), ext.max_rows()]:
        x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
        ours = np.array(ext.quantized_matmul(x, wq, scales, biases, bits, group))
        assert np.array_equal(ours, one_row_at_a_time(x, wq, scales, biases, bits, group)), rows


@pytest.mark.parametrize("bits", [4, 8])
def test_matches_an_independent_reference_and_catches_mutations(ext, bits):
    group, rows = 64, 9
    wq, scales, biases = quantized(40, 192, bits, group, seed=1)
    x = mx.array(np.random.default_rng(2).standard_normal((rows, 192)).astype(np.float32))
    ours = np.array(ext.quantized_matmul(x, wq, scales, biases, bits, group))
    assert np.array_equal(ours, sequential_reference(x, wq, scales, biases, bits, group))
    # the comparison is exact enough to see one scale one ulp off, or a group left out
    wrong = np.array(scales)
    wrong[3, 1] = np.nextafter(wrong[3, 1], np.float32(np.inf))
    mutated = sequential_reference(x, wq, mx.array(wrong), biases, bits, group)
    assert not np.array_equal(ours[:, 3], mutated[:, 3])
    assert np.array_equal(np.delete(ours, 3, axis=1), np.delete(mutated, 3, axis=1))
    dropped = sequential_reference(x, wq, scales, biases, bits, group, drop_group=2)
    assert not np.array_equal(ours, dropped)


def test_strided_and_batched_inputs(ext):
    bits, group = 4, 32
    wq, scales, biases = quantized(33, 96, bits, group)
    x = mx.array(np.random.default_rng(3).standard_normal((96, 2, 5)).astype(np.float32))
    x = x.transpose(1, 2, 0)  # (2, 5, 96): no row is contiguous
    ours = np.array(ext.quantized_matmul(x, wq, scales, biases, bits, group))
    assert ours.shape == (2, 5, 33)
    assert np.array_equal(ours, one_row_at_a_time(x, wq, scales, biases, bits, group))


def layer(bits=4, group=32, mode="affine", dims=(96, 50)) -> nn.QuantizedLinear:
    linear = nn.Linear(*dims, bias=True)
    return nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits, mode=mode)


def test_layers_take_the_product_only_where_it_applies(ext):
    assert few_rows_class(layer()) is FewRowsQuantizedLinear
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(70, 64), group_size=64)
    assert few_rows_class(embedding) is FewRowsQuantizedEmbedding
    assert few_rows_class(layer(bits=3)) is None
    assert few_rows_class(layer(bits=6)) is None
    assert few_rows_class(layer(group=32, mode="mxfp4")) is None
    assert few_rows_class(nn.Linear(8, 8)) is None

    half = layer()
    half.set_dtype(mx.bfloat16)  # bf16 scales and biases: MLX's product
    assert few_rows_class(half) is None

    module = layer()
    rng = np.random.default_rng(4)
    for rows in (1, 2, 16, ext.max_rows() + 1):  # 1 and max + 1: MLX's product
        x = mx.array(rng.standard_normal((1, rows, 96)).astype(np.float32))
        module.__class__ = FewRowsQuantizedLinear
        ours = np.array(module(x))
        module.__class__ = nn.QuantizedLinear
        assert np.array_equal(ours, np.array(module(x))), rows
        expected = one_row_at_a_time(x, module.weight, module.scales, module.biases, 4, 32)
        assert np.array_equal(ours, expected + np.array(module.bias)), rows


def test_verify_and_block_swaps_take_the_quantized_layers(ext):
    model = nn.Sequential(layer(dims=(96, 64)), nn.RMSNorm(64), layer(dims=(64, 32)))
    several = backends.verify_swaps([model], "cpu", positions=16)
    assert {new for _, _, new in several} >= {FewRowsQuantizedLinear}
    one = backends.verify_swaps([model], "cpu", positions=1)
    assert FewRowsQuantizedLinear not in {new for _, _, new in one}
    block = backends.block_swaps([model], "cpu")
    assert sum(new is FewRowsQuantizedLinear for _, _, new in block) == 2


def test_status_says_which_product_runs(ext, monkeypatch):
    assert few_rows_quantized.status().startswith("in use")
    monkeypatch.setenv("DFLASH_MLX_NO_FEW_ROWS_QMM", "1")
    few_rows_quantized.extension.cache_clear()
    try:
        assert few_rows_quantized.extension() is None
        assert "disabled" in few_rows_quantized.status()
        assert few_rows_class(layer()) is None
    finally:
        monkeypatch.delenv("DFLASH_MLX_NO_FEW_ROWS_QMM")
        few_rows_quantized.extension.cache_clear()
        assert few_rows_quantized.extension() is not None
