"""Prompt caches saved to a file and loaded by a later run (`dflash-mlx cache-prompt`,
`--prompt-cache-file`): the reply going on from one equals mlx-lm's greedy decoding of
the whole prompt, for every kind of cache the targets use and with mlx-lm's cache options
(the file's own); a file made for another target or drafter, or altered in any field, is
refused in one line; a killed `cache-prompt` leaves nothing behind after the next."""

import json
import os
import subprocess
import time
from functools import partial
from itertools import takewhile

import mlx.core as mx
import pytest
import test_families
import test_kv_cache_options
from helpers import CHAT_TEMPLATE, copy_dir, reference_greedy
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from mlx_lm.utils import load_tokenizer
from test_cli import decode_greedy, detokenized, dflash, dflash_in_process
from test_families import build, prompt_of, run
from test_staging import dead_pid, staged_by
from tqdm import tqdm

from dflash_mlx import cli, make_prompt_cache
from dflash_mlx.chat_format import QUERY
from dflash_mlx.cli import cache_prompt
from dflash_mlx.cli.cache_prompt import prefill
from dflash_mlx.decode.cache_file import (
    DEFAULT_OPTIONS,
    PromptCacheError,
    digest,
    load_prompt_cache,
    save_prompt_cache,
)
from dflash_mlx.models.checkpoint import init_draft

family, tokenizer = test_families.family, test_families.tokenizer  # its fixtures, shared
models = test_kv_cache_options.models  # loaded models of head_dim 32


def cached(model, draft, tokens_of, prompt, path):
    """Prefill `prompt` into a new cache and save it to `path`."""
    cache = make_prompt_cache(model, draft)
    run(model, draft, tokens_of, prompt, max_tokens=1, prompt_cache=cache)
    save_prompt_cache(path, cache, model, draft)


# plain KV caches, a sliding window beside them, recurrent layers beside attention, a layer's
# several caches (a CacheGroup)
@pytest.mark.parametrize("name", ["llama", "gemma4_text", "qwen3_5", "glm_moe_dsa"])
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


def mlx_lm_continued(model, cached: list[int], rest: list[int], max_tokens: int, **options):
    """mlx-lm's greedy tokens for `rest` after `cached`, as `mlx_lm.cache_prompt` and then
    `mlx_lm.generate --prompt-cache-file` run them, with the cache `options`."""
    quantization = {k: v for k, v in options.items() if k != "max_kv_size"}
    cache = mlx_lm_make_prompt_cache(model, options.get("max_kv_size"))
    for _ in generate_step(
        mx.array(cached), model, max_tokens=0, prompt_cache=cache, **quantization
    ):
        pass
    steps = generate_step(
        mx.array(rest), model, max_tokens=max_tokens, prompt_cache=cache, **quantization
    )
    return [int(token) for token, _ in steps]


QUANTIZED = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=12)  # inside the document
CACHE_OPTIONS = {"kv_bits": QUANTIZED, "max_kv_size": dict(max_kv_size=20)}


@pytest.mark.parametrize("options", list(CACHE_OPTIONS.values()), ids=list(CACHE_OPTIONS))
def test_a_cache_made_with_cache_options_goes_on_with_them_as_mlx_lm(models, options, tmp_path):
    model, tokenizer, draft = models("qwen3")  # head_dim 32: keys quantize in groups of 32
    document, question = prompt_of(40, seed=5), prompt_of(6, seed=6)
    path = tmp_path / "doc.safetensors"
    save_prompt_cache(
        path, prefill(model, tokenizer, draft, document, options), model, draft, options
    )
    assert json.loads(mx.load(str(path), return_metadata=True)[1]["options"]) == {
        **DEFAULT_OPTIONS,
        **options,
    }
    cache = load_prompt_cache(path, model, draft)  # with the file's options, none given
    prompt = document + question
    assert cache.reuse(prompt) == len(document)
    tokens, _ = run(model, draft, tokenizer, prompt, max_tokens=40, prompt_cache=cache)
    assert tokens == mlx_lm_continued(model, document, question, 40, **options)


