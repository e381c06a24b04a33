"""Drafter checkpoints: both layouts, conversion, and clear errors for bad input."""

import errno
import http.server
import json
import os
import shlex
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import copy_dir, cpu_default, read_config, save_draft, save_target
from mlx.utils import tree_flatten
from test_cli import dflash_in_process

from dflash_mlx import cli, load_draft, stream_generate
from dflash_mlx.cli.convert import convert_draft
from dflash_mlx.models.draft import DFlashConfig, default_target_layer_ids


def drafts_for(draft, model, contexts, blocks):
    """Greedy drafts of `draft` for each (context features, block) pair, from a fresh cache."""
    from dflash_mlx.models.target import TargetAdapter

    target = TargetAdapter(model)
    out = []
    for features, block in zip(contexts, blocks):
        cache = draft.make_cache()
        draft.append_context(features, [cache])
        logits = draft.draft_logits(block[None], target.embed_tokens, target.lm_head, [cache])[0]
        out.append(mx.argmax(logits, axis=-1))
    return np.array(mx.stack(out))


@pytest.fixture(scope="module")
def published(make_pair, loaded):
    target, draft_dir = make_pair("llama-tied-gqa")
    model, _, draft = loaded("llama-tied-gqa")
    rng = np.random.default_rng(0)
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    contexts = [mx.array(rng.normal(size=(1, n, width)).astype(np.float32)) for n in (3, 20, 50)]
    mask = draft.config.mask_token_id
    blocks = [mx.array([int(rng.integers(4, 300))] + [mask] * 15) for _ in contexts] * 3
    contexts = contexts * 3
    return target, draft_dir, model, draft, contexts, blocks


def test_target_layer_ids_default_as_published():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    cfg = read_config_dict(num_target_layers=36, layers=5)
    assert DFlashConfig.from_dict(cfg).target_layer_ids == [1, 9, 17, 25, 33]


def read_config_dict(num_target_layers: int, layers: int) -> dict:
    return {
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 320,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": 319},
    }


def test_config_fields_exposed(loaded):
    _, _, draft = loaded("llama-tied-gqa")
    assert draft.config.block_size == 16
    assert draft.config.target_layer_ids == [1, 3]
    assert draft.config.mask_token_id == draft.config.vocab_size - 1


def test_sharded_nested_rope_layout_loads_identically(published, workdir):
    target, draft_dir, model, draft, contexts, blocks = published
    cfg = read_config(target)
    other = save_draft(
        workdir / "sharded-draft", cfg, target_layer_ids=[1, 3], shards=3, nested_rope=True
    )
    sharded = load_draft(other)
    assert sharded.config.rope_theta == draft.config.rope_theta == 1e6
    for (name, a), (_, b) in zip(
        tree_flatten(draft.parameters()), tree_flatten(sharded.parameters())
    ):
        assert mx.array_equal(a, b), name
    assert np.array_equal(
        drafts_for(draft, model, contexts, blocks), drafts_for(sharded, model, contexts, blocks)
    )


@cpu_default
def test_loaded_in_float32_on_cpu(published):
    draft = published[3]
    assert {p.dtype for _, p in tree_flatten(draft.parameters())} == {mx.float32}


def test_converted_float32_drafts_identically(published, workdir):
    _, draft_dir, model, draft, contexts, blocks = published
    out = convert_draft(draft_dir, workdir / "conv-f32", dtype="float32")
    converted = load_draft(out)
    assert (out / "README.md").exists()
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 1e6
    assert np.array_equal(
        drafts_for(draft, model, contexts, blocks), drafts_for(converted, model, contexts, blocks)
    )


