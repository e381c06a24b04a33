"""What an mlx-lm user measures on switching: `python -m mlx_lm generate` against
`dflash-mlx generate --no-draft` and `dflash-mlx generate` with the shipped drafter, on the
same folder (SmolLM2-135M-Instruct's 4-bit checkpoint), each a fresh process, in rotating
order. Every run's speeds are parsed from mlx-lm's own stats lines, which both commands print;
memory is the process's peak resident set.

The CPU default loads the checkpoint in float32 (dequantized), so `--no-draft` alone
measures what the dtype gives, and the drafter what drafting adds on top.

    python benchmarks/cli_vs_mlx_lm.py --rounds 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "dflash_mlx" / "drafters" / "smollm2-135m-instruct"
PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
GENERATION = re.compile(r"^Generation: (\d+) tokens, ([\d.]+) tokens-per-sec$", re.M)


def commands(model: str, max_tokens: int) -> dict[str, list[str]]:
    flags = ["--model", model, "--prompt", PROMPT, "--max-tokens", str(max_tokens)]
    dflash = [sys.executable, "-m", "dflash_mlx", "generate", *flags]
    return {
        "mlx-lm": [sys.executable, "-m", "mlx_lm", "generate", *flags],
        "dflash-mlx --no-draft": [*dflash, "--no-draft"],
        "dflash-mlx, drafter": [*dflash, "--draft", str(DRAFTER)],
    }


def run(command: list[str]) -> tuple[float, int, float]:
    """(generation tok/s, tokens, peak RSS in MB) of one process."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = process.stdout.read().decode()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command[:5])} failed: {out[-800:]}")
    tokens, tps = GENERATION.search(out).groups()
    return float(tps), int(tokens), usage.ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    from dflash_mlx.models.gguf import smollm2_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    runs = commands(str(smollm2_model_dir()), args.max_tokens)
    names = list(runs)
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % 3 :] + names[: round_ % 3]:
            results[name].append(run(runs[name]))
            tps, tokens, rss = results[name][-1]
            print(f"round {round_ + 1} {name:>22}: {tps:6.1f} tok/s, {tokens} tokens, {rss:.0f} MB")
    base = statistics.median(r[0] for r in results["mlx-lm"])
    print(f"\n{'':>22}  median tok/s  x mlx-lm  peak RSS MB  (load {os.getloadavg()[0]:.1f})")
    for name in names:
        tps = statistics.median(r[0] for r in results[name])
        rss = statistics.median(r[2] for r in results[name])
        print(f"{name:>22}  {tps:12.1f}  {tps / base:7.2f}x  {rss:11.0f}")


if __name__ == "__main__":
    main()