def test_a_quantized_file_is_refused_with_other_bits_or_other_options_asked(models, tmp_path):
    model, tokenizer, draft = models("qwen3")
    path = tmp_path / "doc.safetensors"
    save_prompt_cache(
        path, prefill(model, tokenizer, draft, DOCUMENT, QUANTIZED), model, draft, QUANTIZED
    )
    assert all(c.quantized for c in load_prompt_cache(path, model, draft, QUANTIZED).target)
    with pytest.raises(PromptCacheError) as refused:
        load_prompt_cache(path, model, draft, {**QUANTIZED, "kv_bits": 8})
    assert str(refused.value) == (
        f"{path} was made with kv_bits=4, not 8: leave out --kv-bits (the file's cache options "
        "are used), or make the file with it"
    )
    set_bits = partial(set_field, name="bits", tag=["value", 8])
    altered(path, path, lambda a, m, lay: set_bits(lay))
    with pytest.raises(PromptCacheError, match="target.0.bits is 8 where this model's is 4"):
        load_prompt_cache(path, model, draft)


def test_a_file_written_before_files_carried_a_digest_is_refused_with_how_to_remake_it(
    document_cache, tmp_path
):
    """Nothing proves such a file whole (its values could have changed since), so it is made
    again: the line says how."""
    model, draft, path = document_cache
    assert json.loads(mx.load(str(path), return_metadata=True)[1]["options"]) == DEFAULT_OPTIONS
    for older in ({"digest"}, {"digest", "options"}):  # the versions before, and before those
        old = tmp_path / "old.safetensors"
        altered(path, old, lambda a, m, lay, older=older: [m.pop(name) for name in older])
        with pytest.raises(PromptCacheError) as refused:
            load_prompt_cache(old, model, draft)
        assert str(refused.value) == (
            f"{old} was written by an older dflash-mlx, without the digest that proves a file "
            "whole: make it again with dflash-mlx cache-prompt"
        )


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


TEXT_DOCUMENT, TEXT_QUESTION = "Alice has 3 apples and Bob has 5 pears.", " How many fruits?"


def continued_ids(wrapper, document: str, question: str) -> tuple[list[int], list[int]]:
    """mlx_lm.cache_prompt's ids of `document` (an open user message), and mlx_lm.generate's
    of `question` going on from them (the suffix after <query>)."""
    user = [{"role": "user", "content": document}]
    ids = wrapper.apply_chat_template(
        user, add_generation_prompt=False, continue_final_message=True
    )
    marked = wrapper.apply_chat_template(
        [{"role": "user", "content": QUERY}], add_generation_prompt=True, tokenize=False
    )
    suffix = question + marked[marked.index(QUERY) + len(QUERY) :]
    return ids, wrapper.encode(suffix, add_special_tokens=False)


def refusal(argv: str, stdin: str) -> str:
    """The last line `dflash-mlx ARGV` (`stdin` its input) writes as it exits with status 1,
    run in this process: a one-line error, no traceback."""
    out = dflash_in_process(argv, stdin)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    return out.stderr.strip().splitlines()[-1]


