"""cpu_math: the verify forward's exp, SwiGLU and attention against float64 references
and MLX's own kernels, its compiled RMSNorm and RoPE against MLX's bit for bit, and how
the target's forwards bind them."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import Llama3RoPE, ProportionalRoPE

from dflash_mlx.models import backends
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.native import cpu_math

FLOAT32_ULP = 2.0**-23


def test_exp_is_within_two_ulps_of_the_true_value():
    mx.random.seed(0)
    x = mx.concatenate([mx.random.uniform(-87.3, 0.0, (200_000,)), mx.array([0.0, -1e-30, -1.0])])
    ours = np.array(cpu_math.exp_nonpositive(x), dtype=np.float64)
    exact = np.exp(np.array(x, dtype=np.float64))
    assert np.max(np.abs(ours - exact) / exact) < 2 * FLOAT32_ULP
    assert ours[-3:].tolist() == [1.0, 1.0, pytest.approx(np.exp(-1.0), rel=FLOAT32_ULP)]


def test_exp_flushes_below_the_smallest_normal_number_and_takes_positives_as_zero():
    x = mx.array([-87.4, -100.0, -1e30, -mx.inf, 3.0])
    assert np.array(cpu_math.exp_nonpositive(x)).tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_swiglu_is_silu_times_up_to_float32_rounding():
    mx.random.seed(1)
    gate = mx.random.normal((4, 1536)) * 6
    gate[0, :4] = mx.array([-200.0, -30.0, 0.0, 30.0])
    up = mx.random.normal(gate.shape)
    g, u = (np.array(a, dtype=np.float64) for a in (gate, up))
    exact = g / (1.0 + np.exp(-g)) * u
    ours = np.array(cpu_math.swiglu(gate, up), dtype=np.float64)
    mlx_lms = np.array(swiglu(gate, up), dtype=np.float64)
    scale = np.abs(exact) + 1e-30
    assert np.max(np.abs(ours - exact) / scale) < 8 * FLOAT32_ULP
    assert np.max(np.abs(ours - exact) / scale) <= np.max(np.abs(mlx_lms - exact) / scale)


def test_softmax_sums_to_one_and_matches_float64():
    mx.random.seed(2)
    x = mx.random.normal((5, 300)) * 20
    x[1, :100] = -mx.inf
    exact = np.exp(np.array(x, dtype=np.float64) - np.array(x.max(axis=-1, keepdims=True)))
    exact /= exact.sum(axis=-1, keepdims=True)
    ours = np.array(cpu_math.softmax(x), dtype=np.float64)
    assert np.max(np.abs(ours - exact)) < 1e-6
    assert np.all(ours[1, :100] == 0.0)


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive", "bool per head"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_attention_equals_mlx_fast_sdpa(mask, heads):
    mx.random.seed(3)
    (h, kv), length, keys = heads, 5, 23
    q = mx.random.normal((1, h, length, 16))
    k, v = mx.random.normal((1, kv, keys, 16)), mx.random.normal((1, kv, keys, 16))
    if mask == "bool":
        mask = mx.random.uniform(shape=(length, keys)) > 0.3
        mask[:, -1] = True
    elif mask == "additive":
        mask = mx.random.normal((1, h, length, keys))
    elif mask == "bool per head":
        mask = mx.random.uniform(shape=(1, h, length, keys)) > 0.3
        mask[..., 0] = True
    ours = cpu_math.attention(q, k, v, 0.25, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert ours.shape == theirs.shape
    assert mx.allclose(ours, theirs, atol=2e-6)


def test_verify_classes_rebind_mlx_lms_functions_in_a_copy_only():
    mlp, attention = (
        backends.verify_class(llama.MLP, "cpu"),
        backends.verify_class(llama.Attention, "cpu"),
    )
    assert issubclass(mlp, llama.MLP) and issubclass(attention, llama.Attention)
    assert mlp.__call__.__globals__["swiglu"] is backends._cpu_swiglu
    assert llama.MLP.__call__.__globals__["swiglu"] is swiglu  # mlx-lm's module is untouched
    assert llama.swiglu is swiglu
    assert backends.verify_class(nn.Linear, "cpu") is None  # calls neither
    assert backends.verify_class(nn.Module, "cpu") is None  # no __call__ of its own

    class OwnSwiGLU(nn.Module):  # a global of another name or meaning is left alone
        def __call__(self, x):
            return swiglu_like(x)

    def swiglu_like(x):
        return x

    assert backends.verify_class(OwnSwiGLU, "cpu") is None


def test_a_verify_mlp_computes_what_mlx_lms_does():
    mx.random.seed(4)
    args = llama.ModelArgs("llama", 64, 1, 160, 4, 1e-5, 100, num_key_value_heads=2)
    mlp = llama.MLP(args)
    x = mx.random.normal((1, 7, 64))
    plain = mlp(x)
    mlp.__class__ = backends.verify_class(llama.MLP, "cpu")
    assert mx.allclose(mlp(x), plain, atol=1e-5)


def test_a_half_precision_verify_mlp_keeps_its_dtype_and_mlx_lms_bits():
    # cpu_math's exp is float32 arithmetic: a bf16 MLP through it would carry float32 into
    # the rest of the verify forward, which decoding computes in bf16
    mx.random.seed(5)
    args = llama.ModelArgs("llama", 64, 1, 160, 4, 1e-5, 100, num_key_value_heads=2)
    mlp = llama.MLP(args)
    mlp.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 7, 64)).astype(mx.bfloat16)
    plain = mlp(x)
    mlp.__class__ = backends.verify_class(llama.MLP, "cpu")
    ours = mlp(x)
    assert ours.dtype == mx.bfloat16
    assert mx.array_equal(ours, plain)


def test_the_verify_forward_hooks_every_block_of_a_llama(loaded):
    model, _, _ = loaded("llama-tied-gqa")
    target = TargetAdapter(model)
    target.forward(mx.array([[5, 9, 33]]), [target.make_cache()])
    swaps = target.verify_swaps(3)
    counts = {
        name: sum(v.__name__ == name for _, _, v in swaps)
        for name in {v.__name__ for _, _, v in swaps}
    }
    blocks = len(target.layers)
    # every block's attention, MLP, two norms and RoPE; the final norm
    assert counts == {
        "CpuMathAttention": blocks,
        "CpuMathMLP": blocks,
        "CompiledRMSNorm": 2 * blocks + 1,
        "CompiledRoPE": blocks,
    }
    assert all(type(m) is cls for m, cls, _ in swaps)  # every class is back


def test_a_one_position_forward_is_mlx_lms_bit_for_bit_with_compiled_norms_and_rope(loaded):
    model, _, _ = loaded("llama-tied-gqa")
    target = TargetAdapter(model)
    ours, theirs = target.make_cache(), target.make_cache()
    prompt = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    model(prompt, cache=ours), model(prompt, cache=theirs)
    for token in (5, 3, 5, 8):  # at offsets 8-11: one trace serves every offset
        mine = target.forward(mx.array([[token]]), [ours]).logits
        assert mx.array_equal(mine[0], model(mx.array([[token]]), cache=theirs)[0])
    kinds = {v.__name__ for _, _, v in target.verify_swaps(1)}
    assert kinds == {"CompiledRMSNorm", "CompiledRoPE"}  # mlx-lm's attention and MLP as they are


@pytest.mark.parametrize("shape", [(1, 9, 1, 64), (1, 3, 16, 64), (2, 4, 5, 32)])
def test_compiled_rms_norm_and_rope_are_mlx_fast_bit_for_bit(shape):
    mx.random.seed(6)
    x = mx.random.normal(shape) * 3
    weight = mx.random.normal(shape[-1:])
    for eps in (1e-5, 1e-6):
        assert mx.array_equal(cpu_math.rms_norm(x, weight, eps), mx.fast.rms_norm(x, weight, eps))
    freqs = Llama3RoPE(shape[-1], 8192, False, 500000.0, {"factor": 8.0})._freqs
    for offset in (0, 7, 4095, mx.array(130), mx.arange(shape[0]) + 11):
        for traditional, base, scale, f in ((False, 1e4, 1.0, None), (True, None, 1.0, freqs)):
            args = dict(traditional=traditional, base=base, scale=scale, offset=offset, freqs=f)
            ours = cpu_math.rope(x, shape[-1], **args)
            assert mx.array_equal(ours, mx.fast.rope(x, shape[-1], **args))


@pytest.mark.parametrize("rows", [1, 2])
def test_a_rope_given_one_offset_per_query_places_each_query_as_mlx_fast_rope(rows):
    """A tree forward's queries each at their node's position (no transposes on the CPU):
    mx.fast.rope places them so when each query is a batch entry of its own."""
    mx.random.seed(9)
    x = mx.random.normal((rows, 4, 6, 64)) * 3
    positions = mx.array([9, 10, 10, 11, 12, 11, 300, 301, 301, 302, 303, 302][: 6 * rows])
    freqs = Llama3RoPE(64, 8192, False, 500000.0, {"factor": 8.0})._freqs
    for dims, traditional, base, f in (
        (64, False, 1e4, None),
        (32, True, 1e4, None),
        (64, True, None, freqs),
    ):
        args = dict(traditional=traditional, base=base, scale=1.0, offset=positions, freqs=f)
        placed = x.transpose(0, 2, 1, 3).reshape(rows * 6, 4, 1, 64)
        theirs = mx.fast.rope(placed, dims, **args).reshape(rows, 6, 4, 64).transpose(0, 2, 1, 3)
        assert mx.array_equal(cpu_math.rope(x, dims, **args), theirs)


def test_ropes_in_one_forward_share_a_table_per_position_and_length(tmp_path):
    mx.random.seed(8)
    x, y = mx.random.normal((1, 3, 5, 64)), mx.random.normal((1, 2, 5, 64))
    nodes = mx.array([9, 10, 10, 11, 12])  # a tree's positions: a table of their own
    calls = [(x, 7), (y, 7), (x, 8), (x[:, :, :2], 7), (x.swapaxes(0, -2), nodes)]
    with cpu_math.shared_rope_tables():
        outs = [
            cpu_math.rope(a, 64, traditional=False, base=1e4, scale=1.0, offset=o) for a, o in calls
        ]
        tables = len(cpu_math._tables.memo)
    assert tables == 4  # x and y at 7 share one; offset 8, length 2 and the nodes differ
    mx.export_to_dot(str(tmp_path / "ropes.dot"), *outs)
    assert open(tmp_path / "ropes.dot").read().count('label ="Cos"') == 4
    for (a, o), out in zip(calls, outs):
        theirs = mx.fast.rope(a, 64, traditional=False, base=1e4, scale=1.0, offset=o)
        assert mx.array_equal(out, theirs)


def test_logsumexp_matches_float64_and_keeps_rows_of_minus_infinity():
    mx.random.seed(5)
    x = mx.random.normal((3, 49152)) * 8
    x[1, :1000] = -mx.inf
    x = mx.concatenate([x, mx.full((1, 49152), -mx.inf)])
    rows = np.array(x[:3], dtype=np.float64)
    top = rows.max(axis=-1, keepdims=True)
    exact = top + np.log(np.exp(rows - top).sum(axis=-1, keepdims=True))
    ours = np.array(cpu_math.logsumexp(x))
    assert ours.shape == (4, 1)
    assert np.max(np.abs(ours[:3] - exact) / np.abs(exact)) < 4 * FLOAT32_ULP
    assert ours[3, 0] == -np.inf


def test_the_drafters_block_runs_its_norms_and_rope_compiled_with_the_same_bits(loaded):
    """Its block and its context append (the hidden_norm) build through compiled norms and
    RoPEs, and the block's hidden states keep their bits."""
    model, _, draft = loaded("llama-tied-gqa")
    target = TargetAdapter(model)
    cache = target.make_cache()
    tokens, taps = mx.array([[3, 1, 4, 1, 5, 9]]), draft.config.target_layer_ids
    features = target.forward(tokens, [cache], taps=taps, prompt=True).features
    block = mx.array([7, *[draft.config.mask_token_id] * 3])
    results = []
    for swapping in (True, False):
        draft_cache = draft.make_cache()
        draft.append_context(features, [draft_cache])
        swaps = draft.block_swaps("cpu") if swapping else []
        norms = [m for m, _, _ in draft.block_swaps("cpu")]
        with backends.building(swaps):  # [] leaves every module's class as it is
            assert {type(m).__name__.startswith("Compiled") for m, _, _ in swaps} <= {True}
            hidden = draft(draft.embed_blocks(target.embed_tokens, block[None]), draft_cache)
        results.append(hidden)
    kinds = {type(m).__name__ for m in norms}
    assert kinds == {"RMSNorm", "RoPE"}  # every class is back
    # 4 norms and a RoPE a layer, the final norm and the context's hidden_norm
    assert len(norms) == 5 * len(draft.layers) + 2
    assert mx.array_equal(*results)


@pytest.mark.parametrize(
    "module",
    [
        nn.RMSNorm(64, eps=1e-5),
        nn.RoPE(64, traditional=False, base=1e6),
        nn.RoPE(32, traditional=True, base=1e4, scale=0.5),
        Llama3RoPE(64, 8192, False, 5e5, {"factor": 8.0}),
        ProportionalRoPE(64, 32, base=1e4),
    ],
    ids=type,
)
def test_every_compiled_class_computes_its_modules_own_call_bit_for_bit(module):
    mx.random.seed(7)
    x = mx.random.normal((1, 4, 6, 64))
    if isinstance(module, nn.RMSNorm):
        module.weight = mx.random.normal((64,))
        calls = [(x,)]
    else:  # a chain at an offset, and tree nodes at their own positions (one per batch row)
        calls = [(x, 37), (x.swapaxes(0, -2), mx.array([37, 38, 38, 39, 40, 40]))]
    compiled_class = cpu_math.COMPILED_CLASSES[type(module)]
    for args in calls:
        assert mx.array_equal(compiled_class.__call__(module, *args), module(*args))
