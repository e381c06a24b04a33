"""mlx-lm's KV-cache options under speculative verification and rollback: `kv_bits` (the cache
quantized from `quantized_kv_start` on) and `max_kv_size` (a rotating cache keeping the first 4
positions and the last ones). Greedy DFlash output must be mlx-lm's `generate_step` output with
the same options, token for token, whatever each cycle rolls back."""

import mlx.core as mx
import pytest
from helpers import read_config, save_draft, save_target
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from test_families import NoisyOracleDraft
from test_generate import prompt_of

import dflash_mlx
from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.models.rollback import QuantizingKVCache, WindowKVCache

MAX_TOKENS = 72
STRATEGIES = {  # chains of one size, the default (chains or trees by cost), trees alone
    "block4": dict(block_size=4),
    "block16": dict(block_size=16),
    "default": dict(),
    "trees": dict(tree_budget=8),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Loaded (model, tokenizer, drafter) per family: head_dim 32, so that keys quantize in
    groups of 32, and tokenizers without EOS tokens, so that every reply runs its full length; the
    drafters are random (the tests wrap them in noisy oracles)."""
    root, loaded = tmp_path_factory.mktemp("kv-options"), {}

    def get(family: str):
        if family not in loaded:
            target = save_target(
                root / family, family, hidden=64, heads=2, kv_heads=1, layers=4, seed=11
            )
            draft = save_draft(
                root / f"{family}-draft", read_config(target), target_layer_ids=[1, 2]
            )
            model, tokenizer = dflash_mlx.load(target)
            tokenizer.eos_token_ids = set()
            loaded[family] = (model, tokenizer, dflash_mlx.load_draft(draft))
        return loaded[family]

    return get


def mlx_lm_reply(model, prompt: list[int], max_tokens: int, **options) -> list[int]:
    """mlx-lm's greedy tokens with the cache `options`."""
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, **options)
    return [int(token) for token, _ in steps]


def dflash_reply(model, draft, tokenizer, prompt, options, **settings):
    """Greedy DFlash tokens and responses, through a prompt cache made with the `options`,
    the drafter proposing mlx-lm's own reply with one token wrong at a varying place, so
    that cycles roll back every depth."""
    truth = mlx_lm_reply(model, prompt, MAX_TOKENS + 16, **options)
    oracle = NoisyOracleDraft(draft, prompt + truth)
    cache = make_prompt_cache(model, oracle, **options)
    responses = list(
        stream_generate(
            model,
            oracle,
            tokenizer,
            prompt,
            max_tokens=MAX_TOKENS,
            prompt_cache=cache,
            **options,
            **settings,
        )
    )
    return [t for r in responses for t in r.tokens], responses, truth[:MAX_TOKENS], cache


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantized_kv_cache_equals_mlx_lm(models, family, bits, strategy):
    model, tokenizer, draft = models(family)
    prompt = prompt_of(40, seed=bits)
    start = len(prompt) + (17 if bits == 4 else 6)  # inside the reply
    options = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
    tokens, responses, expected, cache = dflash_reply(
        model, draft, tokenizer, prompt, options, **STRATEGIES[strategy]
    )
    assert tokens == expected and len(tokens) == MAX_TOKENS
    assert sum(r.accepted for r in responses) > len(tokens) // 3  # drafts did verify
    assert all(isinstance(c, QuantizingKVCache) and c.quantized for c in cache.target)
    assert all(c.bits == bits for c in cache.target)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("max_kv_size", [20, 48])
def test_rotating_kv_cache_equals_mlx_lm(models, max_kv_size, strategy):
    model, tokenizer, draft = models("qwen3")  # llama's are its own (the test below)
    prompt = prompt_of(56, seed=max_kv_size)  # one prompt chunk longer than the cache
    options = dict(max_kv_size=max_kv_size)
    tokens, responses, expected, cache = dflash_reply(
        model, draft, tokenizer, prompt, options, **STRATEGIES[strategy]
    )
    assert tokens == expected and len(tokens) == MAX_TOKENS
    assert sum(r.accepted for r in responses) > len(tokens) // 3
    assert all(isinstance(c, WindowKVCache) and c.keep == 4 for c in cache.target)
    held = cache.target[0].keys.shape[2]
    assert held <= max_kv_size + 16  # the window and one block, not the whole context