def test_cache_prompt_then_generate_goes_on_from_it(make_pair, loaded, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    _, wrapper, _ = loaded("llama-tied-gqa")
    path = tmp_path / "doc.safetensors"
    made = dflash(
        f"cache-prompt --model {target} --draft {draft} --prompt-cache-file {path}", TEXT_DOCUMENT
    )
    assert made.returncode == 0 and path.exists(), made.stderr
    assert "cached" in made.stderr.splitlines()[-1]
    out = dflash(
        f"generate --model {target} --draft {draft} --prompt-cache-file {path} --json -m 16",
        TEXT_QUESTION,
    )
    assert out.returncode == 0, out.stderr
    cached_ids, rest = continued_ids(wrapper, TEXT_DOCUMENT, TEXT_QUESTION)
    expected, _ = decode_greedy(loaded("llama-tied-gqa")[0], wrapper, cached_ids + rest, 16)
    assert json.loads(out.stdout)["text"] == expected
    other, _ = make_pair("qwen3-tied-gqa")
    argv = f"generate --model {other} --no-draft --prompt-cache-file {path}"
    assert refusal(argv, TEXT_QUESTION) == (
        f"dflash-mlx generate: error: {path} was made for another target model (or another dtype)"
    )


def test_cache_prompt_eos_token_is_the_one_the_chat_template_renders(make_pair, tmp_path):
    """mlx-lm's `--eos-token`: the tokenizer's end of sequence, as a template naming it renders."""
    target, draft = make_pair("llama-tied-gqa")
    model = copy_dir(target, tmp_path / "eos-template")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ eos_token }}" + CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    first = {}
    for eos in ("", "<|im_end|>"):
        path = tmp_path / f"doc{len(eos)}.safetensors"
        flag = f"--eos-token '{eos}'" if eos else ""
        made = dflash_in_process(
            f"cache-prompt --model {model} --draft {draft} --prompt-cache-file {path} {flag}", "Hi"
        )
        assert made.returncode == 0, made.stderr
        first[eos] = json.loads(mx.load(str(path), return_metadata=True)[1]["tokens"])[0]
    tokenizer = load_tokenizer(model)
    assert first[""] == tokenizer.convert_tokens_to_ids("</s>")
    assert first["<|im_end|>"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


KV_FLAGS = {  # mlx-lm's cache flags, and the options they set
    "kv_bits": (
        "--kv-bits 4 --kv-group-size 32 --quantized-kv-start 8",  # inside the document
        dict(kv_bits=4, kv_group_size=32, quantized_kv_start=8),
    ),
    "max_kv_size": ("--max-kv-size 12", dict(max_kv_size=12)),
}


@pytest.mark.parametrize("case", list(KV_FLAGS))
def test_cache_prompt_takes_the_kv_cache_flags_and_generate_goes_on_with_them(
    make_pair, loaded, tmp_path, case
):
    flags, options = KV_FLAGS[case]
    target, draft = make_pair("qwen3-untied-mha")  # head_dim 32: keys quantize in groups of 32
    model, wrapper, _ = loaded("qwen3-untied-mha")
    path = tmp_path / "doc.safetensors"
    cache_file = f"--model {target} --draft {draft} --prompt-cache-file {path}"
    make = f"cache-prompt {cache_file} {flags}"
    made = dflash_in_process(make, TEXT_DOCUMENT)
    assert made.returncode == 0, made.stderr
    generate = f"generate {cache_file} --json -m 16"  # the file's options
    out = dflash_in_process(generate, TEXT_QUESTION)
    assert out.returncode == 0, out.stderr
    cached_ids, rest = continued_ids(wrapper, TEXT_DOCUMENT, TEXT_QUESTION)
    assert len(cached_ids) > 12  # quantized, or past the window, before the question
    tokens = mlx_lm_continued(model, cached_ids, rest, 16, **options)
    reply = list(takewhile(lambda t: t not in wrapper.eos_token_ids, tokens))
    assert json.loads(out.stdout)["text"] == detokenized(wrapper, reply)
    argv = f"generate {cache_file} --kv-bits 8 -m 4"
    assert refusal(argv, TEXT_QUESTION) == (
        f"dflash-mlx generate: error: {path} was made with kv_bits={options.get('kv_bits')}, "
        "not 8: leave out --kv-bits (the file's cache options are used), or make the file with it"
    )


def leftover(out, pid: int):
    """A cache file half written by a writer of `out` with process id `pid`."""
    path = staged_by(out, pid, ".safetensors")
    path.write_bytes(b"half a cache")
    return path


def altered(source, dest, change, signed: bool = True) -> None:
    """`source`'s cache with `change(arrays, metadata, layout)` applied, written to `dest`;
    `signed`: with the digest of what it then holds, as a file made to deceive would be."""
    arrays, metadata = mx.load(str(source), return_metadata=True)
    recorded = metadata["layout"]
    layout = json.loads(recorded)
    change(arrays, metadata, layout)
    if metadata.get("layout") == recorded:  # not set by `change` itself
        metadata["layout"] = json.dumps(layout)
    if signed and "digest" in metadata:
        metadata["digest"] = digest(arrays, metadata)
    mx.save_safetensors(str(dest), arrays, metadata)


def set_tokens(metadata: dict, tokens) -> None:
    metadata["tokens"] = json.dumps(tokens)


def set_option(metadata: dict, name: str, value) -> None:
    metadata["options"] = json.dumps({**json.loads(metadata["options"]), name: value})


def set_field(layout: list, name: str, tag: list) -> None:
    """Record `tag` for field `name` of every cache."""
    for entry in layout:
        entry["fields"][name] = tag


def rename(arrays: dict, old: str, new: str) -> None:
    arrays[new] = arrays.pop(old)


DOCUMENT = prompt_of(40, seed=5)
NESTED = "[" * 5000 + "]" * 5000  # deeper than Python's JSON parser follows
# What a file could hold that no cache-prompt run writes, and the words of its refusal.
ALTERED = {
    "no model field": (lambda a, m, lay: m.pop("model"), "no 'model' field"),
    "no layout field": (lambda a, m, lay: m.pop("layout"), "no 'layout' field"),
    "an unknown field": (lambda a, m, lay: m.update(note="hi"), "an unknown field 'note'"),
    "a renamed tensor": (
        lambda a, m, lay: rename(a, "target.1.keys", "target.1.key"),
        "no tensor 'target.1.keys'",
    ),
    "an unknown tensor": (
        lambda a, m, lay: a.update({"target.1.extra": mx.zeros(3)}),
        "an unknown tensor 'target.1.extra'",
    ),
    "float16 keys": (
        lambda a, m, lay: a.update({"target.1.keys": a["target.1.keys"].astype(mx.float16)}),
        "target.1.keys is float16 (1, 2, 256, 16) where this model's caches hold float32",
    ),
    "keys of fewer heads": (
        lambda a, m, lay: a.update({"target.1.keys": a["target.1.keys"][:, :1]}),
        "target.1.keys is float32 (1, 1, 256, 16)",
    ),
    "keys shorter than the offset": (
        lambda a, m, lay: a.update({"draft.0.keys": a["draft.0.keys"][..., :30, :]}),
        "draft.0.keys holds 30 of 40 positions",
    ),
    "more tokens than positions": (
        lambda a, m, lay: set_tokens(m, DOCUMENT + DOCUMENT[:21]),
        "target.0 holds 40 positions for 61 tokens",
    ),
    "a token beyond the vocabulary": (
        lambda a, m, lay: set_tokens(m, [100_000] + DOCUMENT[1:]),
        "its tokens are not all ids of this model's",
    ),
    "tokens not a list": (
        lambda a, m, lay: set_tokens(m, {"tokens": DOCUMENT}),
        "its 'tokens' field is no list of tokens",
    ),
    "tokens not JSON": (lambda a, m, lay: m.update(tokens="[1, 2"), "'tokens' field is not JSON"),
    "a negative offset": (
        lambda a, m, lay: set_field(lay, "offset", ["value", -5]),
        "target.0.offset is -5",
    ),
    "an offset in words": (
        lambda a, m, lay: set_field(lay, "offset", ["value", "40"]),
        "target.0.offset is '40', not of type int",
    ),
    "a field the cache has not": (
        lambda a, m, lay: set_field(lay, "step", ["value", 1]),
        "target.0 has a field 'step' its KVCache has not",
    ),
    "a field recorded oddly": (
        lambda a, m, lay: set_field(lay, "keys", ["array", "of floats"]),
        "the field target.0.keys is recorded as ['array', 'of floats']",
    ),
    "no keys": (lambda a, m, lay: lay[2]["fields"].pop("keys"), "target.2 has no 'keys'"),
    "kv_bits 7": (
        lambda a, m, lay: set_option(m, "kv_bits", 7),
        "its cache options: kv_bits must be one of (2, 3, 4, 5, 6, 8) (or None), got 7",
    ),
    "a group size in words": (
        lambda a, m, lay: set_option(m, "kv_group_size", "x"),
        "its cache options: kv_group_size must be one of (32, 64, 128), got 'x'",
    ),
    "an unknown option": (
        lambda a, m, lay: set_option(m, "window", 8),
        "its 'options' field does not name the options ('max_kv_size', 'kv_bits',",
    ),
    "options not JSON": (lambda a, m, lay: m.update(options="{"), "'options' field is not JSON"),
    "max_kv_size 2**62": (
        lambda a, m, lay: set_option(m, "max_kv_size", 2**62),
        "its cache options: max_kv_size must be at most 2147483647",
    ),
    "nested tokens": (
        lambda a, m, lay: m.update(tokens=NESTED),
        "its 'tokens' field is nested too deeply",
    ),
    "nested layout": (
        lambda a, m, lay: m.update(layout=json.dumps(lay)[:-1] + ", " + NESTED + "]"),
        "its 'layout' field is nested too deeply",
    ),
    "nested options": (
        lambda a, m, lay: m.update(options='{"a": ' + NESTED + "}"),
        "its 'options' field is nested too deeply",
    ),
}
# What a file changed after it was written holds that fits a cache in every other way; only its
# digest tells (unchanged: each loaded and gave another reply).
CHANGED = {
    "keys tripled": lambda a, m, lay: a.update({"target.1.keys": a["target.1.keys"] * 3}),
    "a NaN value": lambda a, m, lay: a.update(
        {"draft.0.values": a["draft.0.values"].at[..., 0].multiply(mx.nan)}
    ),
    "tokens rewritten to one id": lambda a, m, lay: set_tokens(m, [DOCUMENT[0]] * 40),
    "max_kv_size 4": lambda a, m, lay: set_option(m, "max_kv_size", 4),
    "two tensors swapped": lambda a, m, lay: a.update(
        {"target.1.keys": a["target.2.keys"], "target.2.keys": a["target.1.keys"]}
    ),
}


@pytest.fixture(scope="module")
def document_cache(family, tokenizer, tmp_path_factory):
    """(model, drafter, the file of DOCUMENT's cache) for llama."""
    model, draft, _ = family("llama")
    path = tmp_path_factory.mktemp("caches") / "doc.safetensors"
    cached(model, draft, tokenizer, DOCUMENT, path)
    return model, draft, path


@pytest.mark.parametrize("case", list(ALTERED))
def test_an_altered_file_is_refused_in_one_line(document_cache, tmp_path, case):
    model, draft, path = document_cache
    change, message = ALTERED[case]
    altered(path, tmp_path / "altered.safetensors", change)
    with pytest.raises(PromptCacheError) as refused:
        load_prompt_cache(tmp_path / "altered.safetensors", model, draft)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert str(refused.value).endswith("(make it again with dflash-mlx cache-prompt)")


@pytest.mark.parametrize("case", list(CHANGED))
def test_a_file_changed_after_it_was_written_is_refused_by_its_digest(
    document_cache, tmp_path, case
):
    model, draft, path = document_cache
    changed = tmp_path / "changed.safetensors"
    altered(path, changed, CHANGED[case], signed=False)
    with pytest.raises(PromptCacheError) as refused:
        load_prompt_cache(changed, model, draft)
    assert str(refused.value) == (
        f"{changed} is not a prompt cache as written: its contents do not match its digest "
        "(changed after it was written) (make it again with dflash-mlx cache-prompt)"
    )


def aliased(source, dest) -> None:
    """`source` with the bytes of its first tensor's place given to its second tensor too
    (the header edited as a hand could: same length, other offsets)."""
    raw = source.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    first, second = sorted((n for n in header if n != "__metadata__"), key=lambda n: n)[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    header[second]["dtype"], header[second]["shape"] = (
        header[first]["dtype"],
        header[first]["shape"],
    )
    text = json.dumps(header).encode()
    dest.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])


