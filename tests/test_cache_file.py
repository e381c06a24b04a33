"""Prompt caches saved to a file and loaded by a later run (`dflash-mlx cache-prompt`,
`--prompt-cache-file`): the reply going on from one equals mlx-lm's greedy decoding of
the whole prompt, for every kind of cache the targets use, and a file made for another
target or drafter is refused in one line."""

import json

import pytest
import test_families
from helpers import reference_greedy
from test_cli import decode_greedy, dflash
from test_families import build, prompt_of, run

from dflash_mlx import make_prompt_cache
from dflash_mlx.cache_file import load_prompt_cache, save_prompt_cache
from dflash_mlx.chat_format import QUERY
from dflash_mlx.checkpoint import init_draft

family, tokenizer = test_families.family, test_families.tokenizer  # its fixtures, shared


def cached(model, draft, tokens_of, prompt, path):
    """Prefill `prompt` into a new cache and save it to `path`."""
    cache = make_prompt_cache(model, draft)
    run(model, draft, tokens_of, prompt, max_tokens=1, prompt_cache=cache)
    save_prompt_cache(path, cache, model, draft)


# plain KV caches, a sliding window beside them, recurrent layers beside attention
@pytest.mark.parametrize("name", ["llama", "gemma4_text", "qwen3_5"])
def test_a_reply_from_a_loaded_cache_equals_mlx_lm(family, tokenizer, name, tmp_path):
    model, draft, _ = family(name)
    document, question = prompt_of(40, seed=5), prompt_of(6, seed=6)
    cached(model, draft, tokenizer, document, tmp_path / "doc.safetensors")
    cache = load_prompt_cache(tmp_path / "doc.safetensors", model, draft)
    assert cache.tokens == document
    prompt = document + question
    assert cache.reuse(prompt) == len(document)  # only the question is prefilled
    tokens, _ = run(model, draft, tokenizer, prompt, max_tokens=40, prompt_cache=cache)
    assert tokens == reference_greedy(model, prompt, 40, set())


def test_a_cache_for_other_weights_is_refused_in_one_line(family, tokenizer, tmp_path):
    model, draft, _ = family("llama")
    path = tmp_path / "doc.safetensors"
    cached(model, draft, tokenizer, prompt_of(10, seed=1), path)
    other_model = build("llama", seed=1)
    other_draft = init_draft(model, num_layers=2, block_size=16, seed=1)
    for target, drafter, message in (
        (other_model, draft, "made for another target model"),
        (model, other_draft, "made with another drafter"),
        (model, None, "made with another drafter"),
    ):
        with pytest.raises(ValueError, match=message) as refused:
            load_prompt_cache(path, target, drafter)
        assert "\n" not in str(refused.value)
    (tmp_path / "notes.txt").write_text("not a cache")
    with pytest.raises(ValueError, match="cannot read a prompt cache"):
        load_prompt_cache(tmp_path / "notes.txt", model, draft)


def test_cache_prompt_then_generate_goes_on_from_it(make_pair, loaded, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    _, wrapper, _ = loaded("llama-tied-gqa")
    path = tmp_path / "doc.safetensors"
    document, question = "Alice has 3 apples and Bob has 5 pears.", " How many fruits?"
    made = dflash(
        f"cache-prompt --model {target} --draft {draft} --prompt-cache-file {path}", document
    )
    assert made.returncode == 0 and path.exists(), made.stderr
    assert "cached" in made.stderr.splitlines()[-1]
    out = dflash(
        f"generate --model {target} --draft {draft} --prompt-cache-file {path} --json -m 16",
        question,
    )
    assert out.returncode == 0, out.stderr
    # mlx_lm.cache_prompt's open user message, then mlx_lm.generate's suffix after <query>
    user = [{"role": "user", "content": document}]
    ids = wrapper.apply_chat_template(
        user, add_generation_prompt=False, continue_final_message=True
    )
    marked = wrapper.apply_chat_template(
        [{"role": "user", "content": QUERY}], add_generation_prompt=True, tokenize=False
    )
    suffix = question + marked[marked.index(QUERY) + len(QUERY) :]
    ids += wrapper.encode(suffix, add_special_tokens=False)
    expected, _ = decode_greedy(loaded("llama-tied-gqa")[0], wrapper, ids, 16)
    assert json.loads(out.stdout)["text"] == expected
    other, _ = make_pair("qwen3-tied-gqa")
    refused = dflash(f"generate --model {other} --no-draft --prompt-cache-file {path}", question)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"dflash-mlx generate: error: {path} was made for another target model (or another dtype)"
    ]
