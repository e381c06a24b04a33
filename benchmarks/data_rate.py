"""Self-distillation data per CPU-hour: greedy replies per second of the training target
(SmolLM2-135M-Instruct, float32) against the batch width, mlx-lm's continuous
`BatchGenerator` beside the trainer's lockstep batches (`train.data.lockstep_replies`),
on the same prompts of the training pool, in one process.

    python benchmarks/data_rate.py --prompts 128 --max-tokens 128 --widths 32,64,128
"""

from __future__ import annotations

import argparse
import time

import dflash_mlx  # noqa: F401  (binds the fast CPU BLAS before mlx loads)
from dflash_mlx import load
from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.train.data import generate_replies, lockstep_replies
from dflash_mlx.train.prompts import build_prompts


def rate(replies) -> tuple[float, float, list]:
    tic, records = time.perf_counter(), list(replies)
    seconds = time.perf_counter() - tic
    tokens = sum(len(r["ids"]) - r["start"] for r in records)
    return tokens / seconds, len(records) / seconds, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--widths", default="32,64,128")
    parser.add_argument("--continuous-width", type=int, default=48)
    args = parser.parse_args()
    model, tokenizer = load(smollm2_model_dir())
    prompts = build_prompts(4 * args.prompts, seed=11)[: args.prompts]
    tok_s, rep_s, reference = rate(
        generate_replies(model, tokenizer, prompts, args.max_tokens, args.continuous_width)
    )
    by_id = {r["id"]: r["ids"] for r in reference}
    print(f"BatchGenerator, {args.continuous_width} in flight: {tok_s:.1f} tok/s, "
          f"{rep_s * 60:.1f} replies/min", flush=True)  # fmt: skip
    for width in map(int, args.widths.split(",")):
        tok_s, rep_s, records = rate(
            lockstep_replies(model, tokenizer, prompts, args.max_tokens, width)
        )
        same = sum(by_id[r["id"]] == r["ids"] for r in records)
        print(f"lockstep, width {width}: {tok_s:.1f} tok/s, {rep_s * 60:.1f} replies/min, "
              f"{same}/{len(records)} replies identical", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
