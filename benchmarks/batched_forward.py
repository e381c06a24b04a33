"""What a verify forward shared by several replies costs (`TargetAdapter.forward`, rows).

    python benchmarks/batched_forward.py                     # rows 1,2,4,8; positions 1,2,3,4,8
    python benchmarks/batched_forward.py --rows 4 --positions 1,4 --repeats 20
    python benchmarks/batched_forward.py --shape qwen3-8b --dtype bfloat16   # a GPU

SmolLM2-135M-Instruct in float32 (as `serve_clients.py` loads it), or random weights in a
published shape (`--shape`, `cycle_cost.py`'s), each row with its own cache of a
`--context`-token prompt. Per (rows, positions) it times, alternated in one run,
one shared forward over every row's positions against the rows' separate forwards
(the same work one at a time), both evaluated to the logits, and prints milliseconds
and both as multiples of one plain decoding step (1 row, 1 position): what the batch's
policy for that many rows (`scheduler.ByWidth`) weighs against each row's expected accepted
tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on
import mlx.core as mx
import numpy as np
from cycle_cost import DTYPES, SHAPES, random_target

from dflash_mlx import load
from dflash_mlx.models.target import TargetAdapter


def timed(run, *args) -> float:
    start = time.perf_counter()
    mx.eval(run(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--positions", default="1,2,3,4,8")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random weights in this shape")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args()
    if args.shape:
        model = random_target(args.shape)
        model.set_dtype(DTYPES[args.dtype])
        mx.eval(model.parameters())
    else:
        from serve_clients import float32_smollm2_dir  # imports the openai client

        model, _ = load(float32_smollm2_dir())
    target = TargetAdapter(model)
    vocab = target.vocab_size
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    positions = [int(p) for p in args.positions.split(",")]
    caches = []
    for _ in range(max(rows)):
        cache = target.make_cache()
        mx.eval(target.forward(mx.array(rng.integers(0, vocab, (1, args.context))), [cache]).logits)
        caches.append(cache)

    def shared(b: int, n: int) -> mx.array:
        out = target.forward(mx.array(rng.integers(0, vocab, (b, n))), caches[:b]).logits
        target_rollback(b, n)
        return out

    def separate(b: int, n: int) -> list[mx.array]:
        outs = [
            target.forward(mx.array(rng.integers(0, vocab, (1, n))), [c]).logits for c in caches[:b]
        ]
        target_rollback(b, n)
        return outs

    def target_rollback(b: int, n: int) -> None:
        for cache in caches[:b]:
            target.rollback(cache, n)

    for b in rows:  # first calls build and compile: out of the timings
        for n in positions:
            timed(shared, b, n), timed(separate, b, n)
    step = statistics.median(timed(separate, 1, 1) for _ in range(args.repeats))
    print(f"one plain step: {1e3 * step:.2f} ms")
    print("rows positions | shared ms (steps) | separate ms (steps) | separate / shared")
    for b in rows:
        for n in positions:
            times = {"shared": [], "separate": []}
            for _ in range(args.repeats):
                times["shared"].append(timed(shared, b, n))
                times["separate"].append(timed(separate, b, n))
            s, p = (statistics.median(times[k]) for k in ("shared", "separate"))
            shared_ms, separate_ms = (
                f"{1e3 * s:8.2f} ({s / step:5.2f})",
                f"{1e3 * p:8.2f} ({p / step:5.2f})",
            )
            print(f"{b:4d} {n:9d} | {shared_ms} | {separate_ms} | {p / s:5.2f}", flush=True)


if __name__ == "__main__":
    main()
