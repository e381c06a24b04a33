"""The few-row quantized product kernel (metal/quantized_rows.*), run on the CPU by the MSL
emulator: every row bit for bit as a one-row run and as MLX's one-row kernel's order computes
it (tests/qmv_one_row.metal), close to MLX's CPU product, and wired into verify forwards."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import msl_emu
import numpy as np
import pytest
import test_families
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.models import backends
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.native import kernels
from dflash_mlx.native.kernels import metal_quantized as mq

NO_COMPILER = "no clang with _Float16/__bf16 (apt-get install clang-19 libclang-rt-19-dev)"
# Skipped on a developer's machine without clang; under CI=true they run, and fail.
pytestmark = pytest.mark.skipif(
    msl_emu.find_compiler() is None and os.environ.get("CI") != "true", reason=NO_COMPILER
)
ONE_ROW_SOURCE = (Path(__file__).parent / "qmv_one_row.metal").read_text()

# (dtype, bits, group size, K, N): each of MLX's one-row orders (`mq.packs`: 2 = qmv_fast,
# 1 = qmv, here with a partial last block of K or a partial tile of 8 columns), every dtype,
# bit width and group size.
CONFIGS = [
    (mx.float32, 4, 32, 1024, 16),  # qmv_fast, several groups per block
    (mx.bfloat16, 4, 64, 576, 24),  # qmv, last block of K a quarter full
    (mx.float16, 4, 128, 640, 13),  # qmv, partial block and a partial column tile
    (mx.float16, 8, 32, 512, 8),  # qmv_fast
    (mx.float32, 8, 128, 384, 20),  # qmv, N not a multiple of 8
    (mx.bfloat16, 8, 64, 768, 32),  # qmv_fast
]
IDS = [f"{str(c[0]).split('.')[-1]}-{c[1]}bit-g{c[2]}-K{c[3]}-N{c[4]}" for c in CONFIGS]


def quantized_weight(config, seed=0):
    dtype, bits, group_size, depth, n_out = config
    key = mx.random.key(seed)
    w, scales, biases = mx.quantize(
        mx.random.normal((n_out, depth), key=key), group_size=group_size, bits=bits
    )
    return w, scales.astype(dtype), biases.astype(dtype)


def activations(config, rows, seed=1):
    return mx.random.normal((rows, config[3]), key=mx.random.key(seed)).astype(config[0])


def run_kernel(config, x, weight, source=None, header=None):
    """The few-row kernel on all rows of x, in the emulator (`source`/`header`: mutations)."""
    spec = mq.kernel_spec()
    spec["source"] = source or spec["source"]
    spec["header"] = header or spec["header"]
    call = mq.kernel_call(x, *weight, config[2], config[1])
    return msl_emu.run(**spec, **call)[0].to_mx()


def run_one_row_reference(config, x, weight):
    """tests/qmv_one_row.metal: one threadgroup column per row of x, MLX's one-row order."""
    call = mq.kernel_call(x, *weight, config[2], config[1])
    call["template"] = [t for t in call["template"] if t[0] != "ROWS"]
    call["grid"] = (32 * x.shape[0], *call["grid"][1:])
    plain = "#include <metal_stdlib>\nusing namespace metal;\n"  # nothing of the kernel's
    spec = dict(mq.kernel_spec(), name="qmv_one_row", source=ONE_ROW_SOURCE, header=plain)
    return msl_emu.run(**spec, **call)[0].to_mx()


def mlx_cpu_product(config, x, weight):
    """MLX's CPU product of the same values in float32 (its own summation order)."""
    w, scales, biases = weight
    f32 = [a.astype(mx.float32) for a in (x, scales, biases)]
    return mx.quantized_matmul(f32[0], w, f32[1], f32[2], group_size=config[2], bits=config[1])


def close_to_cpu(config, got, x, weight) -> bool:
    """Within rounding of the result's dtype (and of the 4-bit sums in it) of MLX's CPU."""
    want = np.array(mlx_cpu_product(config, x, weight))
    eps = {mx.float32: 1e-6, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[config[0]]
    err = np.abs(np.array(got.astype(mx.float32)) - want).max()
    return bool(err <= 4 * eps * np.abs(want).max())


def test_the_shim_rounds_half_and_bfloat_per_operation():
    # 2048 + 1 is not a half (nor 256 + 1 a bfloat): each sum rounds back, as MSL's types do.
    src = """
    T one = T(1.0f), big = T(in0[0]);
    out0[0] = static_cast<float>(big + one + one);
    """
    for dtype, big in ((mx.float16, 2048.0), (mx.bfloat16, 256.0)):
        (out,) = msl_emu.run(
            name="t", input_names=["in0"], output_names=["out0"], source=src, header="",
            inputs=[mx.array([big])], template=[("T", dtype)], grid=(1, 1, 1),
            threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32],
        )  # fmt: skip
        assert out.data[0] == big


# --- (1) each row as a one-row run of the same kernel ------------------------------------


