"""DFlash against mlx-lm on a machine other processes keep busy, as users' machines are.

For each number of busy processes (`--busy`: pure-Python spin loops, one core each) and each
thread setting (`--settings`), a fresh `dflash-mlx bench` process runs mlx-lm and DFlash
interleaved on the same prompts (library default, the shipped drafter), so every figure is a
side-by-side ratio from one process. A fresh process per setting, because OpenMP reads its
wait policy and thread count once, when it starts.

    python benchmarks/busy_machine.py --busy 0,1,3 --limit 6 --max-tokens 64
    python benchmarks/busy_machine.py --settings default,spin,one-thread --busy 1

Settings: `default` (as shipped: idle threads sleep, each kernel call takes the thread count
measured cheapest), `split` (every kernel call split over as many threads as its size allows,
as before the counts were measured), `spin` (OpenMP's and OpenBLAS's own
defaults, as before the library chose: idle threads spin a while), `omp-spin` (OpenMP's
default alone), `short-spin` (OpenMP's threads spin 20,000 rounds, then sleep), `one-thread`
(OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRAFTER = Path(__file__).resolve().parents[1] / "dflash_mlx" / "drafters" / "smollm2-135m-instruct"
SETTINGS = {
    "default": {},
    # the libraries' own defaults: OpenMP's idle threads spin 300,000 rounds, OpenBLAS's 2**28
    # cycles (each yielding the core between rounds)
    "spin": {"GOMP_SPINCOUNT": "300000", "OPENBLAS_THREAD_TIMEOUT": "28"},
    "omp-spin": {"GOMP_SPINCOUNT": "300000"},
    "short-spin": {"GOMP_SPINCOUNT": "20000"},  # ~20-60 us between products, then sleep
    "one-thread": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    # every kernel call split as its size allows, as before the counts were measured
    "split": {"DFLASH_MLX_THREADS": str(os.cpu_count())},
}
SPIN = "while True: pass"


def busy_processes(count: int) -> list[subprocess.Popen]:
    """`count` processes that each keep a core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def bench_once(env: dict[str, str], args: argparse.Namespace) -> dict:
    """One `dflash-mlx bench` process under `env`: its overall figures."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "bench.json"
        command = [
            sys.executable, "-m", "dflash_mlx.cli.bench", "--draft", str(args.draft),
            "--limit", str(args.limit), "--max-tokens", str(args.max_tokens),
            "--no-split", "--out", str(out),
        ]  # fmt: skip
        if args.temp:
            command += ["--temp", str(args.temp)]
        if args.category:
            command += ["--category", args.category]
        done = subprocess.run(
            command, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600
        )
        if done.returncode != 0:
            raise RuntimeError(f"bench failed: {done.stderr.strip()[-500:]}")
        return json.loads(out.read_text())["overall"]


def print_losses(rows: list[dict]) -> None:
    """Per setting and number of busy processes: the rounds' mean speeds, and what each of
    mlx-lm and DFlash lost against the same setting on a quiet machine (busy 0)."""
    runs: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        runs.setdefault((row["busy"], row["setting"]), []).append(row)
    totals = {
        key: [sum(r[name] for r in group) / len(group) for name in ("ar_tps", "dflash_tps")]
        for key, group in runs.items()
    }
    header = f"{'busy':>4} {'setting':>10} | {'x mlx-lm':>8} {'mlx-lm lost':>11}"
    print(f"\n{header} {'DFlash lost':>11}")
    for (busy, name), (ar, dflash) in totals.items():
        quiet = totals.get((0, name))
        lost = ["", ""]
        if quiet and busy:
            lost = [f"{100 * (1 - now / before):.0f} %" for now, before in zip((ar, dflash), quiet)]
        print(f"{busy:>4} {name:>10} | {dflash / ar:>7.2f}x {lost[0]:>11} {lost[1]:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", default="0,1", help="busy processes beside the bench, e.g. 0,1,3")
    parser.add_argument("--settings", default="default,spin", help=",".join(SETTINGS))
    parser.add_argument("--draft", default=str(DRAFTER))
    parser.add_argument("--limit", type=int, default=6, help="the bench suite's first N prompts")
    parser.add_argument("--category", help="the suite's prompts of one category (e.g. coding)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=1, help="times the whole grid is run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")

    rows = []
    print(f"{'busy':>4} {'setting':>10} | {'mlx-lm tok/s':>12} {'DFlash tok/s':>12} "
          f"{'x mlx-lm':>8} {'tau':>5} {'identical':>9} {'load':>5}")  # fmt: skip
    grid = [(int(b), n) for b in args.busy.split(",") for n in names]
    for busy, name in grid * args.rounds:
        spinners = busy_processes(busy)
        try:
            time.sleep(0.5)
            result = bench_once(SETTINGS[name], args)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
        load = os.getloadavg()[0]
        row = {
            "busy": busy,
            "setting": name,
            "ar_tps": result["ar"]["decode_tps"],
            "dflash_tps": result["dflash"]["decode_tps"],
            "speedup": result["speedup_decode"],
            "tau": result["acceptance"]["tau"],
            "identical": f"{result['identical']}/{result['prompts']}",
            "load": load,
        }
        rows.append(row)
        print(
            f"{busy:>4} {name:>10} | {row['ar_tps']:>12.1f} {row['dflash_tps']:>12.1f} "
            f"{row['speedup']:>7.2f}x {row['tau']:>5.2f} {row['identical']:>9} {load:>5.1f}",
            flush=True,
        )
    print_losses(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
