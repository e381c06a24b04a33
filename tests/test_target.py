"""Target side: loading (dtype, RoPE θ), lazy hidden-state capture, supported families, BLAS."""

import json
import os
import subprocess
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import copy_dir, cpu_default, read_config, reference_greedy, save_target
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text
from mlx_lm.utils import save_model

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.models import loading
from dflash_mlx.models.loading import default_dtype, dtype_for_device
from dflash_mlx.models.target import SUPPORTED_MODEL_TYPES, TargetAdapter, TreeShape
from dflash_mlx.native import blas


def test_nested_rope_theta_is_honoured(workdir, make_pair):
    top, _ = make_pair("llama-tied-gqa")
    nested = save_target(workdir / "nested-rope", nested_rope=True)
    assert "rope_theta" not in read_config(nested)
    tokens = mx.array([[5, 9, 33, 70, 100, 4, 8]])
    logits = [dflash_mlx.load(p)[0](tokens) for p in (top, nested)]
    assert mx.allclose(logits[0], logits[1], atol=1e-5)
    assert dflash_mlx.load(nested)[0].model.layers[0].self_attn.rope.base == 50000.0


@pytest.fixture(scope="module")
def bf16_target(workdir, make_pair):
    target, _ = make_pair("qwen3-untied-mha")
    bf16 = copy_dir(target, workdir / "bf16-target")
    weights = mx.load(str(target / "model.safetensors"))
    mx.save_safetensors(
        str(bf16 / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    )
    return bf16


@pytest.fixture(scope="module")
def q4_target(workdir, make_pair):
    """A 4-bit copy of the target and the quantized model it was saved from."""
    target, _ = make_pair("qwen3-untied-mha")
    q_dir = workdir / "q4-target"
    nn.quantize(model_q := dflash_mlx.load(target)[0], group_size=32, bits=4)
    save_model(q_dir, model_q)
    config = read_config(target) | {"quantization": {"group_size": 32, "bits": 4}}
    (q_dir / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (q_dir / f).write_bytes((target / f).read_bytes())
    return q_dir, model_q


def test_float32_on_the_cpu_and_the_checkpoint_dtype_on_any_gpu():
    assert dtype_for_device(mx.cpu) == mx.float32
    assert dtype_for_device(mx.gpu) is None  # Metal or CUDA: bf16 and quantization kept
    assert default_dtype() == dtype_for_device(mx.default_device().type)


@cpu_default
def test_float32_by_default_on_cpu_even_from_bf16_and_quantized(bf16_target, q4_target):
    reloaded, _ = dflash_mlx.load(bf16_target)
    assert {p.dtype for _, p in tree_flatten(reloaded.parameters())} == {mx.float32}
    halves, _ = dflash_mlx.load(bf16_target, dtype=mx.float16)
    assert {p.dtype for _, p in tree_flatten(halves.parameters())} == {mx.float16}

    q_dir, model_q = q4_target
    dequantized, _ = dflash_mlx.load(q_dir)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dequantized.named_modules())
    assert {p.dtype for _, p in tree_flatten(dequantized.parameters())} == {mx.float32}
    tokens = mx.array([[5, 9, 33]])
    assert mx.allclose(dequantized(tokens), model_q(tokens), atol=1e-4)


@cpu_default
def test_a_target_too_big_for_memory_in_float32_stays_quantized(q4_target, monkeypatch, caplog):
    """The CPU default dequantizes to float32 only where that fits in half the memory: a
    bigger target keeps its quantization (slower, but it loads), and says so."""
    q_dir, model_q = q4_target
    float32 = loading.float32_bytes(model_q)
    assert float32 == 4 * sum(
        p.size for _, p in tree_flatten(dflash_mlx.load(q_dir)[0].parameters())
    )
    monkeypatch.setattr(loading, "physical_memory", lambda: 2 * float32 - 1)
    kept, _ = dflash_mlx.load(q_dir)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in kept.named_modules())
    assert "its checkpoint's dtype and quantization are kept" in caplog.text
    forced, _ = dflash_mlx.load(q_dir, dtype="float32")  # asked for: dequantized anyway
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in forced.named_modules())
    monkeypatch.setattr(loading, "physical_memory", lambda: 2 * float32)
    assert not any(
        isinstance(m, nn.QuantizedLinear) for _, m in dflash_mlx.load(q_dir)[0].named_modules()
    )