# Measured on these tiny random drafters (flat logits, so argmax flips easily): 8-bit 0.93,
# 4-bit 0.69 of 135 draft positions agree with the unquantized drafter.
@pytest.mark.parametrize("bits,min_agreement", [(8, 0.9), (4, 0.6)])
def test_quantized_drafts_mostly_agree(published, workdir, bits, min_agreement):
    _, draft_dir, model, draft, contexts, blocks = published
    out = convert_draft(draft_dir, workdir / f"conv-q{bits}", q_bits=bits, q_group_size=32)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == bits
    stored = mx.load(str(out / "model.safetensors"))
    for name, w in tree_flatten(draft.parameters()):
        if name.endswith("proj.weight"):  # every attention and MLP matrix, packed
            packed = stored[name]
            assert packed.dtype == mx.uint32 and packed.shape[-1] * 32 // bits == w.shape[-1]
            assert f"{name.removesuffix('weight')}scales" in stored
    converted = load_draft(out)
    reference = drafts_for(draft, model, contexts, blocks)
    agreement = (reference == drafts_for(converted, model, contexts, blocks)).mean()
    assert agreement >= min_agreement, agreement


@cpu_default
def test_quantized_drafter_is_dequantized_on_cpu(published, workdir):
    import mlx.nn as nn

    out = convert_draft(published[1], workdir / "conv-keep", q_bits=4, q_group_size=32)
    model = load_draft(out)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.float32}
    # The values are the 4-bit ones: near the originals, not equal to them.
    original = dict(tree_flatten(published[3].parameters()))
    for name, w in tree_flatten(model.parameters()):
        if name.endswith("proj.weight"):
            error = mx.abs(w - original[name]).max().item()
            assert 0 < error < 0.2 * mx.abs(original[name]).max().item(), name


def test_convert_cli_in_subprocess(published, workdir):
    out = workdir / "cli-conv"
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_mlx", "convert", str(published[1]), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert load_draft(out).config.target_layer_ids == [1, 3]
    proc = convert_cli(workdir / "nope", "--out", out)
    assert proc.returncode == 1
    assert "drafter directory not found" in proc.stderr and "Traceback" not in proc.stderr


def convert_cli(*args) -> subprocess.CompletedProcess:
    """`dflash-mlx convert ARGS`, run in this process (`test_convert_cli_in_subprocess` runs
    the command as a child)."""
    return dflash_in_process(shlex.join(["convert", *map(str, args)]))


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The stderr of a failed `dflash-mlx convert`, checked to be its one-line error."""
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("dflash-mlx convert: error: "), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


def test_convert_refuses_a_non_empty_out_unless_forced(published, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00002-of-00002.safetensors").write_bytes(b"an older conversion's shard")
    err = one_line_error(convert_cli(published[1], "--out", out))
    assert f"{out} is not empty: pass --force to replace it" in err
    assert [p.name for p in out.iterdir()] == ["model-00002-of-00002.safetensors"]

    proc = convert_cli(published[1], "--out", out, "--force")
    assert proc.returncode == 0, proc.stderr
    files = ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == files
    assert load_draft(out).config.target_layer_ids == [1, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing staged is left


def unwritable_dir(tmp_path):
    """A directory this process cannot write in (not as root, who writes anywhere)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.access(locked, os.W_OK):
        pytest.skip("a read-only directory is writable to this user (root)")
    return locked


@pytest.mark.parametrize(
    "where, message",
    [
        (lambda tmp_path: tmp_path / "file", "{out}: {out} is a file"),
        (lambda tmp_path: tmp_path / "file" / "out", "{out}: {file} is a file"),
        (lambda tmp_path: unwritable_dir(tmp_path) / "out", "{out}: Permission denied"),
    ],
    ids=["out-is-a-file", "out-under-a-file", "read-only-directory"],
)
def test_convert_to_an_unwritable_out_is_a_one_line_error(published, tmp_path, where, message):
    (tmp_path / "file").write_text("not a directory")
    out = where(tmp_path)
    err = one_line_error(convert_cli(published[1], "--out", out))
    assert message.format(out=out, file=tmp_path / "file") in err
    assert (tmp_path / "file").read_text() == "not a directory"
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # nothing staged


