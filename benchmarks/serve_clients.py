"""Serving concurrent clients: `dflash-mlx serve` beside `mlx_lm.server`, N streaming clients each.

    python benchmarks/serve_clients.py                      # --clients 1,4,8
    python benchmarks/serve_clients.py --clients 1,4 --rounds 1 --max-tokens 48 --prompts 8

Starts both servers on free ports of 127.0.0.1 on the very same model directory
(SmolLM2-135M-Instruct imported from its GGUF in float32; `dflash-mlx serve` adds the
shipped drafter, `mlx_lm.server` batches up to its `--decode-concurrency`, 32 by default,
and runs on the BLAS binding `import dflash_mlx` makes, as `dflash-mlx bench`'s baseline does),
waits for both, then per client count and round sends the first `--prompts` prompts of
the bench suite as a burst to one server, then to the other: N threads of the official
`openai` client, each streaming greedy chat completions (temperature 0, the same
`max_tokens`) one after another until the burst's prompts are done. Per run: aggregate
tok/s (every completion token over the burst's wall time), per-request decode tok/s
(tokens after the first over the time from the first text chunk to the last; DFlash
streams a chunk per verify cycle, so its first chunk may hold more than one token),
time to first text p50/p95, and how many replies equal the same server's 1-client reply
to that prompt and the other server's reply in the same round. With `--before DIR` a third
server, `dflash-before`, runs the same `dflash-mlx serve` from the checkout DIR (its
`dflash_mlx` first on the path), so a change is measured against the code before it in one
run. Every server is stopped (process groups, SIGTERM then SIGKILL) however the run ends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from openai import OpenAI

from dflash_mlx.cli.bench import load_prompts
from dflash_mlx.cli.demo import SHIPPED_DRAFTER
from dflash_mlx.models.gguf import SMOLLM2_NAME, convert_gguf, smollm2_gguf_path
from dflash_mlx.paths import cache_dir

SERVERS = ("dflash", "mlx-lm")  # and "dflash-before" with --before
# `mlx_lm.server` with `import dflash_mlx` first: the OpenBLAS and few-row kernel binding that
# `dflash-mlx bench` gives its mlx-lm baseline (same process); without it MLX's bundled
# reference BLAS makes every mlx-lm step several times slower on Linux.
MLX_LM_SERVER = "import dflash_mlx; from mlx_lm.server import main; main()"
STOP_GRACE_S = 15.0


def float32_smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct with float32 weights, written once from its GGUF: a directory
    both servers load as it is (the cached import keeps the GGUF's 4-bit weights, which
    `dflash-mlx` dequantizes on the CPU and `mlx_lm.server` would not)."""
    out = cache_dir() / "models" / f"{SMOLLM2_NAME}-float32"
    if not out.exists():
        print(f"writing {out} (first run only)...", flush=True)
        convert_gguf(smollm2_gguf_path(), out, dequantize=True)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(process: subprocess.Popen) -> None:
    """End the server's whole process group: SIGTERM, then SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def running(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`argv` in a process group of its own, output to `log`, stopped when the block ends."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        yield process
    finally:
        stop_group(process)


def wait_ready(name: str, url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll `url`/health until it answers 200; a server that exits or takes too long fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited with {process.returncode}; its log ends:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError(f"{name} was not ready after {timeout:g} s (log: {log})")


@dataclass
class Reply:
    prompt_id: str
    text: str
    tokens: int
    ttft_s: float
    decode_tps: float
    usage: bool  # the token count came from the stream's usage (else: text chunks counted)


def chat(client: OpenAI, model: str, prompt: dict[str, str], max_tokens: int) -> Reply:
    """One streaming greedy chat completion, timed from the client's side."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt["prompt"]}],
        temperature=0.0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, first, last, usage = [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].delta.content)
    if first is None:
        raise RuntimeError(f"prompt {prompt['id']}: the reply has no text")
    tokens = usage if usage is not None else len(parts)
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else float("nan")
    return Reply(prompt["id"], "".join(parts), tokens, first - start, decode, usage is not None)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


def burst(
    client: OpenAI, model: str, prompts: list[dict[str, str]], clients: int, max_tokens: int
) -> dict:
    """All `prompts` through `clients` concurrent streams; the run's measurements."""
    pool = ThreadPoolExecutor(clients)
    start = time.perf_counter()
    try:
        replies = list(pool.map(lambda p: chat(client, model, p, max_tokens), prompts))
    finally:  # on Ctrl-C, not waiting for streams that end when the servers are stopped
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - start
    load = os.getloadavg()[0]
    tokens = sum(r.tokens for r in replies)
    ttft = [r.ttft_s for r in replies]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "aggregate_tps": tokens / wall,
        "decode_tps_p50": statistics.median(r.decode_tps for r in replies),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "load_1min": load,  # the machine's 1-minute load average at the burst's end
        "replies": [asdict(r) for r in replies],
    }


def other_server(name: str) -> str:
    """The server a run's replies are compared with: mlx-lm for ours, ours for mlx-lm."""
    return "dflash" if name == "mlx-lm" else "mlx-lm"


def compare(runs: list[dict]) -> None:
    """Each run's replies against its server's 1-client replies and the other server's."""
    texts = {
        (r["server"], r["clients"], r["round"]): [x["text"] for x in r["replies"]] for r in runs
    }
    for run in runs:
        mine = texts[run["server"], run["clients"], run["round"]]
        solo = texts[run["server"], 1, run["round"]]
        other = texts[other_server(run["server"]), run["clients"], run["round"]]
        run["same_as_solo"] = sum(a == b for a, b in zip(mine, solo))
        run["same_as_other"] = sum(a == b for a, b in zip(mine, other))


