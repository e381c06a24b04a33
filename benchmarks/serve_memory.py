"""A server's memory over many requests: `dflash-mlx serve` under N concurrent clients.

    python benchmarks/serve_memory.py --requests 450 --clients 8
    python benchmarks/serve_memory.py --requests 300 --odd      # odd parameters mixed in

Starts `dflash-mlx serve` (SmolLM2-135M-Instruct in float32, the shipped drafter, up to 8
requests decoded together) on a free port of 127.0.0.1, warms it up with one request per
client, then sends the bench suite's prompts round-robin from `--clients` threads of the
`openai` client (greedy chat completions, `--max-tokens` each) and prints the server's
resident set (VmRSS, /proc) after warm-up and at each checkpoint. With `--odd`, every fifth
request carries an extreme parameter (huge or tiny top_k, top_p, min_p and temperature,
penalties at their bounds, logprobs, logit_bias at its bound, a client gone mid-stream),
answered or refused, beside the normal ones. The garbage collector is never asked to run.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI, OpenAIError
from serve_clients import float32_smollm2_dir, free_port, running, wait_ready

from dflash_mlx.cli.bench import load_prompts
from dflash_mlx.cli.demo import SHIPPED_DRAFTER

ODD = [
    {"temperature": 1.0, "extra_body": {"top_k": 2**31 - 1}},
    {"temperature": 100.0, "top_p": 1e-9},
    {"temperature": 0.01, "extra_body": {"min_p": 0.999}},
    {"presence_penalty": 1000.0, "frequency_penalty": -1000.0},
    {"logprobs": True, "top_logprobs": 20, "logit_bias": {"1": 100.0}},
    {"extra_body": {"repetition_penalty": 100.0, "repetition_context_size": 2**31 - 1}},
    {"temperature": 1.0, "seed": 2**32 - 1},
    {"stream": True},  # read one chunk, then leave
]


def rss_mib(pid: int) -> float:
    """The process's resident set, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def one_request(client: OpenAI, model: str, prompt: str, max_tokens: int, odd: dict | None):
    """One chat completion; an odd one may be refused (4xx) or cut short by leaving."""
    kwargs = dict(odd or {})
    stream = kwargs.pop("stream", False)
    request = dict(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=kwargs.pop("temperature", 0.0),
        **kwargs,
    )
    try:
        if stream:
            with client.chat.completions.create(stream=True, **request) as chunks:
                next(iter(chunks), None)
        else:
            client.chat.completions.create(**request)
    except OpenAIError:
        if odd is None:
            raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=450)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--checkpoints", default="50,150,300,450", help="requests done")
    parser.add_argument("--odd", action="store_true", help="every fifth request an odd one")
    parser.add_argument("--model", type=Path, help="model dir (default: SmolLM2 in float32)")
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTER))
    parser.add_argument("--log", default="serve_memory.log", help="the server's log")
    args = parser.parse_args()
    model_dir = args.model or float32_smollm2_dir()
    port = free_port()
    argv = ["dflash-mlx", "serve", "--model", str(model_dir), "--draft", args.draft]
    argv += ["--port", str(port), "--decode-concurrency", "8"]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    prompts = [p["prompt"] for p in load_prompts()]
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    with running(argv, Path(args.log)) as server:
        wait_ready("dflash", f"http://127.0.0.1:{port}", server, Path(args.log), 600)
        model = client.models.list().data[0].id
        with ThreadPoolExecutor(args.clients) as pool:
            warm = [pool.submit(one_request, client, model, p, args.max_tokens, None)
                    for p in prompts[: args.clients]]  # fmt: skip
            for job in warm:
                job.result()
            print(f"after warm-up: {rss_mib(server.pid):.0f} MiB", flush=True)
            done, lock = 0, threading.Lock()
            odd = itertools.cycle(ODD)

            def request(i: int) -> None:
                nonlocal done
                extreme = next(odd) if args.odd and i % 5 == 4 else None
                one_request(client, model, prompts[i % len(prompts)], args.max_tokens, extreme)
                with lock:
                    done += 1
                    if done in checkpoints:
                        print(f"{done:>4} requests: {rss_mib(server.pid):.0f} MiB", flush=True)

            for job in [pool.submit(request, i) for i in range(args.requests)]:
                job.result()


if __name__ == "__main__":
    main()
