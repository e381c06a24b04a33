"""Cheaper signal for a drafter, measured: the target's greedy path through text it did not write
(one forward per window, no decoding) against more of its own greedy replies, each fine-tuning
the shipped SmolLM2 drafter for the same number of steps.

    python benchmarks/text_signal.py --work ~/.cache/dflash-mlx/text-signal

1. replies: SmolLM2's greedy replies to the training pool's prompts 3600 on (the shipped
   drafter was trained on earlier ones): the first `--val` are the validation set V, the next
   `--replies` arm A's data. Their generation's CPU time is A's data cost.
2. texts: the long descriptions of the installed Python packages (markdown prose) and the
   standard library's modules, interleaved, as `{"text": ...}` lines; `dflash-mlx train data
   --from` them cuts windows of 256 tokens (arm B, `--windows` of them).
3. per arm: `train features` (CPU time: B's whole data cost) and `train fit --init-from` the
   shipped drafter, `--steps` steps at lr 3e-4, V held out (its features computed once).
4. validation tau of greedy decoding's walk (chains of 16) over V's replies, before and after
   (`fit`'s validation: its softmax over the tokens of the arm's data and V).
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

# isort: off
import dflash_mlx  # noqa: F401  (binds the fast CPU BLAS before mlx loads)
import mlx.core as mx

# isort: on
from dflash_mlx import load
from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.train.blocks import target_path
from dflash_mlx.train.data import extend_dataset, read_records
from dflash_mlx.train.features import chunk_path, load_features
from dflash_mlx.train.prompts import build_prompts

SHIPPED = Path(dflash_mlx.__file__).parent / "drafters" / "smollm2-135m-instruct"
FIRST_PROMPT = 3600  # the shipped drafter's data used the pool's first 3,450 prompts
CHUNK = 64  # records per features file


def cpu_seconds(who: int) -> float:
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


def timed(stage: str, work: Path, run) -> dict:
    """Run `run()` once (its wall and CPU seconds kept in work/costs.json, so a rerun skips it)."""
    costs_file = work / "costs.json"
    costs = json.loads(costs_file.read_text()) if costs_file.exists() else {}
    if stage not in costs:
        wall, cpu = time.perf_counter(), cpu_seconds(resource.RUSAGE_SELF)
        children = cpu_seconds(resource.RUSAGE_CHILDREN)
        run()
        cpu = cpu_seconds(resource.RUSAGE_SELF) - cpu + cpu_seconds(resource.RUSAGE_CHILDREN)
        costs[stage] = {"wall": round(time.perf_counter() - wall), "cpu": round(cpu - children)}
        costs_file.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"{stage}: {costs[stage]}", flush=True)
    return costs[stage]


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "dflash_mlx", *args], check=True)


def write_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def texts_file(path: Path, chars: int) -> None:
    """Installed packages' long descriptions (ASCII markdown) and stdlib modules, interleaved,
    about `chars` characters of them."""
    purelib, stdlib = sysconfig.get_paths()["purelib"], sysconfig.get_paths()["stdlib"]
    prose = []
    for meta in sorted(glob.glob(f"{purelib}/*.dist-info/METADATA")):
        body = Path(meta).read_text(errors="ignore").partition("\n\n")[2]
        if len(body) > 500 and sum(c.isascii() for c in body) > 0.97 * len(body):
            prose.append(body)
    modules = sorted(glob.glob(f"{stdlib}/*.py")) + [
        p for p in sorted(glob.glob(f"{stdlib}/*/*.py")) if "/test" not in p and "idlelib" not in p
    ]
    code = [t for t in (Path(p).read_text(errors="ignore") for p in modules) if len(t) > 500]
    mixed = [t for pair in zip(prose, code) for t in pair]
    kept = np.searchsorted(np.cumsum([len(t) for t in mixed]), chars) + 1
    mixed = mixed[:kept]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in mixed))


def arm(work: Path, name: str, records: list[dict], val_dir: Path, n_val: int, args) -> Path:
    """features and fit of one arm: its records, then V's (features copied, not recomputed)."""
    out = work / name
    n = len(records) // CHUNK * CHUNK
    write_records(out / "replies.jsonl", records[:n] + read_records(val_dir / "replies.jsonl"))
    (out / "features").mkdir(parents=True, exist_ok=True)
    shutil.copy(val_dir / "features" / "meta.json", out / "features" / "meta.json")
    for k in range(n_val // CHUNK):
        shutil.copy(
            chunk_path(val_dir / "features", k), chunk_path(out / "features", n // CHUNK + k)
        )
    timed(f"{name} features", work, lambda: cli("train", "features", "--work", str(out)))
    fit = ["train", "fit", "--work", str(out), "--init-from", str(SHIPPED), "--lr", "3e-4",
           "--warmup", "20", "--steps", str(args.steps), "--val-seqs", str(n_val),
           "--eval-every", str(args.steps), "--eval-prompts", "0"]  # fmt: skip
    timed(f"{name} fit", work, lambda: cli(*fit))
    return out / "ckpt"


def reply_tokens(records: list[dict]) -> int:
    return sum(len(r["ids"]) - r["start"] for r in records)


def chosen_share(arm_dir: Path, n: int) -> float:
    """Of the first `n` records' labelled tokens, the share the target would have chosen."""
    records = read_records(arm_dir / "replies.jsonl")[:n]
    chosen = []
    for record, stored in zip(records, load_features(arm_dir / "features", n)):
        ids = np.array(record["ids"])
        top_logp = np.array(stored["top_logp"].astype(mx.float32))
        _, on_path = target_path(ids, np.array(stored["top_ids"]), top_logp)
        chosen.append(on_path[record["start"] :])
    return float(np.concatenate(chosen).mean())


def validation(log: Path) -> dict:
    """Validation tau (decoding's walk, chains of 16) and acc@1-4 on V before and after."""
    entries = [json.loads(line)["val"] for line in log.read_text().splitlines() if '"val"' in line]
    return {
        when: {"tau": round(v["tau_decode"], 3), "acc": v["acc"][:4]}
        for when, v in (("shipped", entries[0]), ("fine-tuned", entries[-1]))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="the run's directory (a rerun resumes)")
    parser.add_argument("--val", type=int, default=128, help="replies held out (V)")
    parser.add_argument("--replies", type=int, default=512, help="arm A: new greedy replies")
    parser.add_argument("--windows", type=int, default=1536, help="arm B: windows of text")
    parser.add_argument("--steps", type=int, default=768, help="fine-tuning steps of each arm")
    args = parser.parse_args()
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(smollm2_model_dir())

    last = FIRST_PROMPT + args.val + args.replies
    prompts = build_prompts(last, 0)[FIRST_PROMPT:]
    timed(
        "replies",
        work,
        lambda: extend_dataset(model, tokenizer, prompts, work / "self" / "replies.jsonl", 192),
    )
    order = {p["id"]: i for i, p in enumerate(prompts)}
    stored = [r for r in read_records(work / "self" / "replies.jsonl") if r["id"] in order]
    replies = sorted(stored, key=lambda r: order[r["id"]])
    write_records(work / "V" / "replies.jsonl", replies[: args.val])
    cli("train", "features", "--work", str(work / "V"))

    texts = work / "texts.jsonl"
    if not texts.exists():
        texts_file(texts, args.windows * 224 * 4)  # ~4 characters a token
    timed(
        "windows",
        work,
        lambda: cli("train", "data", "--from", str(texts), "--work", str(work / "text")),
    )
    windows = read_records(work / "text" / "replies.jsonl")[: args.windows]

    ckpts = {
        "A: more greedy replies": arm(work, "A", replies[args.val :], work / "V", args.val, args),
        "B: text it did not write": arm(work, "B", windows, work / "V", args.val, args),
    }
    result = {name: validation(ckpt.parent / "train_log.jsonl") for name, ckpt in ckpts.items()}
    result["B: tokens the target would have chosen"] = round(
        chosen_share(work / "B", len(windows)), 3
    )
    costs = json.loads((work / "costs.json").read_text())
    tokens = [
        sum(len(r["ids"]) - r["start"] for r in part) for part in (replies, replies[args.val :])
    ]
    costs["A data (its share of the replies' CPU)"] = round(
        costs["replies"]["cpu"] * tokens[1] / tokens[0]
    )
    result["costs"] = costs
    print(json.dumps(result, indent=1))
    (work / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
