"""Matmul speed of MLX's CPU backend: its bundled BLAS, OpenBLAS, OpenBLAS with the few-row kernel.

    python benchmarks/blas_matmul.py
    python benchmarks/blas_matmul.py --rounds 3 --rows 1,2,4,8,16

Runs each setting in its own process (the binding happens before mlx is
imported), interleaved, and prints GF/s for a 2048² fp32 matmul and the ms of
`x @ W.T` for a few rows of x against SmolLM2-135M's weight shapes: 30 distinct
576x1536 (gate) and 1536x576 (down) matrices, as a forward meets them (streamed
from memory, not cached), and the 49,152x576 LM head.
"""

import argparse
import os
import subprocess
import sys

PROBE = """
import sys, time, dflash_mlx, mlx.core as mx
rows = [int(n) for n in sys.argv[1].split(",")]
def seconds(f, reps):
    mx.eval(f())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter(); mx.eval(f()); best = min(best, time.perf_counter() - t)
    return best
a, b = mx.random.normal((2048, 2048)), mx.random.normal((2048, 2048))
line = f"{2 * 2048**3 / seconds(lambda: a @ b, 3) / 1e9:7.1f} GF/s |"
for shape, count in (((1536, 576), 30), ((576, 1536), 30), ((49152, 576), 2)):
    ws = [mx.random.normal(shape) for _ in range(count)]
    mx.eval(ws)
    for n in rows:
        x = mx.random.normal((n, shape[1]))
        line += f" {1e3 * seconds(lambda: [x @ w.T for w in ws], 5) / count:6.3f}"
    line += " |"
print(f"{sys.argv[2]:26s} {line}", flush=True)
"""

SETTINGS = {
    "bundled": {"DFLASH_MLX_NO_BLAS": "1"},
    "OpenBLAS alone": {"DFLASH_MLX_NO_FEW_ROWS": "1"},
    "OpenBLAS + few-row kernel": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--no-bundled", action="store_true", help="skip MLX's slow bundled BLAS")
    args = parser.parse_args()
    rows = args.rows
    cells = " ".join(f"{n:>6s}" for n in rows.split(","))
    print(f"{'':26s} {'2048^2':>12s} | gate 576x1536, ms: {cells} | down 1536x576 | LM head")
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            if name == "bundled" and args.no_bundled:
                continue
            clean = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_MLX_NO_")}
            command = [sys.executable, "-c", PROBE, rows, name]
            subprocess.run(command, env={**clean, **env}, check=True)


if __name__ == "__main__":
    main()