@pytest.mark.parametrize("rows", range(1, mq.MAX_ROWS + 1))
def test_every_row_equals_a_one_row_run(rows):
    config = CONFIGS[rows % len(CONFIGS)]
    weight = quantized_weight(config, seed=rows)
    x = activations(config, rows, seed=100 + rows)
    together = run_kernel(config, x, weight)
    assert together.shape == (rows, config[4]) and together.dtype == config[0]
    for r in range(rows):
        assert mx.array_equal(together[r], run_kernel(config, x[r : r + 1], weight)[0]), r


# --- (2) MLX's one-row order, and MLX's CPU product -------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_rows_equal_the_one_row_reference(config):
    weight = quantized_weight(config)
    x = activations(config, 16)
    got = run_kernel(config, x, weight)
    want = run_one_row_reference(config, x, weight)
    assert mx.array_equal(got, want)
    # The reference itself against MLX's CPU product: close, not equal (another order).
    assert close_to_cpu(config, want, x, weight)
    assert bool(mx.all(mx.isfinite(want)).item())


# --- (3) mutations the tests must catch ---------------------------------------------------

# (where, old, new, a real bug: also off MLX's CPU product). The kernel has no threadgroup
# memory and so no barrier; the reduction is the one cross-lane step.
MUTATIONS = {
    "wrong scale": ("body", "scales[col * groups_per_col + k / GS]",
                    "scales[col * groups_per_col + k0 / GS]", True),
    "dropped group": ("body", "if (k < K) {", "if (k + GS < K) {", True),
    "no lane reduction": ("body", "simd_sum(acc[r][c])", "acc[r][c]", True),
    "no pre-scale": ("header", "* QROWS_NIBBLE_SCALE[i % 4]", "", True),
    "lanes summed in another order": (
        "body", "const float total = simd_sum(acc[r][c]);",
        "float total = acc[r][c];"
        " for (ushort m = 16; m > 0; m /= 2) total += simd_shuffle_xor(total, m);", False),
    "products paired differently": (
        "header",
        "accum += v[0] * (q & 0x000fu) + v[1] * (q & 0x00f0u) +\n          v[2] * (q & 0x0f00u) +",
        "accum += v[0] * (q & 0x000fu) + (v[1] * (q & 0x00f0u) + v[2] * (q & 0x0f00u)) +",
        False),
    "bias applied through the scale": (
        "header", "return scale * accum + sum * bias;",
        "return scale * (accum + sum * (bias / scale));", False),
}  # fmt: skip


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_mutated_kernel_is_caught(name):
    where, old, new, real_bug = MUTATIONS[name]
    header, body = mq.load_sources()
    text = {"header": header, "body": body}[where]
    assert text.count(old) == 1, old
    mutated = {"header": header, "body": body, where: text.replace(old, new)}
    for config in CONFIGS[:2]:  # 4-bit qmv_fast with 16 values a lane, 4-bit qmv
        weight, x = quantized_weight(config), activations(config, 3)
        got = run_kernel(config, x, weight, mutated["body"], mutated["header"])
        if not mx.array_equal(got, run_one_row_reference(config, x, weight)):
            assert close_to_cpu(config, got, x, weight) is not real_bug, config
            return
    pytest.fail(f"{name!r} went unnoticed")


def test_a_rewrite_keeping_every_operation_is_not_flagged():
    # The control for the mutations: the same operations in the same order, spelled otherwise.
    header, body = mq.load_sources()
    old = "acc[r][c] += qrows_dot<BITS, PACKS>(words[c], xs, scale[c], bias[c], sum);"
    new = "const float part = qrows_dot<BITS, PACKS>(words[c], xs, scale[c], bias[c], sum);"
    new += " acc[r][c] = acc[r][c] + part;"
    assert body.count(old) == 1
    config = CONFIGS[0]
    weight, x = quantized_weight(config), activations(config, 3)
    got = run_kernel(config, x, weight, body.replace(old, new))
    assert mx.array_equal(got, run_one_row_reference(config, x, weight))


# --- the Python side: self-check, layers, swaps -------------------------------------------


@pytest.fixture
def emulated(monkeypatch):
    """Pretend Metal is available and route mx.fast.metal_kernel to the emulator."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mq, "kernel_factory", msl_emu.metal_kernel)
    monkeypatch.setattr(mq, "_self_check", {})
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    mq._kernel.cache_clear()
    yield
    mq._kernel.cache_clear()


def emulated_one_row_product(x, w, scales, biases, group_size, bits, **_):
    """Stands in for MLX's one-row product on a GPU: the reference kernel in the emulator."""
    config = (x.dtype, bits, group_size, x.shape[-1], w.shape[0])
    return run_one_row_reference(config, x, (w, scales, biases))


def test_self_check_passes_against_mlx_one_row_kernel(emulated, monkeypatch, caplog):
    monkeypatch.setattr(mq, "DTYPES", (mx.bfloat16,))  # every dtype: test_rows_equal_...
    monkeypatch.setattr(mx, "quantized_matmul", emulated_one_row_product)
    with caplog.at_level(logging.WARNING):
        assert mq.enabled()
    assert mq._self_check == {"result": None} and not caplog.records


