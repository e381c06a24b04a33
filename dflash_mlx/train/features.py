"""Cache the target's hidden states of the tapped layers for every training sequence.

One target forward per batch of sequences of similar length, right-padded (the
target is causal, so padding after a sequence cannot change its positions).
Features are stored fp16, one safetensors file per chunk of records, so a run
resumes at the first missing chunk and epochs never recompute the target.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..models.target import TargetAdapter


def sequence_features(
    model: nn.Module,
    sequences: list[list[int]],
    layer_ids: list[int],
    batch_size: int = 8,
    top_k: int = 8,
) -> list[dict[str, mx.array]]:
    """Per sequence: "features" (T, len(layer_ids) * hidden) fp16, the target's own
    next-token distribution at every position as its `top_k` ids and log-probs (soft labels),
    and "last_hidden" (T, hidden) fp16, the final-normed hidden state the LM head reads (its
    whole next-token distribution, which DSpark's loss compares the drafter's with)."""
    target = TargetAdapter(model)
    last = len(target.layers) - 1
    norm = getattr(target.backbone, "norm", None)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[dict[str, mx.array]] = [{} for _ in sequences]
    taps = [*layer_ids, last]  # the drafter's layers, then the last one's output
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(sequences[i]) for i in idx)
        ids = mx.array([sequences[i] + [0] * (width - len(sequences[i])) for i in idx])
        forward = target.forward(ids, None, taps=taps, prompt=True)
        logits, hidden = forward.logits, forward.features.shape[-1] // len(taps)
        feats = forward.features[..., : len(layer_ids) * hidden].astype(mx.float16)
        # partitioning at the high end avoids negating the (B, T, vocab) logits, a copy as large
        top_ids = mx.argpartition(logits, -top_k, axis=-1)[..., -top_k:]
        top = mx.take_along_axis(logits, top_ids, axis=-1)
        top_logp = (top - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float16)
        final = None if norm is None else norm(forward.features[..., -hidden:]).astype(mx.float16)
        mx.eval(feats, top_ids, top_logp, final)
        for row, i in enumerate(idx):
            n = len(sequences[i])
            out[i] = {
                "features": feats[row, :n],
                "top_ids": top_ids[row, :n].astype(mx.int32),
                "top_logp": top_logp[row, :n],
            }
            if final is not None:
                out[i]["last_hidden"] = final[row, :n]
    return out


def chunk_path(feature_dir: Path, chunk: int) -> Path:
    return feature_dir / f"features-{chunk:05d}.safetensors"


def cache_features(
    model: nn.Module,
    records: list[dict],
    feature_dir: Path,
    layer_ids: list[int],
    chunk_size: int = 64,
    batch_size: int = 8,
) -> int:
    """Write the features of `records` (full chunks only, so later records extend the cache).

    Returns the number of records covered. The tapped layers are recorded in
    meta.json; a cache made for other layers is refused.
    """
    feature_dir.mkdir(parents=True, exist_ok=True)
    meta = feature_dir / "meta.json"
    if meta.exists():
        stored = json.loads(meta.read_text())["target_layer_ids"]
        if stored != list(layer_ids):
            raise ValueError(f"{feature_dir} holds features of layers {stored}, not {layer_ids}")
    else:
        meta.write_text(json.dumps({"target_layer_ids": list(layer_ids)}) + "\n")
    n_chunks = len(records) // chunk_size
    for chunk in range(n_chunks):
        path = chunk_path(feature_dir, chunk)
        if path.exists():
            continue
        tic = time.perf_counter()
        part = records[chunk * chunk_size : (chunk + 1) * chunk_size]
        feats = sequence_features(model, [r["ids"] for r in part], layer_ids, batch_size)
        tmp = path.with_suffix(".tmp.safetensors")
        arrays = {f"{i}.{k}": v for i, f in enumerate(feats) for k, v in f.items()}
        mx.save_safetensors(str(tmp), arrays)
        tmp.rename(path)
        tokens = sum(len(r["ids"]) for r in part)
        dt = time.perf_counter() - tic
        print(f"chunk {chunk}: {tokens} tokens in {dt:.1f} s ({tokens / dt:.0f} tok/s)", flush=True)
    return n_chunks * chunk_size


def cached_records(feature_dir: Path, n_records: int, chunk_size: int = 64) -> int:
    """How many of the first `n_records` records have features cached (whole chunks)."""
    chunks = 0
    while chunks < n_records // chunk_size and chunk_path(feature_dir, chunks).exists():
        chunks += 1
    return chunks * chunk_size


def load_features(
    feature_dir: Path, n_records: int, chunk_size: int = 64
) -> list[dict[str, mx.array]]:
    """The cached arrays ("features", "top_ids", "top_logp") of the first `n_records` records."""
    out: list[dict[str, mx.array]] = []
    for chunk in range(n_records // chunk_size):
        stored = mx.load(str(chunk_path(feature_dir, chunk)))
        for i in range(chunk_size):
            prefix = f"{i}."
            out.append({k[len(prefix) :]: v for k, v in stored.items() if k.startswith(prefix)})
    return out
