"""The target side: loading an mlx-lm model and adapting it for speculative decoding.

`TargetAdapter` finds the layer list, embedding and LM head of an mlx-lm model,
captures the hidden states of chosen layers lazily (the layer outputs are kept
as unevaluated arrays of the same graph, so capturing costs no extra
evaluation), and makes and rolls back the target's caches.

Capture works per instance: each tapped layer object gets a subclass of its own
class whose `__call__` records the output, and gets its class back when the
capture ends. No mlx-lm class is modified.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from .checkpoint import cast_model, default_dtype, read_config, resolve_path

TARGET_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def rope_overrides(config: dict) -> dict:
    """Lift a transformers-5 nested `rope_parameters.rope_theta` to the top level.

    mlx-lm's llama reads only a top-level `rope_theta` and otherwise silently
    runs with θ=10,000 (measured on SmolLM2: logits off by 5.0).
    """
    rope = config.get("rope_parameters") or {}
    overrides = {}
    if "rope_theta" not in config and "rope_theta" in rope:
        overrides["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = rope
    return overrides


def load(
    path_or_repo: str | Path, dtype: mx.Dtype | None = None, **kwargs: Any
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm target and its tokenizer (local dir or hub id).

    `dtype` defaults to float32 on the CPU (quantized weights are dequantized:
    quantized and bf16 matmuls are not BLAS-accelerated there) and to the
    checkpoint's dtype on Metal. Extra keyword arguments go to `mlx_lm.load`.
    """
    path = resolve_path(path_or_repo, "target model", TARGET_PATTERNS)
    model_config = {**rope_overrides(read_config(path)), **kwargs.pop("model_config", {})}
    try:
        model, tokenizer = mlx_lm_load(str(path), model_config=model_config, **kwargs)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as exc:
        raise ValueError(f"mlx-lm could not load the target at {path}: {exc}") from None
    cast_model(model, dtype if dtype is not None else default_dtype())
    mx.eval(model.parameters())
    return model, tokenizer


def _find_backbone(model: nn.Module) -> nn.Module:
    """The module holding `embed_tokens` and `layers` (also inside wrappers)."""
    for path in ("model", "language_model.model", "model.language_model", ""):
        node: Any = model
        for part in filter(None, path.split(".")):
            node = getattr(node, part, None) if isinstance(node, nn.Module) else None
        if isinstance(node, nn.Module) and "embed_tokens" in node and "layers" in node:
            return node
    raise ValueError(
        f"cannot find the embedding and layer list of model type "
        f"'{getattr(model, 'model_type', type(model).__name__)}'"
    )


_CAPTURING_CLASSES: dict[type, type] = {}


def _capturing_class(cls: type) -> type:
    """A subclass of `cls` whose call records its output in the instance's sink."""
    if cls not in _CAPTURING_CLASSES:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            self._dflash_sink[self._dflash_index] = out[0] if isinstance(out, tuple) else out
            return out

        _CAPTURING_CLASSES[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _CAPTURING_CLASSES[cls]


class TargetAdapter:
    """What the speculative loop needs from an mlx-lm model, family-agnostic."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_type = getattr(model, "model_type", type(model).__name__)
        backbone = _find_backbone(model)
        self.layers = backbone.layers
        self.embed_tokens = backbone.embed_tokens
        self.lm_head = model.lm_head if "lm_head" in model else self.embed_tokens.as_linear
        args = getattr(model, "args", None)
        self.max_context = getattr(args, "max_position_embeddings", None)

    @property
    def hidden_size(self) -> int:
        embed = self.embed_tokens
        if isinstance(embed, nn.QuantizedEmbedding):
            return embed.scales.shape[-1] * embed.group_size
        return embed.weight.shape[-1]

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def make_cache(self) -> list[Any]:
        cache = make_prompt_cache(self.model)
        unsupported = {type(c).__name__ for c in cache if type(c) is not KVCache}
        if unsupported:
            raise ValueError(
                f"target model type '{self.model_type}' is not supported yet: its caches "
                f"({', '.join(sorted(unsupported))}) cannot be rolled back after a rejected "
                "draft. Supported: llama, qwen3 and other models whose layers all use a plain "
                "KVCache."
            )
        return cache

    @staticmethod
    def rollback(cache: list[Any], num_tokens: int) -> None:
        """Drop the last `num_tokens` positions (the rejected part of a verified block)."""
        if num_tokens > 0:
            for c in cache:
                c.trim(num_tokens)

    @contextmanager
    def capture(self, layer_ids: list[int]) -> Iterator[dict[int, mx.array]]:
        """Record the outputs of `layer_ids` on every forward while the context is open."""
        sink: dict[int, mx.array] = {}
        hooked = []
        try:
            for i in sorted(set(layer_ids)):
                layer = self.layers[i]
                if type(layer) in _CAPTURING_CLASSES.values():
                    raise RuntimeError(f"layer {i} is already being captured by another generation")
                original = type(layer)
                object.__setattr__(layer, "_dflash_sink", sink)
                object.__setattr__(layer, "_dflash_index", i)
                layer.__class__ = _capturing_class(original)
                hooked.append((layer, original))
            yield sink
        finally:
            for layer, original in hooked:
                layer.__class__ = original
                object.__delattr__(layer, "_dflash_sink")
                object.__delattr__(layer, "_dflash_index")
