"""How predictable is the target's greedy output, and where does the drafter miss?

    python benchmarks/predictability.py [--draft DIR] [--max-tokens 128] [--limit N] [--out r.json]

The acceptance length a drafter can reach is bounded by how sure the target
itself is: where its own top-1 probability is 0.55, the greedy token hangs on
details of a 30-layer forward that a 2-layer drafter does not compute. For the
bench prompts (mlx-lm's batched greedy replies, as many tokens as the bench) it
prints, per category:

- the target's top-1 probability on its own reply tokens (mean, share > 0.9);
- "τ if right where p ≥ θ": the acceptance length of a hypothetical drafter that
  proposes the target's token exactly where the target's top-1 probability is at
  least θ and misses elsewhere;
- the drafter's real acceptance (block forward over the target's features from an
  anchor at every reply position, which equals decoding's acceptance: see
  `tests/test_train.py`) and its k = 1 hit rate per band of the target's p.

τ is given along the decoding walk (tokens / cycles, as the bench counts it) and,
for the drafter, also as the mean over all anchors, which is higher: a long easy
run is one cycle in decoding but many anchors in the mean (the trainer's
validation reports both; it once reported only the mean over anchors).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on
import mlx.core as mx
import numpy as np

from dflash_mlx import load, load_draft
from dflash_mlx.cli.bench import load_prompts
from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.train.data import generate_replies
from dflash_mlx.train.features import sequence_features
from dflash_mlx.train.trainer import Sequence, TrainConfig, Trainer, decode_walk

ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "dflash_mlx" / "drafters" / "smollm2-135m-instruct"
THRESHOLDS = (0.95, 0.9, 0.8, 0.7, 0.5)
BANDS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


def greedy_confidence(record: dict, feats: dict) -> np.ndarray:
    """p_target(reply token t | prefix) for every reply token (greedy, so the top-1 probability)."""
    ids, start = record["ids"], record["start"]
    top_ids, top_logp = np.array(feats["top_ids"]), np.array(feats["top_logp"], dtype=np.float32)
    p = np.zeros(len(ids) - start)
    for t in range(start, len(ids)):
        hit = top_ids[t - 1] == ids[t]
        p[t - start] = np.exp(top_logp[t - 1][hit][0]) if hit.any() else 0.0
    return p


def accepted_if_right_where(right: np.ndarray, block_size: int) -> np.ndarray:
    """Drafts accepted from every anchor when exactly the `right` reply tokens are drafted well.

    Anchor a is reply token a (the last committed one); the block drafts tokens a+1.. a+B-1.
    """
    out = []
    for a in range(len(right) - 1):
        run = right[a + 1 : a + block_size]
        out.append(np.argmin(run) if not run.all() else len(run))
    return np.array(out)


def walk_tau(walks: list[tuple[int, int]]) -> float:
    tokens, cycles = np.sum(walks, axis=0)
    return round(float(tokens / cycles), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=str(DRAFTER))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="first N bench prompts")
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()

    model, tokenizer = load(smollm2_model_dir())
    draft = load_draft(args.draft, dtype=mx.float32)
    block_size = draft.config.block_size
    prompts = load_prompts()[: args.limit]
    records = sorted(
        generate_replies(model, tokenizer, prompts, args.max_tokens, batch_size=len(prompts)),
        key=lambda r: r["id"],
    )
    feats = sequence_features(model, [r["ids"] for r in records], draft.config.target_layer_ids)
    vocab = None if draft.config.draft_vocab is None else np.array(sorted(draft.config.draft_vocab))
    trainer = Trainer(model, draft, TrainConfig(), vocab)

    by_cat: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for record, f in zip(records, feats):
        p = greedy_confidence(record, f)
        seq = Sequence(np.array(record["ids"]), record["start"], **f)
        _, hits, _, accepted = trainer.every_anchor(seq)
        for cat in (record["category"], "all"):
            d = by_cat[cat]
            d["p"].append(p)
            d["draft_accepted"].append(accepted)
            d["draft_walk"].append(decode_walk(accepted))
            d["k1_hit"].append(hits[:, 0])
            d["k1_p"].append(p[1:])
            for th in THRESHOLDS:
                d[f"walk_if_{th}"].append(decode_walk(accepted_if_right_where(p >= th, block_size)))

    results = {"draft": args.draft, "max_tokens": args.max_tokens, "categories": {}}
    for cat, d in by_cat.items():
        p, k1_hit, k1_p = (np.concatenate(d[k]) for k in ("p", "k1_hit", "k1_p"))
        bands = {}
        for lo, hi in zip(BANDS, BANDS[1:]):
            inside = (k1_p >= lo) & (k1_p < hi)
            bands[f"{lo:.1f}-{min(hi, 1.0):.1f}"] = {
                "share": round(float(inside.mean()), 3),
                "draft_k1_hit": round(float(k1_hit[inside].mean()), 3) if inside.any() else None,
            }
        results["categories"][cat] = {
            "reply_tokens": int(len(p)),
            "target_p_mean": round(float(p.mean()), 3),
            "target_p_gt_0.9": round(float((p > 0.9).mean()), 3),
            "tau_if_right_where_p_ge": {str(th): walk_tau(d[f"walk_if_{th}"]) for th in THRESHOLDS},
            "draft_tau": walk_tau(d["draft_walk"]),
            "draft_tau_mean_over_anchors": round(
                float(1 + np.concatenate(d["draft_accepted"]).mean()), 2
            ),
            "draft_k1_hit": round(float(k1_hit.mean()), 3),
            "k1_by_target_p": bands,
        }
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
