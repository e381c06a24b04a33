"""Prompt caches on disk: a long prompt (a document, a system prompt) prefilled once and
reused by later runs, as `mlx_lm.cache_prompt` does, with the drafter's caches beside
the target's in one `.safetensors` file.

A cache is only right for the weights that made it, so the file names them by a
fingerprint (`fingerprint`: every weight's name, shape and dtype and a few of its
values) and `load_prompt_cache` refuses it for any other target or drafter. Each cache
is saved as its attributes (arrays, lists of arrays, numbers, strings) and restored
into a fresh cache of the same class made for the model, so every cache class the
targets use (mlx-lm's and `rollback.py`'s) round-trips without a table of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .draft import DFlashDraft
from .prompt_cache import PromptCache, make_prompt_cache

FORMAT = "dflash-mlx prompt cache 1"
SCALARS = (int, float, bool, str, type(None))


def fingerprint(module: nn.Module | None) -> str:
    """What tells one model's weights from another's, cheaply ("" for no drafter)."""
    if module is None:
        return ""
    params = tree_flatten(module.parameters())
    samples = [p.reshape(-1)[:16].astype(mx.float32) for _, p in params]
    mx.eval(samples)
    digest = hashlib.sha256()
    for (name, p), sample in zip(params, samples):
        digest.update(f"{name}{p.shape}{p.dtype}".encode())
        digest.update(np.asarray(sample).tobytes())
    return digest.hexdigest()[:32]


def _fields(cache: Any, key: str, arrays: dict[str, mx.array]) -> dict[str, list]:
    """`cache`'s attributes as JSON-able tags, its arrays added to `arrays` under `key`.
    Anything else (a rollback's snapshot of the last forward) is not state to keep."""
    fields = {}
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            arrays[f"{key}.{name}"] = value
            fields[name] = ["array"]
        elif isinstance(value, list | tuple) and all(
            v is None or isinstance(v, mx.array) for v in value
        ):
            for i, v in enumerate(value):
                if v is not None:
                    arrays[f"{key}.{name}.{i}"] = v
            fields[name] = ["arrays", [v is not None for v in value]]
        elif isinstance(value, SCALARS):
            fields[name] = ["value", value]
    return fields


def save_prompt_cache(
    path: str | Path, cache: PromptCache, model: nn.Module, draft: DFlashDraft | None
) -> None:
    """Write `cache` (made with `model` and `draft`) to `path`, atomically."""
    arrays: dict[str, mx.array] = {}
    layout = [
        {"class": type(c).__name__, "fields": _fields(c, f"{part}.{i}", arrays)}
        for part, caches in (("target", cache.target), ("draft", cache.draft))
        for i, c in enumerate(caches)
    ]
    metadata = {
        "format": FORMAT,
        "model": fingerprint(model),
        "draft": fingerprint(draft),
        "tokens": json.dumps(cache.tokens),
        "layout": json.dumps(layout),
    }
    path = Path(path)
    staged = path.with_name(f".{path.name}.partial.safetensors")
    mx.save_safetensors(str(staged), arrays, metadata)
    os.replace(staged, path)


def load_prompt_cache(path: str | Path, model: nn.Module, draft: DFlashDraft | None) -> PromptCache:
    """The prompt cache saved at `path`, or a one-line ValueError if it is not one, or was
    made for another target or drafter."""
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a prompt cache from it ({exc})") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dflash-mlx prompt cache (dflash-mlx cache-prompt)")
    if metadata["model"] != fingerprint(model):
        raise ValueError(f"{path} was made for another target model (or another dtype)")
    if metadata["draft"] != fingerprint(draft):
        made_with = "another drafter" if metadata["draft"] else "no drafter"
        raise ValueError(f"{path} was made with {made_with}: give the drafter it was made with")
    cache = make_prompt_cache(model, draft)
    caches = [*cache.target, *cache.draft]
    layout = json.loads(metadata["layout"])
    if [type(c).__name__ for c in caches] != [entry["class"] for entry in layout]:
        raise ValueError(f"{path} holds other caches than this model makes")
    keys = [f"target.{i}" for i in range(len(cache.target))]
    keys += [f"draft.{i}" for i in range(len(cache.draft))]
    for c, key, entry in zip(caches, keys, layout):
        for name, (kind, *rest) in entry["fields"].items():
            if kind == "array":
                value = arrays[f"{key}.{name}"]
            elif kind == "arrays":
                kept = rest[0]
                value = [arrays[f"{key}.{name}.{i}"] if k else None for i, k in enumerate(kept)]
            else:
                value = rest[0]
            setattr(c, name, value)
    cache.tokens = json.loads(metadata["tokens"])
    return cache