def test_tensors_that_share_bytes_and_what_is_no_file_are_refused_at_once(document_cache, tmp_path):
    model, draft, path = document_cache
    shared = tmp_path / "shared.safetensors"
    aliased(path, shared)
    with pytest.raises(PromptCacheError, match="share bytes") as refused:
        load_prompt_cache(shared, model, draft)
    assert "\n" not in str(refused.value)
    pipe = tmp_path / "pipe.safetensors"
    os.mkfifo(pipe)
    started = time.monotonic()
    with pytest.raises(PromptCacheError) as refused:
        load_prompt_cache(pipe, model, draft)  # with no writer: a read would wait for ever
    assert str(refused.value) == f"{pipe} is not a regular file, so no prompt cache"
    assert time.monotonic() - started < 10
    with pytest.raises(PromptCacheError, match="is not a regular file"):
        load_prompt_cache(tmp_path, model, draft)


def test_a_sliding_window_of_another_size_is_refused(family, tokenizer, tmp_path):
    model, draft, _ = family("gemma4_text")
    path = tmp_path / "doc.safetensors"
    cached(model, draft, tokenizer, DOCUMENT, path)
    altered(path, path, lambda a, m, lay: lay[0]["fields"].update(window=["value", 32]))
    with pytest.raises(PromptCacheError, match="target.0.window is 32 where this model's is 16"):
        load_prompt_cache(path, model, draft)