def failing_save(error: Exception):
    """`mx.save_safetensors` on a disk that fills up halfway through the file."""
    save = mx.save_safetensors

    def fake(path, arrays, metadata=None):
        save(path, arrays, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise error

    return fake


DISK_FULL = [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[write] Unable to write 2951520 bytes to file."),  # what MLX 0.32 raises
]


@pytest.mark.parametrize("error", DISK_FULL, ids=["oserror", "mlx-runtime-error"])
def test_a_failed_convert_leaves_the_previous_one_and_no_partial_output(
    published, tmp_path, monkeypatch, capsys, error
):
    good = convert_draft(published[1], tmp_path / "out", dtype="float32")
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    monkeypatch.setattr(mx, "save_safetensors", failing_save(error))
    for out, flags in [(good, ["--force"]), (tmp_path / "new", [])]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["convert", str(published[1]), "--out", str(out), *flags])
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith(f"dflash-mlx convert: error: cannot write {out}: ") and (
            err.count("\n") == 1
        ), err
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_tensor_in_two_weight_files_is_refused(published, tmp_path):
    stale = copy_dir(published[1], tmp_path / "stale-shard")
    weights = mx.load(str(stale / "model.safetensors"))
    name = sorted(weights)[0]
    mx.save_safetensors(str(stale / "old.safetensors"), {name: weights[name]})
    with pytest.raises(ValueError) as e:
        load_draft(stale)
    assert str(e.value) == (
        f"tensor {name} is in both model.safetensors and old.safetensors in {stale}: "
        "remove the stale file"
    )


# --- bad input -------------------------------------------------------------------------


def test_missing_directory_and_offline_hub(workdir):
    with pytest.raises(FileNotFoundError, match="directory not found"):
        load_draft(workdir / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="offline"):
        load_draft("z-lab/definitely-not-a-real-drafter-xyz")


class FakeHub(http.server.BaseHTTPRequestHandler):
    """A hub endpoint answering every request with the server's `answer` (status, headers, body)."""

    def do_GET(self):
        status, headers, body = self.server.answer
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/json"}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "status, headers, body, error, message",
    [
        (404, {"X-Error-Code": "RepoNotFound"}, {}, FileNotFoundError, "not found.*HTTP 404"),
        (401, {"X-Error-Code": "RepoNotFound"}, {}, FileNotFoundError, "HTTP 401.*private"),
        (403, {"X-Error-Code": "GatedRepo"}, {}, PermissionError, "is a gated repository"),
        (
            401,
            {},
            {"error": "Invalid credentials in Authorization header"},
            PermissionError,
            "refused access to drafter 'org/model' \\(HTTP 401.*check your token",
        ),
    ],
)
def test_hub_errors_are_reported_as_what_they_are(
    monkeypatch, tmp_path, status, headers, body, error, message
):
    from huggingface_hub import constants

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    hub.answer = (status, headers, body)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{hub.server_address[1]}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_unused")
    try:
        with pytest.raises(error, match=message) as e:
            load_draft("org/model")
    finally:
        hub.shutdown()
    assert "offline" not in str(e.value) and e.value.__cause__ is not None