def test_the_gpu_default_loads_on_any_device(q4_target, monkeypatch):
    """Where the device's default keeps the checkpoint's dtype (None, a GPU's), `load` keeps
    its quantization: the memory rule for float32 is not asked (a comparison of None with
    MLX's float32 is a TypeError)."""
    q_dir, _ = q4_target
    monkeypatch.setattr(loading, "default_dtype", lambda: None)
    kept, _ = dflash_mlx.load(q_dir)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in kept.named_modules())


@pytest.mark.cuda
def test_bf16_and_quantization_are_kept_on_a_cuda_gpu(bf16_target, q4_target):
    model, _ = dflash_mlx.load(bf16_target)
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.bfloat16}
    quantized, _ = dflash_mlx.load(q4_target[0])
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in quantized.named_modules())


def test_captured_features_are_the_layer_outputs(loaded):
    model, _, _ = loaded("llama-untied-mha")
    target = TargetAdapter(model)
    tokens = mx.array([[5, 9, 33, 70, 100]])
    h = target.embed_tokens(tokens)
    expected = {}
    mask = "causal"
    for i, layer in enumerate(target.layers):
        h = layer(h, mask)
        expected[i] = h
    forward = target.forward(tokens, None, taps=[4, 1], prompt=True)
    mx.eval(forward.logits)
    width = target.hidden_size
    assert forward.features.shape == (1, 5, 2 * width)
    for k, i in enumerate((4, 1)):
        assert mx.allclose(
            forward.features[..., k * width : (k + 1) * width], expected[i], atol=1e-5
        )
    assert type(target.layers[1]).__name__ == "TransformerBlock"


def test_a_second_generation_on_the_same_model_is_refused_while_one_runs(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    expected = reference_greedy(model, [5, 6, 7], 20, set(tokenizer.eos_token_ids))
    started, release = threading.Event(), threading.Event()
    first: list[int] = []

    def hold_a_generation() -> None:
        responses = stream_generate(model, draft, tokenizer, [5, 6, 7], max_tokens=20)
        first.extend(next(responses).tokens)
        started.set()
        release.wait()
        first.extend(t for r in responses for t in r.tokens)

    holder = threading.Thread(target=hold_a_generation)
    holder.start()
    try:
        assert started.wait(120)
        second = stream_generate(model, draft, tokenizer, [8, 9], max_tokens=5)
        with pytest.raises(RuntimeError, match="already being generated"):
            next(second)
    finally:
        release.set()
        holder.join()
    assert first == expected
    again = stream_generate(model, draft, tokenizer, [5, 6, 7], max_tokens=20)
    assert [t for r in again for t in r.tokens] == expected


def test_mlx_lm_decoding_the_same_model_beside_a_generation_is_its_own(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    alone = reference_greedy(model, [11, 12], 3, set())
    expected = reference_greedy(model, [5, 6, 7], 20, set(tokenizer.eos_token_ids))
    responses = stream_generate(model, draft, tokenizer, [5, 6, 7], max_tokens=20)
    tokens = list(next(responses).tokens)  # the generation holds the model
    beside: list[int] = []
    thread = threading.Thread(
        target=lambda: beside.extend(reference_greedy(model, [11, 12], 3, set()))
    )
    thread.start()
    tokens += [t for r in responses for t in r.tokens]
    thread.join()
    assert beside == alone
    assert tokens == expected


def test_the_verify_forward_leaves_the_model_as_it_was(loaded):
    model, _, _ = loaded("llama-tied-gqa")
    target = TargetAdapter(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    tokens = mx.array([5, 9, 33, 70, 100, 7])
    cache, plain_cache = target.make_cache(), target.make_cache()
    logits = target.forward(tokens[None], [cache]).logits
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert logits.shape == (1, 6, target.vocab_size)
    assert mx.allclose(logits, model(tokens[None], cache=plain_cache), atol=1e-4)
    assert cache[0].offset == 6


def test_a_target_mlx_lm_cannot_load_keeps_the_cause(workdir):
    target = save_target(workdir / "no-hidden-size")
    config = read_config(target)
    del config["hidden_size"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="TypeError: .*hidden_size") as e:
        dflash_mlx.load(target)
    assert isinstance(e.value.__cause__, TypeError)


def test_unsupported_family_names_itself_and_the_supported_ones(loaded):
    _, tokenizer, draft = loaded("llama-tied-gqa")
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=64,
        head_dim=16,
        vocab_size=draft.config.vocab_size,
        sliding_window=8,
    )
    model = gemma3_text.Model(args)
    with pytest.raises(ValueError, match="'gemma3_text' is not supported.*RotatingKVCache") as e:
        stream_generate(model, draft, tokenizer, [5, 6, 7])
    assert f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)};" in str(e.value)
    assert "gemma4, gemma4_text" in str(e.value)


