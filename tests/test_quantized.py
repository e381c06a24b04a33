"""Quantized targets and drafters, as Mac users run them: kept quantized (`dtype="checkpoint"`),
the loop's greedy output is mlx-lm's greedy output on the same quantized model, through chains,
trees, the prompt cache and logits processors."""

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
import test_families
from helpers import mlx_lm_greedy, reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_logits_processors
from test_families import PROMPT, build, first_difference, prompt_of, run

import dflash_mlx
from dflash_mlx import TargetAdapter, make_prompt_cache
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.native.few_rows_quantized import FewRowsQuantizedLinear

FAMILIES = ["llama", "qwen3", "qwen3_5", "gpt_oss", "gemma4_text"]
RECURRENT = {"qwen3_5"}  # no trees: recurrent layers keep no per-node state
MAX_TOKENS = 120
GROUP_SIZE = 32  # divides every tiny config's input widths (64, 96, 16 x heads)
tokenizer = test_families.tokenizer  # its fixture, shared


@pytest.fixture(scope="module")
def quantized():
    """(target, drafter, mlx-lm's greedy continuation of PROMPT on that target) per family and
    bit width, both models quantized with MLX's affine layout, built once."""
    built = {}

    def get(name: str, bits: int):
        if (name, bits) not in built:
            model = build(name)
            draft = init_draft(model, num_layers=2, block_size=16)
            nn.quantize(model, group_size=GROUP_SIZE, bits=bits)
            nn.quantize(draft, group_size=GROUP_SIZE, bits=bits)
            mx.eval(model.parameters(), draft.parameters())
            expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
            assert len(set(expected)) > 30, "a degenerate random model proves little"
            built[name, bits] = model, draft, expected
        return built[name, bits]

    return get


def settings_for(name: str) -> list[dict]:
    chains = [dict(block_size=4), dict(block_size=16), dict(adaptive=True)]
    return chains if name in RECURRENT else [*chains, dict(tree_budget=8)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", FAMILIES)
def test_quantized_greedy_equals_mlx_lm_on_the_same_model(quantized, tokenizer, name, bits):
    model, draft, expected = quantized(name, bits)
    assert any(isinstance(m, nn.QuantizedLinear) for m in model.modules())
    if sys.platform.startswith("linux"):  # verify forwards and blocks take the few-row product
        swaps = TargetAdapter(model).verify_swaps(16) + draft.block_swaps("cpu")
        assert {FewRowsQuantizedLinear} <= {new for _, _, new in swaps}
    for setting in settings_for(name):
        tokens, _ = run(model, draft, tokenizer, PROMPT, max_tokens=MAX_TOKENS, **setting)
        assert tokens == expected, f"{setting}: differs at {first_difference(tokens, expected)}"


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "gemma4_text"])
def test_quantized_prompt_cache_across_turns(quantized, tokenizer, name):
    model, draft, _ = quantized(name, 4)
    cache = make_prompt_cache(model, draft)
    first = prompt_of(30, seed=3)
    reply, _ = run(model, draft, tokenizer, first, max_tokens=24, prompt_cache=cache)
    second = first + reply + prompt_of(5, seed=4)
    expected = reference_greedy(model, second, 40, set())
    assert run(model, draft, tokenizer, second, max_tokens=40, prompt_cache=cache)[0] == expected
    assert len(cache.tokens) > len(first)  # the second turn went on from the first


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_quantized_processors_keep_greedy_equal_to_mlx_lm(quantized, tokenizer, name):
    model, draft, _ = quantized(name, 4)
    setting = dict(repetition_penalty=1.5, repetition_context_size=30, logit_bias={11: 2.0})
    prompt = prompt_of(40, seed=7)
    expected, _ = mlx_lm_greedy(model, prompt, 48, set(), **setting)
    for shape in (dict(block_size=16), dict(tree_budget=8)):
        processors = make_logits_processors(**setting)
        tokens, _ = run(
            model, draft, tokenizer, prompt, max_tokens=48, logits_processors=processors, **shape
        )
        assert tokens == expected, shape


def test_load_keeps_a_checkpoints_quantization_only_when_asked(make_pair, workdir):
    target, _ = make_pair("llama-tied-gqa")
    model, _ = dflash_mlx.load(target)
    nn.quantize(model, group_size=GROUP_SIZE, bits=4)
    quantized_dir = workdir / "quantized-target"
    quantized_dir.mkdir()
    for item in target.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            (quantized_dir / item.name).write_bytes(item.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4}
    (quantized_dir / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(quantized_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )

    kept, _ = dflash_mlx.load(quantized_dir, dtype="checkpoint")
    assert any(isinstance(m, nn.QuantizedLinear) for m in kept.modules())
    dequantized, _ = dflash_mlx.load(quantized_dir)  # the CPU default: float32
    assert not any(isinstance(m, nn.QuantizedLinear) for m in dequantized.modules())
    with pytest.raises(ValueError, match="dtype must be one of"):
        dflash_mlx.load(quantized_dir, dtype="int3")
