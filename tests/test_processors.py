"""Logits processors (mlx-lm's penalties and logit bias) in the speculative loop: lossless."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import mlx_lm_greedy
from mlx_lm.sample_utils import make_logits_processors
from test_generate import prompt_of, run

from dflash_mlx import make_prompt_cache

SETTINGS = {
    "repetition": dict(repetition_penalty=1.5, repetition_context_size=30),
    "presence": dict(presence_penalty=1.0),
    "frequency": dict(frequency_penalty=0.7, frequency_context_size=40),
    "bias": dict(logit_bias={11: 7.0, 57: -3.0, 120: 5.0}),
    "all": dict(
        logit_bias={11: 2.0}, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3
    ),
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_processors_keep_greedy_equal_to_mlx_lm(loaded, setting, block_size):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(40, seed=block_size)
    eos = set(tokenizer.eos_token_ids)
    plain, _ = mlx_lm_greedy(model, prompt, 48, eos)
    expected, logprobs = mlx_lm_greedy(model, prompt, 48, eos, **SETTINGS[setting])
    assert expected != plain  # the setting changes the output
    processors = make_logits_processors(**SETTINGS[setting])
    tokens, responses = run(
        model,
        draft,
        tokenizer,
        prompt,
        block_size=block_size,
        max_tokens=48,
        logits_processors=processors,
    )
    assert tokens == expected
    ours = mx.concatenate([r.logprobs for r in responses])
    np.testing.assert_allclose(np.array(ours), np.array(mx.stack(logprobs)), rtol=1e-4, atol=1e-3)


def test_processors_see_the_whole_conversation_through_the_prompt_cache(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    eos = set(tokenizer.eos_token_ids)
    settings = dict(repetition_penalty=1.4, repetition_context_size=60, presence_penalty=0.4)
    cache = make_prompt_cache(model, draft)
    first = prompt_of(20, seed=3)
    tokens, _ = run(
        model,
        draft,
        tokenizer,
        first,
        max_tokens=16,
        prompt_cache=cache,
        logits_processors=make_logits_processors(**settings),
    )
    second = first + tokens + prompt_of(5, seed=4)
    expected, _ = mlx_lm_greedy(model, second, 32, eos, **settings)
    tokens, _ = run(
        model,
        draft,
        tokenizer,
        second,
        max_tokens=32,
        prompt_cache=cache,
        block_size=8,
        logits_processors=make_logits_processors(**settings),
    )
    assert tokens == expected


def test_drafts_are_proposed_through_the_processors(loaded):
    """A bias the raw drafter ignores is followed by the processed drafts: all accepted."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    processors = make_logits_processors(logit_bias={42: 1000.0})
    tokens, responses = run(
        model,
        draft,
        tokenizer,
        prompt_of(10),
        block_size=8,
        max_tokens=33,
        logits_processors=processors,
    )
    assert tokens == [42] * 33
    assert all(r.accepted == r.proposed == 7 for r in responses[1:])