MATMUL_SECONDS = """
import time, dflash_mlx, mlx.core as mx
a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
mx.eval(a, b, a @ b)
best = float("inf")
for _ in range(5):
    tic = time.perf_counter()
    mx.eval(a @ b)
    best = min(best, time.perf_counter() - tic)
print(best)
"""


@pytest.mark.skipif(
    not any(os.path.exists(p) for p in blas.CANDIDATES), reason="no system OpenBLAS installed"
)
def test_bound_blas_makes_cpu_matmuls_much_faster():
    """What the binding is for: a 1024² fp32 matmul, best of 5, with and without it
    (measured here ~30x; any real binding is far above 3x even on a loaded machine)."""

    def seconds(**env) -> float:
        out = subprocess.run(
            [sys.executable, "-c", MATMUL_SECONDS],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            check=True,
        )
        return float(out.stdout)

    bound, bundled = seconds(), seconds(DFLASH_MLX_NO_BLAS="1")
    assert bundled / bound > 3, (bound, bundled)


def test_blas_binding_reported_and_can_be_disabled():
    code = "import dflash_mlx; print(dflash_mlx.active_blas())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    env = dict(os.environ, DFLASH_MLX_NO_BLAS="1")
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "disabled by DFLASH_MLX_NO_BLAS" in off.stdout
    if sys.platform.startswith("linux") and os.path.exists(
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    ):
        assert on.stdout.startswith("OpenBLAS")


def test_a_forward_leaves_no_attribute_on_caches_or_modules(loaded):
    """Chains, trees and several rows, with taps: afterwards every module and cache has the
    class and the attributes it had."""
    model, _, _ = loaded("llama-tied-gqa")
    target = TargetAdapter(model)
    caches = [target.make_cache() for _ in range(3)]
    objects = [*model.modules(), *(c for cache in caches for c in cache)]

    def attributes() -> list:
        return [(type(obj), set(vars(obj))) for obj in objects]

    before = attributes()
    tree = TreeShape([0, 1, 1], mx.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=mx.bool_))
    for i, cache in enumerate(caches):
        target.forward(mx.array([[5, 9, 33, 70 + i]]), [cache], taps=[1, 3], prompt=True)
    mx.eval(target.forward(mx.array([[4, 5, 6]]), caches[:1], [tree], [1]).features)
    mx.eval(target.forward(mx.array([[4, 5, 6]] * 3), caches, [None, tree, tree], [1, 3]).logits)
    assert attributes() == before
