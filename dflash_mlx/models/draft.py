"""The DFlash block-diffusion drafter (DFlash 1 and DFlash 2) as a plain MLX module.

A draft layer is a Qwen3-style transformer layer whose attention takes its
queries from the block (last committed token + mask tokens) and its keys and
values from two sources: the fused target context features of every committed
position (kept in a per-layer cache) and the block itself. Attention is not
causal by default: every block position sees the whole context and the whole block.

The drafter owns no embedding and no LM head: the caller embeds the block with
the target's embedding and applies the target's LM head to the output, so the
module knows nothing of the target's family.

DFlash 2 (`DFlash2DraftModel`) is the same backbone plus, all switched on by
config fields (a DFlash 1 config leaves them at their defaults, off):
- `GroupedDynamicConv` around every attention and MLP sublayer
  (`dflash_config.conv_kernel_size`, `conv_group_size`);
- `CandidateSelector`, which keeps the top-K tokens per block position and walks
  a path through them from the anchor token (`selector_top_k`, `selector_rank`);
- `input_embedding_scale`, `output_multiplier`, `final_logit_softcapping`;
- sliding-window layers with the reference's rule: a layer is causal inside the
  block iff config `is_causal` says so, or, when it is absent, iff the layer is
  `sliding_attention`; query i (absolute position P) sees key j iff P - j < window
  (and j - P < window when not causal).
Layout and math read from the public references: z-lab/dflash `dflash/model.py`
(`GroupedDynamicCausalConv`, `CandidateSelector`, `_attention_mask`,
`DFlash2DraftModel`) and `dflash/model_mlx.py`, its fixtures
`tests/fixtures/dflash2-config.json` and `dflash2-safetensors-header.json`, and
vLLM's `vllm/model_executor/models/qwen3_dflash2.py` (taps masked at the block start).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ..native.kernels import block_attention
from ..native.swaps import Swap
from . import backends
from .rows import RowCaches, row_caches
from .tree import Chain, Drafted, ranked_tree, search

KERNEL_BACKENDS = ("auto", "metal", "reference")
REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


class DraftHead(Protocol):
    """The head a drafter proposes through (`TargetAdapter.draft_head`): called, the
    full-vocabulary logits; `rows`, the logits of its own columns alone, column j being
    token `token_ids[j]` (`token_ids` None: every token, in order), `ids` the same ids on
    the device (both made once: a tree looks its columns up in them every cycle)."""

    token_ids: np.ndarray | None
    ids: mx.array | None

    def __call__(self, x: mx.array) -> mx.array: ...

    def rows(self, x: mx.array) -> mx.array: ...


Choose = Callable[..., tuple[mx.array, mx.array | None]]  # `Verifier.propose`
# `Verifier.tree_scores`: drafter logits (depths 1, 2, ...) and their columns' token ids
# (None: the vocabulary) -> what a tree ranks its candidates by
TreeScores = Callable[[mx.array, np.ndarray | None], mx.array]


@dataclass(frozen=True)
class DraftChain:
    """One row of a drafter forward that drafts a chain: the row's context `cache`, the
    `choose` that picks its drafts (a `Verifier.propose`), how many it wants (`length`), and
    the committed tokens up to its root (`context`, which logits processors see; None
    without them)."""

    cache: list[KVCache]
    choose: Choose
    length: int
    context: list[int] | None = None


@dataclass(frozen=True)
class DraftTree:
    """One row of a drafter forward that drafts a tree: its `root` token (shape (1,), maybe
    still on the device), its context `cache`, up to `budget` nodes, ranked by `scores` of
    the drafter's logits (None: the logits themselves), with a `chain` of known tokens grafted
    (the prompt lookup's)."""

    root: mx.array
    cache: list[KVCache]
    budget: int
    scores: TreeScores | None = None
    chain: Chain | None = None


def block_rows(roots: list[mx.array], length: int, mask: int) -> mx.array:
    """The drafter's blocks (rows, 1 + length): each root (a token (1,), maybe still on the
    device), then `length` mask tokens."""
    masks = mx.full((length,), mask, dtype=roots[0].dtype)
    return mx.stack([mx.concatenate([root, masks]) for root in roots])


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread the tapped target layers from layer 1 to num_target_layers - 3, as published."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    quantization: dict | None = None
    draft_vocab: list[int] | None = None
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def is_dflash2(self) -> bool:
        return bool(self.conv_kernel_size or self.selector_top_k)

    @property
    def slots(self) -> int:
        """The drafter's input width: DFlash's block is [anchor, masks] as wide as the verify,
        its first slot drafting nothing (a DSpark block drafts from every slot)."""
        return self.block_size

    def layer_is_causal(self, index: int) -> bool:
        """The reference's rule: config `is_causal` if given, else causal iff sliding."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[index] == "sliding_attention"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashConfig:
        """Read the published (z-lab) config or our converted one (same schema)."""
        missing = [k for k in REQUIRED_FIELDS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"drafter config.json lacks required field(s): {', '.join(missing)}")
        dflash = cfg.get("dflash_config") or {}

        def draft_value(name: str, default: Any = None) -> Any:
            """`dflash_config` first, then the top level, as the reference reads them."""
            return dflash.get(name, cfg.get(name, default))

        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        num_target_layers = cfg.get("num_target_layers")
        if layer_ids is None:
            if num_target_layers is None:
                raise ValueError(
                    "drafter config.json has neither dflash_config.target_layer_ids nor "
                    "num_target_layers: cannot tell which target layers feed the drafter"
                )
            layer_ids = default_target_layer_ids(int(num_target_layers), n_layers)
        mask_token_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_token_id is None:
            raise ValueError("drafter config.json lacks dflash_config.mask_token_id")
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        draft_vocab = dflash.get("draft_vocab", cfg.get("draft_vocab"))
        if draft_vocab is not None:
            draft_vocab = draft_vocabulary(
                draft_vocab, int(cfg["vocab_size"]), "drafter config.json: draft_vocab"
            )
        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise ValueError(
                f"drafter config.json: layer_types has {len(layer_types)} entries "
                f"for {n_layers} layers"
            )
        if "sliding_attention" in layer_types and not cfg.get("sliding_window"):
            raise ValueError(
                "drafter config.json has sliding_attention layers but no sliding_window"
            )
        dflash2 = {
            name: int(draft_value(name) or 0)
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        }
        if "DFlash2DraftModel" in (cfg.get("architectures") or []):
            absent = [f"dflash_config.{k}" for k, v in dflash2.items() if not v]
            if absent:
                raise ValueError(f"DFlash2DraftModel config.json lacks {', '.join(absent)}")
        if dflash2["conv_kernel_size"] and (
            not dflash2["conv_group_size"] or int(cfg["hidden_size"]) % dflash2["conv_group_size"]
        ):
            raise ValueError(
                f"drafter config.json: conv_group_size {dflash2['conv_group_size']} must divide "
                f"hidden_size {cfg['hidden_size']}"
            )
        if bool(dflash2["selector_top_k"]) != bool(dflash2["selector_rank"]):
            raise ValueError("drafter config.json: selector_top_k and selector_rank go together")
        softcap = draft_value("final_logit_softcapping")
        is_causal = cfg.get("is_causal")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            block_size=int(draft_value("block_size", 16)),
            target_layer_ids=[int(i) for i in layer_ids],
            mask_token_id=int(mask_token_id),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_types=list(layer_types),
            sliding_window=cfg.get("sliding_window"),
            quantization=cfg.get("quantization"),
            draft_vocab=draft_vocab,
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            **dflash2,
        )

    def to_dict(self) -> dict[str, Any]:
        """The published layout's schema, with θ top-level and layer ids explicit.

        `draft_vocab` (the token ids the drafter may propose; None: all) lives in
        `dflash_config` as our extension: a runtime that does not know it ignores it
        and drafts over the whole vocabulary, which costs speed, never output.
        """
        out = {
            "architectures": ["DFlash2DraftModel" if self.is_dflash2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": self.target_layer_ids,
                "mask_token_id": self.mask_token_id,
            },
        }
        dflash = out["dflash_config"]
        if self.is_dflash2:
            dflash["block_size"] = self.block_size
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                dflash[name] = getattr(self, name)
        for name, default in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            if getattr(self, name) != default:
                dflash[name] = getattr(self, name)
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        if self.draft_vocab is not None:
            dflash["draft_vocab"] = self.draft_vocab
        if self.quantization:
            out["quantization"] = self.quantization
        return out


def draft_vocabulary(ids: Iterable[int], vocab_size: int, where: str) -> list[int]:
    """A draft vocabulary's ids, sorted and distinct, or a one-line ValueError naming `where`
    (the config field that lists them)."""
    vocab = sorted({int(t) for t in ids})
    if not vocab or not 0 <= vocab[0] <= vocab[-1] < vocab_size:
        raise ValueError(f"{where} must be non-empty token ids in [0, {vocab_size})")
    return vocab


def key_mask(rows: mx.array, cols: mx.array, causal: bool, window: int | None) -> mx.array:
    """Which keys (absolute positions `cols`) each query (positions `rows`) sees.

    The reference's `_attention_mask`: causal keeps keys at or before the query;
    a window keeps keys less than `window` positions before the query (and, when
    not causal, less than `window` after it).
    """
    distance = rows[..., :, None] - cols[..., None, :]
    visible = distance >= 0 if causal else mx.ones(distance.shape, dtype=mx.bool_)
    if window is not None:
        visible = visible & (distance < window)
        if not causal:
            visible = visible & (-distance < window)
    return visible


@dataclass
class BlockContext:
    """A layer's context for many blocks of one sequence at once (training), in place of a cache.

    Block i is batch row i and starts at position `offsets[i]`; `keys`/`values`
    (1, kv_heads, T, head_dim) hold the context of all T positions and `mask`
    (N, 1, 1, T) says which of them each block sees (those before its anchor).
    A block always sees itself (within a causal or sliding layer's rule), and
    never another block.
    """

    keys: mx.array
    values: mx.array
    offsets: mx.array
    mask: mx.array

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        scale: float,
        causal: bool = False,
        window: int | None = None,
    ) -> mx.array:
        n, _, length, _ = queries.shape
        ctx_shape = (n, *self.keys.shape[1:])
        keys = mx.concatenate([mx.broadcast_to(self.keys, ctx_shape), keys], axis=2)
        values = mx.concatenate([mx.broadcast_to(self.values, ctx_shape), values], axis=2)
        own = mx.ones((n, 1, 1, length), dtype=mx.bool_)
        mask = mx.concatenate([self.mask, own], axis=-1)
        mask = mx.broadcast_to(mask, (n, 1, length, mask.shape[-1]))
        if causal or window is not None:
            rows = self.offsets[:, None] + mx.arange(length)
            context = mx.broadcast_to(mx.arange(self.keys.shape[2]), (n, self.keys.shape[2]))
            cols = mx.concatenate([context, rows], axis=1)
            mask = mask & key_mask(rows, cols, causal, window)[:, None]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class DraftAttention(nn.Module):
    """`window` is our per-block context bound; `sliding_window` and `causal` the checkpoint's."""

    def __init__(
        self,
        cfg: DFlashConfig,
        window: int | None,
        kernels: str,
        sliding_window: int | None = None,
        causal: bool = False,
    ):
        super().__init__()
        self.kernels = kernels
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = window
        self.sliding_window = sliding_window
        self.causal = causal
        dim, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            self.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, self.head_dim).transpose(0, 2, 1, 3)

    def keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        keys = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=offset)
        return keys, self._heads(self.v_proj(x), self.n_kv_heads)

    def __call__(self, x: mx.array, cache: KVCache | BlockContext | RowCaches) -> mx.array:
        B, L, _ = x.shape
        offset = cache.offsets if isinstance(cache, BlockContext) else cache.offset
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset)
        keys, values = self.keys_values(x, offset)
        if isinstance(cache, BlockContext):
            out = cache.attend(queries, keys, values, self.scale, self.causal, self.sliding_window)
        elif isinstance(cache, RowCaches):  # several replies' blocks, each over its own context
            out = mx.concatenate(
                [
                    self._attend_cached(
                        queries[i : i + 1], keys[i : i + 1], values[i : i + 1], c, c.offset
                    )
                    for i, c in enumerate(cache.caches)
                ]
            )
        else:
            out = self._attend_cached(queries, keys, values, cache, offset)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _attend_cached(
        self, queries: mx.array, keys: mx.array, values: mx.array, cache: KVCache, offset: int
    ) -> mx.array:
        length = queries.shape[2]
        start = 0 if self.window is None else max(0, offset - self.window)
        if self.sliding_window is not None:  # no query sees further back than this
            start = max(start, offset - self.sliding_window + 1)
        ctx_keys = cache.keys[..., start:offset, :]
        ctx_values = cache.values[..., start:offset, :]
        window_bites = (
            self.sliding_window is not None and offset + length - 1 - start >= self.sliding_window
        )
        if not (self.causal or window_bites):
            return block_attention(
                queries, ctx_keys, ctx_values, keys, values, self.scale, backend=self.kernels
            )
        rows = offset + mx.arange(length)
        mask = key_mask(
            rows, mx.concatenate([mx.arange(start, offset), rows]), self.causal, self.sliding_window
        )
        keys = mx.concatenate([ctx_keys, keys], axis=2)
        values = mx.concatenate([ctx_values, values], axis=2)
        return mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class GroupedDynamicConv(nn.Module):
    """DFlash 2's grouped dynamic depthwise convolution along the block, around a sublayer.

    `y = conv_1(f(conv_0(x)))` for the sublayer f and its (normed) input x, where
    `conv_s(z)[t] = sum_k (base_kernel[s, k] + delta_s[t, k, g]) * z[t - k]`:
    a static per-channel kernel plus a per-position, per-group correction, both
    corrections projected from x (`kernel_projection`, channel c in group c // group_size).
    Taps before the block start read zeros: each block is its own batch row.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def convolve(self, z: mx.array, delta: mx.array, side: int) -> mx.array:
        """conv_side(z) with corrections `delta` (B, L, kernel_size, groups)."""
        B, L, D = z.shape
        groups = D // self.group_size
        z = z.reshape(B, L, groups, self.group_size)
        out = None
        for tap in range(self.kernel_size):
            shifted = z if tap == 0 else mx.pad(z, [(0, 0), (tap, 0), (0, 0), (0, 0)])[:, :L]
            kernel = self.base_kernel[side, tap].reshape(groups, self.group_size)
            term = (kernel + delta[:, :, tap, :, None]) * shifted
            out = term if out is None else out + term
        return out.reshape(B, L, D)

    def __call__(self, x: mx.array, sublayer: Callable[[mx.array], mx.array]) -> mx.array:
        delta = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, -1)
        inner = sublayer(self.convolve(x, delta[:, :, 0], 0))
        return self.convolve(inner, delta[:, :, 1], 1)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int, window: int | None, kernels: str):
        super().__init__()
        sliding = cfg.layer_types[index] == "sliding_attention"
        self.self_attn = DraftAttention(
            cfg,
            window,
            kernels,
            sliding_window=cfg.sliding_window if sliding else None,
            causal=cfg.layer_is_causal(index),
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.conv_kernel_size:
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv = GroupedDynamicConv(*conv)
            self.mlp_conv = GroupedDynamicConv(*conv)

    def _sublayer(self, conv: str, f: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
        return self[conv](x, f) if conv in self else f(x)

    def __call__(self, x: mx.array, cache: KVCache | BlockContext) -> mx.array:
        attend = partial(self.self_attn, cache=cache)
        h = x + self._sublayer("attention_conv", attend, self.input_layernorm(x))
        return h + self._sublayer("mlp_conv", self.mlp, self.post_attention_layernorm(h))


class CandidateSelector(nn.Module):
    """DFlash 2's path selector over the drafter's top-K tokens at each block position.

    Candidate b at position t after token a scores `U_t(b) + <A[a] * (W h_t), B[b]>`:
    U_t the drafter's logit, A and B the predecessor and successor codebooks
    (vocab, rank), W the hidden projection (rank, hidden) and h_t the drafter's
    final hidden state. The walk starts at the anchor (the last committed token)
    and picks one candidate per position, which is the next position's predecessor.
    """

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = mx.zeros((cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(
        self, hidden: mx.array, logits: mx.array
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Each position's top-K candidates (T, K), their logits U_t (T, K), W h_t (T, rank)
        and the candidates' successor codes B[b] (T, K, rank)."""
        k = min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(logits, -k, axis=-1)[:, -k:]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        successors = self.successor_codebook[candidates]
        return candidates, unary, self.hidden_projection(hidden), successors

    def walk(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchor: mx.array,
        choose: Callable[[mx.array], tuple[mx.array, mx.array | None]],
    ) -> tuple[mx.array, mx.array | None]:
        """The path's tokens (T,) and, if `choose` returns log-probabilities over the
        candidates, log q (T, vocab): the walk's own distribution, -inf off the candidates.

        `choose` maps a position's K scores to (index, log q or None): argmax for
        greedy decoding, a sample for sampling. Nothing here syncs with the host.
        """
        candidates, unary, projected, successors = self.candidates(hidden, logits)
        token, path, logqs = anchor, [], []
        for t in range(candidates.shape[0]):
            edges = successors[t] @ (self.predecessor_codebook[token] * projected[t])
            index, logq = choose(unary[t] + edges)
            token = mx.take(candidates[t], index)
            path.append(token)
            logqs.append(logq)
        tokens = mx.stack(path)
        if not logqs or logqs[0] is None:
            return tokens, None
        full = mx.full(logits.shape, -mx.inf, dtype=logqs[0].dtype)
        return tokens, mx.put_along_axis(full, candidates, mx.stack(logqs), axis=-1)

    def edge_logprobs(
        self, hidden: mx.array, logits: mx.array, anchor: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The candidates (T, K) and, for every pair of consecutive positions' candidates,
        log-probabilities (T, K, K): entry [t, i, j] is the walk's (temperature 1)
        log-probability of candidate j at position t after candidate i at position t - 1.

        At t = 0 the predecessor is the anchor, so every row i is the same. All of it
        is one batch of products, for a draft tree to read in one sync.
        """
        candidates, unary, projected, successors = self.candidates(hidden, logits)
        first = mx.broadcast_to(anchor, (1, candidates.shape[1])).astype(candidates.dtype)
        predecessors = mx.concatenate([first, candidates[:-1]])
        context = self.predecessor_codebook[predecessors] * projected[:, None]
        scores = (unary[:, None] + context @ successors.swapaxes(1, 2)).astype(mx.float32)
        return candidates, scores - mx.logsumexp(scores, axis=-1, keepdims=True)


class DFlashDraft(nn.Module):
    """Drafter: `append_context` feeds committed target features, `__call__` drafts a block.

    `context_window` bounds the drafting cost on long contexts: the block then
    attends to the last W committed positions only (the cache still holds all).
    """

    def __init__(
        self, config: DFlashConfig, kernels: str = "auto", context_window: int | None = None
    ):
        super().__init__()
        if kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be one of {KERNEL_BACKENDS}, got {kernels!r}")
        if context_window is not None and context_window < 1:
            raise ValueError(f"context_window must be at least 1, got {context_window}")
        self.config = config
        n_features = len(config.target_layer_ids)
        self.layers = [
            DraftLayer(config, i, context_window, kernels) for i in range(config.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.selector_top_k:
            self.candidate_selector = CandidateSelector(config)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def block_swaps(self, backend: str | None) -> list[Swap]:
        """The class swaps of the drafter's graphs (its block and its context append) on
        `backend` (`backends.block_swaps`), found at the first block: graph building is on a
        cycle's critical path on a GPU, so the module tree is not walked per block (the lists
        live outside the parameter tree)."""
        found = self.__dict__.setdefault("_block_swaps", {})
        if backend not in found:
            found[backend] = backends.block_swaps(
                [*self.layers, self.norm, self.hidden_norm], backend
            )
        return found[backend]

    def building(self) -> AbstractContextManager[None]:
        """While the drafter's graph is built: its block swaps on this backend in place."""
        return backends.building(self.block_swaps(backends.current()))

    def fuse(self, target_hidden: mx.array) -> mx.array:
        """The context rows: concatenated target features -> fc -> hidden_norm."""
        return self.hidden_norm(self.fc(target_hidden))

    def append_context(
        self, features: mx.array, caches: list[list[KVCache]], counts: list[int] | None = None
    ) -> None:
        """Store the K/V of newly committed positions (they depend only on the fused
        features): row i's first `counts[i]` positions of `features` (rows, n, features), all
        of them if `counts` is None, go to `caches[i]`, in one fc and one K/V projection per
        layer for all rows (one row: its plain caches and offsets, as a lone reply's)."""
        counts = counts or [features.shape[1]] * len(caches)
        if len(caches) == 1 and counts[0] < features.shape[1]:
            features = features[:, : counts[0]]
        # rows: one array of their offsets for every layer, so one RoPE table (found by its id)
        offsets = None if len(caches) == 1 else mx.array([c[0].offset for c in caches], mx.int32)
        with self.building():  # the block's norms and RoPEs
            context = self.fuse(features)
            for layer, per_row in zip(self.layers, zip(*caches)):
                if len(per_row) == 1:
                    (cache,) = per_row
                    cache.update_and_fetch(*layer.self_attn.keys_values(context, cache.offset))
                    continue
                keys, values = layer.self_attn.keys_values(context, offsets)
                for i, (c, n) in enumerate(zip(per_row, counts)):
                    c.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])

    def __call__(
        self, block_embeddings: mx.array, cache: list[KVCache] | list[BlockContext]
    ) -> mx.array:
        """Final hidden states of the block (B, L, hidden); positions follow the context."""
        h = block_embeddings
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)

    def embed_blocks(self, embed: Callable[[mx.array], mx.array], blocks: mx.array) -> mx.array:
        """The drafter's input: the target's embedding of `blocks` times `input_embedding_scale`."""
        h = embed(blocks)
        scale = self.config.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def block_hidden(
        self, blocks: mx.array, embed: Callable[[mx.array], mx.array], caches: list[list[KVCache]]
    ) -> mx.array:
        """Final hidden states (rows, L, hidden) of `blocks` (rows, L), row i over its own
        context `caches[i]`, in one drafter forward (one row: through its plain caches)."""
        cache = caches[0] if len(caches) == 1 else row_caches(caches)
        with self.building():
            return self(self.embed_blocks(embed, blocks), cache)

    def mask_hidden(
        self, blocks: mx.array, embed: Callable[[mx.array], mx.array], caches: list[list[KVCache]]
    ) -> mx.array:
        """Final hidden states (rows, L - 1, hidden) of the blocks' mask positions."""
        return self.block_hidden(blocks, embed, caches)[:, 1:]

    def head_logits(self, hidden: mx.array, lm_head: Callable[[mx.array], mx.array]) -> mx.array:
        """`lm_head(hidden)` times `output_multiplier`, soft-capped by `final_logit_softcapping`
        (tokens outside a draft vocabulary stay at -inf)."""
        cfg = self.config
        logits = lm_head(hidden)
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        cap = cfg.final_logit_softcapping
        if cap:
            logits = mx.where(logits == -mx.inf, logits, mx.tanh(logits / cap) * cap)
        return logits

    def draft_logits(
        self,
        blocks: mx.array,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        caches: list[list[KVCache]],
    ) -> mx.array:
        """Logits (rows, L - 1, vocab) for the blocks' mask positions, through the target's
        head (restricted to the draft vocabulary: `TargetAdapter.draft_head`)."""
        return self.head_logits(self.mask_hidden(blocks, embed, caches), lm_head)

    def propose(
        self,
        blocks: mx.array,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        rows: list[DraftChain],
    ) -> list[tuple[mx.array, mx.array | None]]:
        """Each row's first `length` draft tokens after `blocks[i, 0]` (blocks: rows of
        [root, mask, ...]) and their log-probabilities, from one drafter forward, row i over
        its own context cache and proposed by its own `choose`.

        `choose` (a `Verifier.propose`) maps rows of scores to (ids, log q or None).
        DFlash 1 applies it to the logits, after the row's committed tokens `context`
        (which logits processors see); DFlash 2 to each step of the selector's walk,
        whose log q (over the candidates, not the vocabulary, so unprocessed) keeps
        speculative sampling exact.
        """
        caches = [row.cache for row in rows]
        if "candidate_selector" not in self:
            logits = self.draft_logits(blocks, embed, lm_head, caches)
            return [row.choose(logits[i, : row.length], row.context) for i, row in enumerate(rows)]
        hidden = self.mask_hidden(blocks, embed, caches)
        logits = self.head_logits(hidden, lm_head)
        walk = self.candidate_selector.walk
        return [
            walk(hidden[i, : row.length], logits[i, : row.length], blocks[i, 0], row.choose)
            for i, row in enumerate(rows)
        ]

    def trees(
        self,
        depth: int,
        embed: Callable[[mx.array], mx.array],
        head: DraftHead,
        rows: list[DraftTree],
    ) -> list[Drafted]:
        """Each row's `budget` most likely continuations of its root, up to `depth` tokens
        deep (`tree.py`), from one drafter forward, built on the device. DFlash 1 ranks each
        position's tokens apart (over the head's own columns), by the row's `scores` of its
        logits if given (the coupled rule's perturbed log q); DFlash 2 scores each token
        given the one before, as its selector walks."""
        blocks = block_rows([row.root for row in rows], depth, self.config.mask_token_id)
        caches = [row.cache for row in rows]
        if "candidate_selector" in self:
            hidden = self.mask_hidden(blocks, embed, caches)
            logits = self.head_logits(hidden, head)
            edges = self.candidate_selector.edge_logprobs
            return [
                search(
                    blocks[i, :1], *edges(hidden[i], logits[i], blocks[i, 0]), row.budget, row.chain
                )
                for i, row in enumerate(rows)
            ]
        logits = self.draft_logits(blocks, embed, head.rows, caches)
        return [rank_tree(row, logits[i], head) for i, row in enumerate(rows)]


def rank_tree(row: DraftTree, logits: mx.array, head: DraftHead) -> Drafted:
    """The tree of a head whose positions rank apart: each depth's tokens by the row's
    `scores` of its logits (depth, the head's columns), if given, else by the logits."""
    if row.scores is not None:
        logits = row.scores(logits, head.token_ids)
    return ranked_tree(row.root, logits, row.budget, head.ids, row.chain)