def test_cache_prompt_progress_moves_within_a_short_prompt(loaded, monkeypatch, capfd):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    # draw every update, however fast (tqdm reads its TQDM_* variables once, at import)
    monkeypatch.setattr(cache_prompt, "tqdm", partial(tqdm, mininterval=0, miniters=1))
    prompt = prompt_of(600, seed=3)
    assert prefill(model, tokenizer, draft, prompt).tokens == prompt
    drawn = capfd.readouterr().err
    assert all(f" {n}/600 " in drawn for n in (0, 256, 512, 600)), drawn


def test_cache_prompt_writes_the_name_given_and_what_a_killed_run_left_goes(make_pair, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    path = tmp_path / "doc.cache"  # mlx would append .safetensors to a staged name without it
    killed = leftover(path, dead_pid())
    writing = leftover(path, os.getpid())  # a live process's, left alone
    made = dflash(f"cache-prompt --model {target} --draft {draft} --prompt-cache-file {path}", "Hi")
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["doc.cache", writing.name])
    assert not killed.exists()
    generate = f"generate --model {target} --draft {draft} --prompt-cache-file {path} -m 4"
    out = dflash_in_process(generate, "?")
    assert out.returncode == 0, out.stderr


def test_generate_and_serve_refuse_an_altered_file_at_startup(make_pair, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    path = tmp_path / "doc.safetensors"
    models = f"--model {target} --draft {draft}"
    cli.main(["cache-prompt", *models.split(), "--prompt-cache-file", str(path), "-p", "Hi"])

    def bad_file(case: str):
        bad = tmp_path / f"{case.replace(' ', '-')}.safetensors"
        altered(path, bad, ALTERED[case][0])
        return bad, f"{bad} is not a prompt cache", ALTERED[case][1]

    for case in ("no model field", "float16 keys", "nested tokens", "nested layout"):
        bad, refused, message = bad_file(case)
        argv = f"generate -m 4 {models} --prompt-cache-file {bad}"
        error = refusal(argv, "?")  # after the line saying what loads
        assert error.startswith(f"dflash-mlx generate: error: {refused}") and message in error
    changed = tmp_path / "changed.safetensors"
    altered(path, changed, CHANGED["keys tripled"], signed=False)
    error = refusal(f"generate -m 4 {models} --prompt-cache-file {changed}", "?")
    assert error.endswith(
        "its contents do not match its digest (changed after it was written) "
        "(make it again with dflash-mlx cache-prompt)"
    )
    pipe = tmp_path / "pipe.safetensors"
    os.mkfifo(pipe)
    error = refusal(f"generate -m 4 {models} --prompt-cache-file {pipe}", "?")
    assert error == f"dflash-mlx generate: error: {pipe} is not a regular file, so no prompt cache"
    bad, refused, message = bad_file("a negative offset")
    try:  # a child: a server that took the file would not return
        out = dflash(f"serve --port 0 {models} --prompt-cache-file {bad}", "?")
    except subprocess.TimeoutExpired:
        pytest.fail("serve took a negative offset and started")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert error.startswith(f"dflash-mlx serve: error: {refused}") and message in error