def test_self_check_fails_on_another_order_once(emulated, monkeypatch, caplog):
    # MLX's CPU product sums in another order than the GPU's one-row kernel: not bit-identical.
    monkeypatch.setattr(mq, "DTYPES", (mx.float32,))
    with caplog.at_level(logging.WARNING):
        assert not mq.enabled() and not mq.enabled()
    assert len(caplog.records) == 1 and "not MLX's one-row product" in caplog.text
    monkeypatch.setenv(kernels.ENV_VAR, "metal")
    with pytest.raises(RuntimeError, match="few-row quantized kernel unavailable"):
        mq.enabled()
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert not mq.enabled()


def quantized_linear(depth=1024, n_out=16, bits=4, group_size=32, bias=False, **kw):
    layer = nn.Linear(depth, n_out, bias=bias)
    return nn.QuantizedLinear.from_linear(layer, group_size=group_size, bits=bits, **kw)


def test_few_rows_class_takes_the_formats_the_kernel_does():
    assert mq.few_rows_class(quantized_linear()) is mq.FewRowsQuantizedLinear
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(24, 256), 64, 8)
    assert mq.few_rows_class(embedding) is mq.FewRowsQuantizedEmbedding
    assert mq.few_rows_class(nn.Linear(256, 16)) is None
    assert mq.few_rows_class(quantized_linear(bits=3)) is None
    assert mq.few_rows_class(quantized_linear(depth=128)) is None  # MLX's qmv_quad depth
    assert mq.few_rows_class(quantized_linear(mode="mxfp4", group_size=32)) is None


def test_quantized_layers_take_the_kernel_for_2_to_16_rows(emulated, monkeypatch):
    layer = quantized_linear(depth=576, n_out=24, group_size=64, bias=True)
    layer.update({k: v.astype(mx.bfloat16) for k, v in layer.items() if k != "weight"})
    calls = []
    product = mq.quantized_rows
    monkeypatch.setattr(mq, "quantized_rows", lambda *a: calls.append(a) or product(*a))
    swaps = backends.verify_swaps([layer], "metal", positions=16)
    assert swaps == [(layer, nn.QuantizedLinear, mq.FewRowsQuantizedLinear)]
    assert backends.verify_swaps([layer], "metal", positions=1) == []
    assert backends.block_swaps([layer], "metal") == swaps
    weight = (layer["weight"], layer["scales"], layer["biases"])
    config = (mx.bfloat16, 4, 64, 576, 24)
    for rows in (1, 2, 16, 17):
        x = activations(config, rows, seed=rows).reshape(1, rows, 576)
        with backends.building(swaps):
            got = layer(x)
        if 2 <= rows <= 16:
            want = run_one_row_reference(config, x[0], weight) + layer["bias"]
            assert mx.array_equal(got[0], want)
        else:
            assert mx.array_equal(got, nn.QuantizedLinear.__call__(layer, x))
    assert len(calls) == 2
    assert type(layer) is nn.QuantizedLinear


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # an LM head; a tied quantized embedding
def test_verify_forward_and_draft_heads_take_the_kernel_on_metal(monkeypatch, name):
    # The wiring only: MLX's product stands in for the kernel (checked above), so the verify
    # forward's logits must be exactly those of mlx-lm's forward.
    fields = dict(test_families.BASE, hidden_size=256, intermediate_size=320, head_dim=64)
    fields["tie_word_embeddings"] = name == "qwen3"
    model = test_families.build(name, fields=fields)
    nn.quantize(model, group_size=64, bits=4)
    target = TargetAdapter(model)
    calls = []

    def stand_in(x, w, scales, biases, group_size, bits):
        calls.append(x.shape)
        return mx.quantized_matmul(x, w, scales, biases, group_size=group_size, bits=bits)

    monkeypatch.setattr(mq, "quantized_rows", stand_in)
    tokens = mx.arange(16)
    monkeypatch.setattr(backends, "current", lambda: None)  # mlx-lm's forward as it is
    want = target.forward(tokens[None], [make_prompt_cache(model)]).logits
    monkeypatch.setattr(backends, "current", lambda: "metal")
    got = target.forward(tokens[None], [make_prompt_cache(model)]).logits
    swapped = target.verify_swaps(16)
    assert len(swapped) == 5 * 7 + 1  # every projection of the 5 layers, and the head
    assert len(calls) == len(swapped) and mx.array_equal(got, want)
    assert target.verify_swaps(1) == []

    hidden = mx.random.normal((15, 256))
    calls.clear()
    assert mx.array_equal(target.draft_head(None)(hidden), target.lm_head(hidden))
    restricted = target.draft_head([3, 5, 8, 13])
    assert restricted.rows(hidden).shape == (15, 4) and len(calls) == 2


def test_the_benchmark_runs_on_a_mac_and_skips_elsewhere():
    """benchmarks/metal_quantized.py: on Metal a real (short) run, elsewhere one line, exit 0."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "metal_quantized.py"
    args = ["--shape", "tiny", "--copies", "1", "--reps", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
        cwd=script.parent,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    if mx.metal.is_available():
        assert "self-check: every row" in proc.stdout and "down_proj" in proc.stdout
    else:
        assert "skipped, needs MLX's Metal backend" in proc.stderr
