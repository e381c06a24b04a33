"""The CPU kernels' threads, side by side in one process: a target forward over 1 and over 16
positions (a decoding step, a verify forward) with every kernel call on one thread, split as
its size allows (as before the counts were measured), and as measured (`native/threads.h`),
the settings alternated in rounds, beside `--busy` pure-Python spin loops (one core each).

    python benchmarks/kernel_threads.py --busy 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx

# isort: on

from busy_machine import busy_processes
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.models.target import load
from dflash_mlx.native import blas

SETTINGS = {"one thread": 1, "split": os.cpu_count() or 1, "measured": 0}


def forward_ms(model, cache, positions: int, repeats: int) -> float:
    """Mean ms of a forward over `positions` new tokens, each trimmed off again."""
    x = mx.array([list(range(5, 5 + positions))])
    for _ in range(3):
        mx.eval(model(x, cache=cache))
        for c in cache:
            c.trim(positions)
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(model(x, cache=cache))
        for c in cache:
            c.trim(positions)
    return (time.perf_counter() - tic) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside it")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20, help="forwards per timing")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache")
    args = parser.parse_args()
    model, _ = load(smollm2_model_dir())
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, args.context + 1))]), cache=cache))
    times: dict[tuple[str, int], list[float]] = {}
    spinners = busy_processes(args.busy)
    try:
        time.sleep(0.5)
        for _ in range(args.rounds):
            for name, threads in SETTINGS.items():
                blas.force_threads(threads)
                for positions in (1, 16):
                    ms = forward_ms(model, cache, positions, args.repeats)
                    times.setdefault((name, positions), []).append(ms)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
        blas.force_threads(0)
    print(f"busy {args.busy}, load {os.getloadavg()[0]:.1f}; medians of {args.rounds} rounds")
    for positions in (1, 16):
        base = statistics.median(times[("one thread", positions)])
        cells = []
        for name in SETTINGS:
            ms = statistics.median(times[(name, positions)])
            cells.append(f"{name} {ms:.1f} ms ({ms / base:.2f})")
        print(f"{positions:>2} positions: " + ", ".join(cells))


if __name__ == "__main__":
    main()