def report(runs: list[dict], prompts: int) -> None:
    head = (
        f"{'clients':>7} {'server':>13} {'round':>5} {'agg tok/s':>9} {'decode p50':>10} "
        f"{'TTFT p50':>9} {'TTFT p95':>9} {'=solo':>6} {'=other':>6}"
    )
    print(head)
    for r in runs:
        print(
            f"{r['clients']:>7} {r['server']:>13} {r['round']:>5} {r['aggregate_tps']:>9.1f} "
            f"{r['decode_tps_p50']:>10.1f} {r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s "
            f"{r['same_as_solo']:>3}/{prompts:<2} {r['same_as_other']:>3}/{prompts:<2}"
        )
    servers = list(dict.fromkeys(r["server"] for r in runs))
    for n in sorted({r["clients"] for r in runs}):
        rate = {
            s: statistics.median(
                r["aggregate_tps"] for r in runs if r["clients"] == n and r["server"] == s
            )
            for s in servers
        }
        ratios = ", ".join(
            f"{s} / mlx-lm = {rate[s] / rate['mlx-lm']:.2f}" for s in servers if s != "mlx-lm"
        )
        print(f"{n} clients, aggregate tok/s: {ratios}")


def client_counts(text: str) -> list[int]:
    """The --clients list, ascending, with 1 (the solo replies every run is compared to)."""
    counts = {int(c) for c in text.split(",") if c.strip()}
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"client counts must be at least 1, got {text!r}")
    return sorted(counts | {1})


def server_commands(args: argparse.Namespace, model: Path, ports: dict[str, int]) -> dict:
    most = max(args.clients)

    def dflash(name: str) -> list[str]:
        return [
            *(sys.executable, "-m", "dflash_mlx", "serve", "--model", str(model)),
            *(("--no-draft",) if args.draft == "none" else ("--draft", args.draft)),
            *(("--tree-budget", str(args.tree_budget)) if args.tree_budget else ()),
            *("--port", str(ports[name]), "--max-queue", str(most), "--log-level", "warning"),
        ]

    commands = {
        "dflash": dflash("dflash"),
        "mlx-lm": [
            *(sys.executable, "-c", MLX_LM_SERVER, "--model", str(model)),
            *("--port", str(ports["mlx-lm"]), "--log-level", "WARNING"),
            *("--decode-concurrency", str(max(most, 32))),
        ],
    }
    if args.before:
        commands["dflash-before"] = dflash("dflash-before")
    return commands


def server_env(name: str, args: argparse.Namespace) -> dict[str, str] | None:
    """The `dflash-before` server's environment: the checkout `--before` first on the path."""
    if name != "dflash-before":
        return None
    path = os.pathsep.join(filter(None, [str(args.before.resolve()), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=client_counts, default="1,4,8", help="e.g. 1,4,8")
    parser.add_argument("--rounds", type=int, default=2, help="bursts per server and count")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="the suite's first N prompts")
    parser.add_argument("--model", type=Path, help="model dir (default: SmolLM2 in float32)")
    parser.add_argument(
        "--draft",
        default=str(SHIPPED_DRAFTER),
        help="drafter dir, mtp, or none (plain steps through the same loop)",
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        default=0,
        help="dflash-mlx serve's (default 0: none, the library's default policy)",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds per server")
    parser.add_argument(
        "--before", type=Path, help="a checkout of the code before a change: a third server"
    )
    parser.add_argument(
        "--out", default="results.json", help="results; the servers' logs go beside it"
    )
    args = parser.parse_args()
    prompts = load_prompts()[: args.prompts]
    model = args.model or float32_smollm2_dir()
    servers = [*SERVERS, *(["dflash-before"] if args.before else [])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in servers}
    commands = server_commands(args, model, ports)
    clients = {
        name: OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for name, port in ports.items()
    }
    # Ctrl-C (even where a shell started us with SIGINT ignored) and SIGTERM unwind through
    # the servers' clean-up
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    runs = []
    with ExitStack() as running_servers:
        for name, argv in commands.items():
            log = Path(args.out).with_suffix(f".{name}.log")
            process = running_servers.enter_context(running(argv, log, server_env(name, args)))
            wait_ready(name, f"http://127.0.0.1:{ports[name]}", process, log, args.ready_timeout)
        # the name each server answers to: mlx_lm.server's for its --model, ours as listed
        models = {
            name: "default_model" if name == "mlx-lm" else clients[name].models.list().data[0].id
            for name in servers
        }
        for name in servers:  # warm-up: loading and first-call set-up stay out of the runs
            chat(clients[name], models[name], prompts[0], 8)
        for n in args.clients:
            for round_ in range(args.rounds):
                for name in servers:
                    run = burst(clients[name], models[name], prompts, n, args.max_tokens)
                    runs.append({"server": name, "clients": n, "round": round_, **run})
                    print(
                        f"{n} clients, {name}, round {round_}: {run['aggregate_tps']:.1f} tok/s "
                        f"(load average {run['load_1min']:.1f})",
                        flush=True,
                    )
    compare(runs)
    report(runs, len(prompts))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"settings": {**settings, "model": str(model)}, "commands": commands, "runs": runs}
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
