"""The CPU default's dtype, chosen by measurement: float32 (quantized weights dequantized at
load) against the checkpoint kept quantized (the few-row quantized products).

Each setting runs in a fresh `dflash-mlx bench` process (mlx-lm and DFlash interleaved on the
same prompts, the shipped drafter, the library default), in alternating rounds, so every
"x mlx-lm" is a ratio from one process. The last column compares each DFlash run with mlx-lm
on the checkpoint as mlx-lm loads it (kept quantized), from the same round: what a mlx-lm user
switching to dflash-mlx gets. Memory: the process's peak resident set (the model, MLX's
buffers and Python) and MLX's own peak during DFlash's replies.

    python benchmarks/cpu_dtype.py --rounds 2 --limit 6 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DRAFTER = Path(__file__).resolve().parents[1] / "dflash_mlx" / "drafters" / "smollm2-135m-instruct"
DTYPES = ("float32", "checkpoint")


def bench_once(dtype: str, args: argparse.Namespace) -> tuple[dict, float]:
    """One bench process loading the target as `dtype`: its overall figures and peak RSS (GB)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "bench.json"
        command = [
            sys.executable, "-m", "dflash_mlx.cli.bench", "--draft", str(args.draft),
            "--dtype", dtype, "--limit", str(args.limit), "--max-tokens", str(args.max_tokens),
            "--no-split", "--out", str(out),
        ]  # fmt: skip
        with tempfile.TemporaryFile("w+") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            if process.returncode != 0:
                log.seek(0)
                raise RuntimeError(f"bench --dtype {dtype} failed: {log.read()[-800:]}")
        return json.loads(out.read_text())["overall"], usage.ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both dtypes")
    parser.add_argument("--draft", default=str(DRAFTER))
    parser.add_argument("--limit", type=int, default=6, help="the bench suite's first N prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    rows = []
    print(
        f"{'round':>5} {'dtype':>10} | {'mlx-lm tok/s':>12} {'DFlash tok/s':>12} {'x mlx-lm':>8} "
        f"{'tau':>5} {'RSS GB':>6} {'MLX peak GB':>11} {'load':>5} | {'x mlx-lm 4-bit':>14}"
    )
    for round_ in range(1, args.rounds + 1):
        order = DTYPES if round_ % 2 else DTYPES[::-1]
        results = {dtype: bench_once(dtype, args) for dtype in order}
        quantized_ar = results["checkpoint"][0]["ar"]["decode_tps"]
        for dtype in DTYPES:
            result, rss = results[dtype]
            row = {
                "round": round_,
                "dtype": dtype,
                "ar_tps": result["ar"]["decode_tps"],
                "dflash_tps": result["dflash"]["decode_tps"],
                "speedup": result["speedup_decode"],
                "tau": result["acceptance"]["tau"],
                "rss_gb": rss,
                "mlx_peak_gb": result["dflash"]["peak_memory_gb"],
                "load": os.getloadavg()[0],
                "vs_quantized_mlx_lm": result["dflash"]["decode_tps"] / quantized_ar,
            }
            rows.append(row)
            print(
                f"{round_:>5} {dtype:>10} | {row['ar_tps']:>12.1f} {row['dflash_tps']:>12.1f} "
                f"{row['speedup']:>7.2f}x {row['tau']:>5.2f} {rss:>6.2f} "
                f"{row['mlx_peak_gb']:>11.3f} {row['load']:>5.1f} | "
                f"{row['vs_quantized_mlx_lm']:>13.2f}x",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