def test_rotating_cache_prefilled_in_chunks_equals_mlx_lm(models):
    """mlx-lm's rotating cache masks a prompt chunk by buffer slot (its first 4 positions
    drop out of view along the chunk), unlike decoding steps: the prefill follows it."""
    model, tokenizer, draft = models("qwen3")
    prompt = prompt_of(70, seed=3)
    options = dict(max_kv_size=24)
    expected = mlx_lm_reply(model, prompt, 40, prefill_step_size=16, **options)
    responses = stream_generate(
        model,
        None,
        tokenizer,
        prompt,
        max_tokens=40,
        prefill_step_size=16,
        prompt_cache=make_prompt_cache(model, None, **options),
    )
    tokens = [t for r in responses for t in r.tokens]
    assert tokens == expected and len(tokens) == 40


@pytest.mark.parametrize(
    "options",
    [dict(kv_bits=4, kv_group_size=32, quantized_kv_start=50), dict(max_kv_size=32)],
    ids=["kv_bits", "max_kv_size"],
)
def test_stream_generate_takes_the_cache_options(models, options):
    """The keywords alone (no prompt cache given), with the random drafter, as mlx-lm's."""
    model, tokenizer, draft = models("qwen3")
    prompt = prompt_of(44, seed=9)
    expected = mlx_lm_reply(model, prompt, 40, **options)
    assert expected != mlx_lm_reply(model, prompt, 40)  # the options change the reply
    responses = stream_generate(model, draft, tokenizer, prompt, max_tokens=40, **options)
    assert [t for r in responses for t in r.tokens] == expected


def test_a_rollback_keeps_what_the_window_needs():
    """Past its size, a rotating cache rolled back into the last forward still holds the first
    4 positions and the window before the new offset (mlx-lm's overwrites them in place)."""
    cache = WindowKVCache(window=6, keep=4)
    for n in (9, 5, 5):  # positions 0..18
        keys = mx.arange(cache.offset, cache.offset + n, dtype=mx.float32).reshape(1, 1, n, 1)
        cache.update_and_fetch(keys, keys)
    cache.trim(4)  # back to 15 positions
    keys = mx.array([[[[15.0]]]])
    held, _ = cache.update_and_fetch(keys, keys)
    assert held.reshape(-1).tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15]
    assert cache.can_trim(1)  # back to 15: its window 10..14 is held
    assert not cache.can_trim(2)  # back to 14: position 9 is gone
    assert cache.can_trim(cache.offset)  # to empty


def test_max_kv_size_leaves_a_model_its_own_caches_as_mlx_lm_does(models):
    """mlx-lm's `make_prompt_cache` ignores `max_kv_size` for a model that makes its own caches
    (llama's `make_cache`), so its reply is the plain one: so is ours."""
    model, _, draft = models("llama")
    caches = make_prompt_cache(model, draft, max_kv_size=20).target
    assert [type(c) for c in caches] == [type(c) for c in mlx_lm_make_prompt_cache(model, 20)]
    assert all(type(c) is KVCache for c in caches)


def test_kv_bits_with_a_rotating_cache_is_refused_in_one_line(models):
    model, _, draft = models("qwen3")
    with pytest.raises(ValueError, match="kv_bits cannot quantize the rotating KV caches") as e:
        make_prompt_cache(model, draft, max_kv_size=64, kv_bits=4)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="max_kv_size must be more than 4"):
        make_prompt_cache(model, draft, max_kv_size=4)


@pytest.mark.parametrize(
    "options", [{"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 50}, {"max_kv_size": 20}]
)
def test_a_chat_turn_takes_the_cache_options(models, options):
    """A chat keeps its conversation's caches across turns: it makes them with the settings'
    cache options, so a turn's reply is mlx-lm's with those options."""
    from dflash_mlx.cli.chat import Chat
    from dflash_mlx.settings import GenerationSettings

    model, tokenizer, draft = models("qwen3")
    prompt = prompt_of(44, seed=9)
    settings = GenerationSettings(**options)
    chat = Chat(model, tokenizer, draft, settings, system=None, reuse=True)
    _, responses = chat.reply(prompt, max_tokens=40, fresh_cache=True)
    assert [t for r in responses for t in r.tokens] == mlx_lm_reply(model, prompt, 40, **options)
