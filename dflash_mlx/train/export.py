"""Write a trained drafter in our layout (with a model card) and in the published layout."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..models.checkpoint import save_draft, save_weights, write_config
from ..models.draft import DFlashDraft

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def export_converted(draft: DFlashDraft, out: Path, card: str, dtype: str = "bfloat16") -> Path:
    """Our layout (config.json, model.safetensors, README.md), cast to `dtype`."""
    draft.set_dtype(DTYPES[dtype])
    try:
        return save_draft(draft, out, card)
    finally:
        draft.set_dtype(mx.float32)


def top_tokens(records: list[dict], n: int, always: Iterable[int] = ()) -> list[int]:
    """A draft vocabulary of `n` ids: `always` plus the reply tokens seen most often.

    Replies (`ids[start:]`) are what the drafter proposes; ties go to the lower id.
    """
    counts = Counter(t for r in records for t in r["ids"][r["start"] :])
    chosen = set(always)
    for t in sorted(counts, key=lambda t: (-counts[t], t)):
        if len(chosen) >= n:
            break
        chosen.add(t)
    return sorted(chosen)


def export_published(draft: DFlashDraft, out: Path, dtype: str = "bfloat16") -> Path:
    """The z-lab layout other DFlash runtimes read: Qwen3-style config with `dflash_config`,
    bf16 `model.safetensors` under the same weight names, `torch_dtype` set.

    A draft vocabulary stays in `dflash_config`: runtimes that do not know the key
    ignore it and draft over every token, which costs speed, never output."""
    out.mkdir(parents=True, exist_ok=True)
    config = {**draft.config.to_dict(), "torch_dtype": dtype}
    config.pop("quantization", None)
    write_config(out / "config.json", config)
    weights = {k: v.astype(DTYPES[dtype]) for k, v in tree_flatten(draft.parameters())}
    save_weights(out / "model.safetensors", weights, {"format": "pt"})
    return out
