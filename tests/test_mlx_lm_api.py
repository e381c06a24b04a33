"""The Python API takes mlx-lm's keywords with mlx-lm's meanings: greedy replies equal
mlx-lm's `stream_generate` with the same keywords, and mlx-lm's argument order gets a
clear error."""

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers import reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tuner.utils import linear_to_lora_layers

import dflash_mlx
from dflash_mlx import GenerationSettings, stream_generate


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(4, 300, size=length).tolist()


def ours(model, draft, tokenizer, prompt, **kwargs) -> list[int]:
    return [t for r in stream_generate(model, draft, tokenizer, prompt, **kwargs) for t in r.tokens]


def mlx_lms(model, tokenizer, prompt, **kwargs) -> list[int]:
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, **kwargs)]


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_kv_size", 0),
        ("max_kv_size", 2.5),
        ("kv_bits", 7),
        ("kv_bits", 4.0),
        ("kv_group_size", 48),
        ("quantized_kv_start", -1),
        ("prefill_step_size", 0),
        ("prefill_step_size", None),
    ],
)
def test_out_of_bounds_cache_settings_are_one_line_naming_the_field(loaded, field, value):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    with pytest.raises(ValueError, match=f"^{field} must be") as caught:
        stream_generate(model, draft, tokenizer, [5, 6, 7], **{field: value})
    assert "\n" not in str(caught.value)


def test_cache_settings_take_mlx_lm_generate_step_defaults():
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    settings = GenerationSettings()
    assert (settings.max_kv_size, settings.kv_bits, settings.kv_group_size) == (None, None, 64)
    assert settings.quantized_kv_start == DEFAULT_QUANTIZED_KV_START
    assert settings.prefill_step_size == 2048


@pytest.mark.parametrize("prompt_len, step", [(50, 7), (50, 49), (50, 1), (1, 4), (30, 2048)])
def test_prefill_chunks_report_progress_as_mlx_lm_and_keep_the_reply(loaded, prompt_len, step):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(prompt_len, seed=prompt_len)
    theirs_calls, our_calls = [], []
    expected = mlx_lms(
        model,
        tokenizer,
        prompt,
        max_tokens=24,
        prefill_step_size=step,
        prompt_progress_callback=lambda *call: theirs_calls.append(call),
    )
    tokens = ours(
        model,
        draft,
        tokenizer,
        prompt,
        max_tokens=24,
        prefill_step_size=step,
        prompt_progress_callback=lambda *call: our_calls.append(call),
    )
    assert tokens == expected[: len(tokens)] and len(tokens) == 24
    assert our_calls == theirs_calls
    assert our_calls[0] == (0, prompt_len) and our_calls[-1] == (prompt_len, prompt_len)


@pytest.mark.parametrize(
    "keywords",
    [
        dict(max_kv_size=24),
        dict(max_kv_size=32, prefill_step_size=16),
        dict(kv_bits=4, kv_group_size=32, quantized_kv_start=50),
        dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0, prefill_step_size=16),
    ],
)
def test_cache_keywords_give_mlx_lms_reply(loaded, keywords):
    """Without a prompt cache, the cache keywords make the target's caches as mlx-lm's
    (qwen3: mlx-lm's llama makes its own caches and ignores `max_kv_size`)."""
    model, tokenizer, draft = loaded("qwen3-untied-mha")  # head_dim 32: keys quantize
    prompt = prompt_of(60, seed=6)
    expected = mlx_lms(model, tokenizer, prompt, max_tokens=48, **keywords)
    assert expected != mlx_lms(model, tokenizer, prompt, max_tokens=48)  # the option matters
    assert ours(model, draft, tokenizer, prompt, max_tokens=48, **keywords) == expected


def cycles(model, draft, tokenizer, prompt, **kwargs) -> list[tuple[list[int], int]]:
    responses = stream_generate(model, draft, tokenizer, prompt, block_size=4, **kwargs)
    return [(r.tokens, r.accepted) for r in responses]


def test_a_chunked_prefill_gives_the_drafter_every_prompt_position(loaded):
    """The drafter conditions on the target's features of every prompt position: chunked,
    it must see the same ones, so every cycle accepts the same drafts."""
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = prompt_of(90, seed=2)
    whole = cycles(model, draft, tokenizer, prompt, max_tokens=40)
    chunked = cycles(model, draft, tokenizer, prompt, max_tokens=40, prefill_step_size=16)
    assert chunked == whole
    assert sum(accepted for _, accepted in whole) > 0


