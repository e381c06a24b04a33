"""Milliseconds per speculative cycle against the compute a cycle needs.

    python benchmarks/loop_cycle.py                      # this tree
    python benchmarks/loop_cycle.py --baseline f523e60   # side by side with an older commit

On SmolLM2-135M (fp32) with a fixed random drafter of the shipped shape (`--layers`,
default 2; a fixed acceptance pattern), it times whole cycles of `stream_generate`
and, separately, a draft forward and a 16-position verify forward on their own
(each forced to finish), interleaved in each process (`--repeats`) so that a burst
of load hits both.
With --baseline the same measurement runs from a git worktree of that commit,
alternating with this tree in separate processes, so both see the same machine.
The probe drafter drafts over the shipped drafter's vocabulary (`--vocab-from`)
in trees that support a draft vocabulary, over the whole vocabulary otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, statistics, sys, time
import dflash_mlx
import mlx.core as mx
from dflash_mlx import load, stream_generate
from dflash_mlx.checkpoint import init_draft
from dflash_mlx.gguf import smollm2_model_dir
from dflash_mlx.target import TargetAdapter

max_tokens, block, repeats, layers = (int(a) for a in sys.argv[1:5])
vocab = json.loads(sys.argv[5])
model, tok = load(smollm2_model_dir())
draft = init_draft(model, num_layers=layers, block_size=block, seed=0)
reduced = vocab is not None and hasattr(draft.config, "draft_vocab")  # trees since 35c9c3f
if reduced:
    draft.config.draft_vocab = vocab
messages = [{"role": "user", "content": "Write a Python function that merges two sorted lists."}]
prompt = tok.apply_chat_template(messages, add_generation_prompt=True)

def cycle_times():
    stamps = [time.perf_counter() for r in stream_generate(model, draft, tok, prompt,
                                                            max_tokens=max_tokens)]
    return [b - a for a, b in zip(stamps[1:], stamps[2:])]

target = TargetAdapter(model)
cache, dcache = target.make_cache(), draft.make_cache()
with target.capture(draft.config.target_layer_ids) as captured:
    model(mx.array(prompt)[None], cache=cache)
    feats = mx.concatenate([captured[i] for i in draft.config.target_layer_ids], axis=-1)
    draft.append_context(feats, dcache)
    mx.eval([c.state for c in cache + dcache])
block_ids = mx.array([prompt[-1]] + [draft.config.mask_token_id] * (block - 1))

def timed(fn, reps=15):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)

head = target.draft_head(draft.config.draft_vocab) if reduced else target.lm_head

def draft_forward():
    logits = draft.draft_logits(block_ids, target.embed_tokens, head, dcache)
    mx.eval(mx.argmax(logits, axis=-1))

def verify_forward():
    mx.eval(mx.argmax(model(block_ids[None], cache=cache)[0], axis=-1))
    for c in cache:
        c.trim(block)

cycles, drafts, verifies = [], [], []
for _ in range(repeats):  # interleaved, so a burst of load on the machine hits both
    cycles += cycle_times()
    drafts.append(timed(draft_forward))
    verifies.append(timed(verify_forward))
print(json.dumps({"cycle_ms": 1000 * statistics.median(cycles),
                  "draft_ms": statistics.median(drafts), "verify_ms": statistics.median(verifies),
                  "cycles": len(cycles), "draft_vocab": len(vocab) if reduced else None}))
"""


def measure(tree: Path, args: argparse.Namespace, vocab: list[int] | None) -> dict:
    argv = [str(args.max_tokens), str(args.block_size), str(args.repeats), str(args.layers)]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv, json.dumps(vocab)],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    keys = ("cycle_ms", "draft_ms", "verify_ms")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    med["overhead"] = med["cycle_ms"] / (med["draft_ms"] + med["verify_ms"])
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git commit to compare against, side by side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2, help="probe drafter depth (shipped: 2)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="generations and solo timings per process"
    )
    parser.add_argument(
        "--vocab-from",
        default=str(ROOT / "dflash_mlx" / "drafters" / "smollm2-135m-instruct"),
        help="drafter dir whose draft vocabulary the probe drafter uses (trees that support it)",
    )
    parser.add_argument("--full-vocab", action="store_true", help="draft over the whole vocab")
    args = parser.parse_args()
    config = json.loads((Path(args.vocab_from) / "config.json").read_text())
    vocab = None if args.full_vocab else config.get("dflash_config", {}).get("draft_vocab")

    trees = {"current": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            base = Path(tmp) / "baseline"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline],
                check=True,
                capture_output=True,
            )
            trees["baseline"] = base
        try:
            runs = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(measure(tree, args, vocab))
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)])
    results = {name: summary(r) for name, r in runs.items()}
    for name, s in results.items():
        print(
            f"{name:9s} cycle {s['cycle_ms']:6.1f} ms   draft {s['draft_ms']:5.1f} ms   "
            f"verify {s['verify_ms']:6.1f} ms   cycle / (draft + verify) {s['overhead']:.2f}   "
            f"draft vocab {runs[name][0]['draft_vocab'] or 'full'}"
        )
    if "baseline" in results:
        ratio = results["baseline"]["cycle_ms"] / results["current"]["cycle_ms"]
        print(f"baseline / current ms per cycle: {ratio:.2f}x")


if __name__ == "__main__":
    main()
