"""llama.cpp's own reading of a llama GGUF, in numpy and plain Python.

An independent reference for the GGUF import: tensors come from the ``gguf``
package (llama.cpp's reader and dequantization), the forward pass rotates
adjacent pairs of the stored Q/K rows as ggml's "normal" RoPE does (so it never
un-permutes them), and the tokenizer is a byte-level BPE with llama.cpp's
pre-tokenizer regexes. Nothing here uses our converter, MLX or ``tokenizers``.
"""

from __future__ import annotations

import gguf
import numpy as np
import regex

# llama.cpp's llama-vocab.cpp: the regexes applied in turn for each tokenizer.ggml.pre.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_REGEXES = {"gpt-2": [GPT2_SPLIT], "smollm": [r"\p{N}", GPT2_SPLIT]}
NORMAL = 1  # llama.cpp token type; every other type is matched as a whole string


class GGUFFile:
    """A GGUF's metadata fields and its tensors dequantized to float32, by llama.cpp name."""

    def __init__(self, path) -> None:
        reader = gguf.GGUFReader(str(path))
        self.fields = {name: field.contents() for name, field in reader.fields.items()}
        self._tensors = {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors


def _linear(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x @ weight.T in x's precision, on one thread: a multithreaded BLAS call waits for a
    core that other processes keep busy (~0.1 s per product on this project's machines)."""
    return np.vecdot(x[:, None, :], weight)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rope_adjacent_pairs(x: np.ndarray, theta: float, n_rot: int) -> np.ndarray:
    """ggml's normal RoPE on x (T, H, d): (x[2i], x[2i+1]) rotated by pos * theta^(-2i/n_rot)."""
    angles = np.arange(x.shape[0])[:, None] * theta ** (-np.arange(0, n_rot, 2) / n_rot)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out = x.copy()
    out[..., 0:n_rot:2] = even * cos - odd * sin
    out[..., 1:n_rot:2] = even * sin + odd * cos
    return out


def _attention(h, w, n_head, n_kv, head_dim, theta, n_rot) -> np.ndarray:
    T = h.shape[0]
    q = _rope_adjacent_pairs(_linear(h, w["attn_q"]).reshape(T, n_head, head_dim), theta, n_rot)
    k = _rope_adjacent_pairs(_linear(h, w["attn_k"]).reshape(T, n_kv, head_dim), theta, n_rot)
    v = _linear(h, w["attn_v"]).reshape(T, n_kv, head_dim)
    k, v = (np.repeat(a, n_head // n_kv, axis=1) for a in (k, v))  # q head j reads kv j // group
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim)
    scores += np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return _linear(np.einsum("hts,shd->thd", p, v).reshape(T, -1), w["attn_output"])


def llama_logits(f: GGUFFile, sequences: list[list[int]]) -> list[np.ndarray]:
    """Float64 logits (T, vocab) of each sequence, hyperparameters from the llama.* fields.

    Layer by layer over all sequences, so that each tensor is dequantized once.
    """
    m = f.fields
    n_head = m["llama.attention.head_count"]
    n_kv = m.get("llama.attention.head_count_kv", n_head)
    head_dim = m.get("llama.attention.key_length", m["llama.embedding_length"] // n_head)
    rope = (m["llama.rope.freq_base"], m.get("llama.rope.dimension_count", head_dim))
    eps = m["llama.attention.layer_norm_rms_epsilon"]
    embed = f["token_embd.weight"]
    xs = [embed[ids].astype(np.float64) for ids in sequences]
    for i in range(m["llama.block_count"]):
        w = {k: f[f"blk.{i}.{k}.weight"].astype(np.float64) for k in (
            "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
            "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
        )}  # fmt: skip
        for n, x in enumerate(xs):
            x = x + _attention(_rms_norm(x, w["attn_norm"], eps), w, n_head, n_kv, head_dim, *rope)
            h = _rms_norm(x, w["ffn_norm"], eps)
            gate = _linear(h, w["ffn_gate"])
            up = gate / (1 + np.exp(-gate)) * _linear(h, w["ffn_up"])
            xs[n] = x + _linear(up, w["ffn_down"])
    output = f["output.weight"] if "output.weight" in f else embed  # tied embeddings
    return [_linear(_rms_norm(x, f["output_norm.weight"], eps), output) for x in xs]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


class BPETokenizer:
    """Byte-level BPE as llama.cpp's llm_tokenizer_bpe runs it, with special tokens parsed."""

    def __init__(self, f: GGUFFile) -> None:
        m = f.fields
        self.tokens = m["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {
            tuple(merge.split(" ")): r for r, merge in enumerate(m["tokenizer.ggml.merges"])
        }
        self.regexes = PRE_REGEXES[m["tokenizer.ggml.pre"]]
        self.normal = [ty == NORMAL for ty in m["tokenizer.ggml.token_type"]]
        specials = sorted((t for t, n in zip(self.tokens, self.normal) if not n), key=len)
        self.special_split = regex.compile(
            "(" + "|".join(regex.escape(t) for t in reversed(specials)) + ")"
        )
        self.byte_char = _bytes_to_unicode()
        self.char_byte = {c: b for b, c in self.byte_char.items()}
        self.bos = [m["tokenizer.ggml.bos_token_id"]] if m["tokenizer.ggml.add_bos_token"] else []

    def _words(self, text: str) -> list[str]:
        """Each regex splits every piece so far; unmatched text stays a piece (llama.cpp)."""
        pieces = [text]
        for pattern in self.regexes:
            split = []
            for piece in pieces:
                start = 0
                for match in regex.finditer(pattern, piece):
                    split += [piece[start : match.start()], match.group()]
                    start = match.end()
                split.append(piece[start:])
            pieces = [p for p in split if p]
        return pieces

    def _bpe(self, word: str) -> list[int]:
        symbols = [self.byte_char[b] for b in word.encode()]
        while len(symbols) > 1:
            pairs = [
                (self.ranks.get(p, len(self.ranks)), i)
                for i, p in enumerate(zip(symbols, symbols[1:]))
            ]
            rank, i = min(pairs)
            if rank == len(self.ranks):
                break
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return [self.ids[s] for s in symbols]

    def encode(self, text: str) -> list[int]:
        ids = list(self.bos)
        for n, part in enumerate(self.special_split.split(text)):
            if n % 2:
                ids.append(self.ids[part])
            else:
                ids += [i for word in self._words(part) for i in self._bpe(word)]
        return ids

    def decode(self, ids: list[int]) -> str:
        pieces = [
            bytes(self.char_byte[c] for c in self.tokens[i])
            if self.normal[i]
            else self.tokens[i].encode()
            for i in ids
        ]
        return b"".join(pieces).decode()
