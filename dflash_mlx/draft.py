"""The DFlash block-diffusion drafter as a plain MLX module.

A draft layer is a Qwen3-style transformer layer whose attention takes its
queries from the block (last committed token + mask tokens) and its keys and
values from two sources: the fused target context features of every committed
position (kept in a per-layer cache) and the block itself. Attention is not
causal: every block position sees the whole context and the whole block.

The drafter owns no embedding and no LM head: the caller embeds the block with
the target's embedding and applies the target's LM head to the output, so the
module knows nothing of the target's family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .kernels import block_attention

KERNEL_BACKENDS = ("auto", "metal", "reference")
REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DFlashConfig:
        """Read the published (z-lab) config or our converted one (same schema)."""
        missing = [k for k in REQUIRED_FIELDS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"drafter config.json lacks required field(s): {', '.join(missing)}")
        dflash = cfg.get("dflash_config") or {}
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
            draft_vocab = sorted({int(t) for t in draft_vocab})
            vocab_size = int(cfg["vocab_size"])
            if not draft_vocab or not 0 <= draft_vocab[0] <= draft_vocab[-1] < vocab_size:
                raise ValueError(
                    f"drafter config.json: draft_vocab must be non-empty token ids in "
                    f"[0, {vocab_size})"
                )
        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise ValueError(
                f"drafter config.json: layer_types has {len(layer_types)} entries "
                f"for {n_layers} layers"
            )
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            block_size=int(cfg.get("block_size", 16)),
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
        )

    def to_dict(self) -> dict[str, Any]:
        """The published layout's schema, with θ top-level and layer ids explicit.

        `draft_vocab` (the token ids the drafter may propose; None: all) lives in
        `dflash_config` as our extension: a runtime that does not know it ignores it
        and drafts over the whole vocabulary, which costs speed, never output.
        """
        out = {
            "architectures": ["DFlashDraftModel"],
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
        if self.draft_vocab is not None:
            out["dflash_config"]["draft_vocab"] = self.draft_vocab
        if self.quantization:
            out["quantization"] = self.quantization
        return out


@dataclass
class BlockContext:
    """A layer's context for many blocks of one sequence at once (training), in place of a cache.

    Block i is batch row i and starts at position `offsets[i]`; `keys`/`values`
    (1, kv_heads, T, head_dim) hold the context of all T positions and `mask`
    (N, 1, 1, T) says which of them each block sees (those before its anchor).
    A block always sees itself, and never another block.
    """

    keys: mx.array
    values: mx.array
    offsets: mx.array
    mask: mx.array

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
        n, _, length, _ = queries.shape
        ctx_shape = (n, *self.keys.shape[1:])
        keys = mx.concatenate([mx.broadcast_to(self.keys, ctx_shape), keys], axis=2)
        values = mx.concatenate([mx.broadcast_to(self.values, ctx_shape), values], axis=2)
        own = mx.ones((n, 1, 1, length), dtype=mx.bool_)
        mask = mx.concatenate([self.mask, own], axis=-1)
        mask = mx.broadcast_to(mask, (n, 1, length, mask.shape[-1]))
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, window: int | None, kernels: str):
        super().__init__()
        self.kernels = kernels
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = window
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

    def __call__(self, x: mx.array, cache: KVCache | BlockContext) -> mx.array:
        B, L, _ = x.shape
        offset = cache.offsets if isinstance(cache, BlockContext) else cache.offset
        queries = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset)
        keys, values = self.keys_values(x, offset)
        if isinstance(cache, BlockContext):
            out = cache.attend(queries, keys, values, self.scale)
        else:
            start = 0 if self.window is None else max(0, offset - self.window)
            ctx_keys = cache.keys[..., start:offset, :]
            ctx_values = cache.values[..., start:offset, :]
            out = block_attention(
                queries, ctx_keys, ctx_values, keys, values, self.scale, backend=self.kernels
            )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, window: int | None, kernels: str):
        super().__init__()
        self.self_attn = DraftAttention(cfg, window, kernels)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache | BlockContext) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        windows = [
            min(filter(None, (config.sliding_window, context_window)), default=None)
            if kind == "sliding_attention"
            else context_window
            for kind in config.layer_types
        ]
        self.layers = [DraftLayer(config, w, kernels) for w in windows]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(n_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def fuse(self, target_hidden: mx.array) -> mx.array:
        """The context rows: concatenated target features -> fc -> hidden_norm."""
        return self.hidden_norm(self.fc(target_hidden))

    def append_context(self, target_hidden: mx.array, cache: list[KVCache]) -> None:
        """Store K/V of newly committed positions; they depend only on the fused features."""
        context = self.fuse(target_hidden)
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(context, c.offset))

    def __call__(
        self, block_embeddings: mx.array, cache: list[KVCache] | list[BlockContext]
    ) -> mx.array:
        """Final hidden states of the block (B, L, hidden); positions follow the context."""
        h = block_embeddings
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)

    def draft_logits(
        self,
        block: mx.array,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        cache: list[KVCache],
    ) -> mx.array:
        """Logits (L - 1, vocab) for the block's mask positions, through the target's head
        (restricted to the draft vocabulary: `TargetAdapter.draft_head`)."""
        return lm_head(self(embed(block[None]), cache)[0, 1:])