def test_progress_counts_only_what_a_prompt_cache_leaves_to_prefill(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    cache = dflash_mlx.make_prompt_cache(model, draft)
    first = prompt_of(20, seed=4)
    reply = ours(model, draft, tokenizer, first, max_tokens=6, prompt_cache=cache)
    calls = []
    second = first + reply + prompt_of(9, seed=5)
    ours(
        model,
        draft,
        tokenizer,
        second,
        max_tokens=4,
        prompt_cache=cache,
        prefill_step_size=4,
        prompt_progress_callback=lambda *call: calls.append(call),
    )
    new = len(second) - len(first) - len(reply) + 1  # the reply's last token is not cached
    assert calls == [(0, new), (4, new), (8, new), (new - 1, new), (new, new)]


def test_sampler_and_logits_processors_mean_what_they_mean_in_mlx_lm(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(12, seed=8)
    keywords = dict(
        max_tokens=40,
        sampler=make_sampler(temp=1.0, top_k=1),
        logits_processors=make_logits_processors(repetition_penalty=3.0),
    )
    expected = mlx_lms(model, tokenizer, prompt, **keywords)
    assert expected != mlx_lms(model, tokenizer, prompt, max_tokens=40)  # the penalty matters
    assert ours(model, draft, tokenizer, prompt, **keywords) == expected
    assert ours(model, None, tokenizer, prompt, **keywords) == expected


@pytest.mark.parametrize(
    "call",
    [
        lambda m, t, p: stream_generate(m, t, p),
        lambda m, t, p: stream_generate(m, t, p, max_tokens=4),
        lambda m, t, p: dflash_mlx.generate(m, t, p, verbose=True),
        lambda m, t, p: dflash_mlx.generate(m, t, prompt=p),
    ],
)
def test_mlx_lm_argument_order_says_where_the_drafter_goes(loaded, call):
    model, tokenizer, _ = loaded("llama-tied-gqa")
    with pytest.raises(TypeError) as caught:
        call(model, tokenizer, "def add(a, b):")
    message = str(caught.value)
    assert "stream_generate(model, draft, tokenizer, prompt)" in message
    assert "draft=None" in message and "\n" not in message


def test_a_missing_prompt_is_named(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    with pytest.raises(TypeError, match="no prompt given"):
        stream_generate(model, draft, tokenizer)


def test_an_extra_eos_token_ends_the_reply_there(make_pair):
    target, draft_dir = make_pair("llama-tied-gqa")
    model, tokenizer = dflash_mlx.load(target)  # its own tokenizer: the EOS set is changed
    draft = dflash_mlx.load_draft(draft_dir)
    prompt = prompt_of(15, seed=9)
    reply = ours(model, draft, tokenizer, prompt, max_tokens=30)
    names = tokenizer.convert_ids_to_tokens(reply)
    # add_eos_token reads a number as a token id: a token named by digits would not do
    stop = next(
        i for i, t in enumerate(reply) if i > 3 and t not in reply[:i] and not names[i].isdigit()
    )
    before = text_of(stream_generate(model, draft, tokenizer, prompt, max_tokens=stop))
    tokenizer.add_eos_token(names[stop])
    responses = list(stream_generate(model, draft, tokenizer, prompt, max_tokens=30))
    assert [t for r in responses for t in r.tokens] == reply[: stop + 1]
    assert responses[-1].finish_reason == "stop"
    assert text_of(responses) == before  # the EOS token is not text


def text_of(responses) -> str:
    return "".join(r.text for r in responses)


def save_lora_adapter(model, path, num_layers: int = 4) -> None:
    """A LoRA adapter as mlx-lm's trainer saves one: its config and the trainable (LoRA)
    weights, here random so that the adapter changes the model's replies."""
    config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {"rank": 4, "dropout": 0.0, "scale": 20.0},
    }
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    mx.random.seed(3)
    weights = {
        name: mx.random.normal(w.shape) * 0.05 if name.endswith("lora_b") else w
        for name, w in tree_flatten(model.trainable_parameters())
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def adapted(make_pair, workdir):
    """(target dir, adapter dir) for the tiny llama target."""
    target, _ = make_pair("llama-tied-gqa")
    adapter = workdir / "llama-tied-gqa-lora"
    save_lora_adapter(mlx_lm.load(str(target))[0], adapter)
    return target, adapter


def test_a_lora_adapter_loads_as_mlx_lm_loads_it(adapted, make_pair):
    target, adapter = adapted
    _, draft_dir = make_pair("llama-tied-gqa")
    prompt = prompt_of(10, seed=11)
    model, tokenizer = dflash_mlx.load(target, adapter_path=adapter)
    draft = dflash_mlx.load_draft(draft_dir)
    eos = set(tokenizer.eos_token_ids)  # the adapter's random weights may reach one
    reference, _ = mlx_lm.load(str(target), adapter_path=str(adapter))
    expected = reference_greedy(reference, prompt, 30, eos)
    assert expected != reference_greedy(mlx_lm.load(str(target))[0], prompt, 30, eos)
    assert ours(model, draft, tokenizer, prompt, max_tokens=30, block_size=4) == expected


def test_an_adapter_without_its_weights_is_named(adapted, tmp_path):
    target, adapter = adapted
    (tmp_path / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="^no adapters.safetensors in the adapter dir"):
        dflash_mlx.load(target, adapter_path=tmp_path)


def test_an_adapter_for_other_layers_is_one_line(adapted, tmp_path):
    target, adapter = adapted
    config = json.loads((adapter / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "num_layers": 2}))
    (tmp_path / "adapters.safetensors").write_bytes((adapter / "adapters.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"^the adapters at {tmp_path} do not fit") as caught:
        dflash_mlx.load(target, adapter_path=tmp_path)
    assert "not an adapter parameter" in str(caught.value) and "\n" not in str(caught.value)