def test_missing_config_and_weights(workdir, published):
    empty = workdir / "empty-draft"
    empty.mkdir(exist_ok=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_draft(empty)
    (empty / "config.json").write_text((published[1] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_draft(empty)


def test_corrupted_files(workdir, published):
    bad = workdir / "corrupt-draft"
    bad.mkdir(exist_ok=True)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_draft(bad)
    (bad / "config.json").write_text((published[1] / "config.json").read_text())
    data = (published[1] / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read weights"):
        load_draft(bad)


def test_config_missing_fields(workdir, published):
    cfg = read_config(published[1])
    for field, message in [
        ("hidden_size", "hidden_size"),
        ("dflash_config", "mask_token_id"),
    ]:
        broken = dict(cfg)
        del broken[field]
        if field == "dflash_config":
            broken["dflash_config"] = {"target_layer_ids": [1, 3]}
        with pytest.raises(ValueError, match=message):
            DFlashConfig.from_dict(broken)
    no_ids = {k: v for k, v in cfg.items() if k != "num_target_layers"}
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_dict(no_ids | {"dflash_config": {"mask_token_id": 3}})


def test_weights_not_matching_config(workdir, published):
    cfg = read_config(published[0])
    other = save_draft(workdir / "three-feature-draft", cfg, target_layer_ids=[1, 2, 3])
    config = read_config(other)
    config["dflash_config"]["target_layer_ids"] = [1, 3]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="fc.weight"):
        load_draft(other)


def expect_generation_error(model, tokenizer, draft, match, **kwargs):
    kwargs.setdefault("prompt", [5, 6, 7])
    prompt = kwargs.pop("prompt")
    with pytest.raises(ValueError, match=match):
        next(iter(stream_generate(model, draft, tokenizer, prompt, **kwargs)))


def test_mismatched_drafter_and_target(workdir, loaded):
    model, tokenizer, _ = loaded("llama-tied-gqa")
    wide = save_target(workdir / "wide-target", hidden=96, heads=4, kv_heads=2)
    wide_draft = load_draft(save_draft(workdir / "wide-draft", read_config(wide), layers=2))
    expect_generation_error(model, tokenizer, wide_draft, r"hidden size 96 \(the target's: 64\)")

    cfg = read_config(workdir / "llama-tied-gqa")
    deep = load_draft(save_draft(workdir / "deep-draft", cfg, target_layer_ids=[1, 9]))
    expect_generation_error(model, tokenizer, deep, r"reads layer 9 \(the target has 6\)$")

    vocab = load_draft(
        save_draft(workdir / "vocab-draft", cfg | {"vocab_size": 999}, target_layer_ids=[1, 3])
    )
    expect_generation_error(model, tokenizer, vocab, r"vocabulary 999 \(the target's: \d+\)$")

    path = save_draft(workdir / "mask-draft", cfg, target_layer_ids=[1, 3])
    config = read_config(path)
    config["dflash_config"]["mask_token_id"] = 5000
    (path / "config.json").write_text(json.dumps(config))
    expect_generation_error(model, tokenizer, load_draft(path), "mask_token_id 5000")


def test_bad_generation_arguments(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    expect_generation_error(model, tokenizer, draft, "max_tokens must be positive", max_tokens=0)
    expect_generation_error(model, tokenizer, draft, "max_tokens must be positive", max_tokens=-3)
    expect_generation_error(model, tokenizer, draft, "empty", prompt="")
    expect_generation_error(model, tokenizer, draft, "empty", prompt=[])
    expect_generation_error(model, tokenizer, draft, "block_size", block_size=0)
    expect_generation_error(model, tokenizer, draft, "only integers", prompt=[1.5])
    expect_generation_error(model, tokenizer, draft, "outside", prompt=[10**6])
    expect_generation_error(model, tokenizer, draft, "context holds 4096", prompt=[5] * 4096)


def test_kernels_option_validated(published):
    with pytest.raises(ValueError, match="kernels must be one of"):
        load_draft(published[1], kernels="cuda")


def test_context_window_attends_to_the_last_positions_only(published):
    """RoPE scores depend on relative positions only, so a windowed drafter over S positions
    must draft like an unwindowed one given just the last W of them."""
    _, draft_dir, model, draft, _, _ = published
    from dflash_mlx.models.target import TargetAdapter

    target = TargetAdapter(model)
    windowed = load_draft(draft_dir, context_window=8)
    rng = np.random.default_rng(3)
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    features = mx.array(rng.normal(size=(1, 30, width)).astype(np.float32))
    block = mx.array([7] + [draft.config.mask_token_id] * 15)

    def logits(drafter, context):
        cache = drafter.make_cache()
        drafter.append_context(context, [cache])
        return drafter.draft_logits(block[None], target.embed_tokens, target.lm_head, [cache])[0]

    assert mx.allclose(logits(windowed, features), logits(draft, features[:, -8:]), atol=1e-4)
    assert not mx.allclose(logits(draft, features), logits(draft, features[:, -8:]), atol=1e-2)
    with pytest.raises(ValueError, match="context_window"):
        load_draft(draft_dir, context_window=-1)
