"""How long a large request body keeps the server's event loop from running.

    python benchmarks/large_bodies.py                 # 3.9 MiB of 120,000 messages, 3 rounds
    python benchmarks/large_bodies.py --messages 60000 --rounds 5

An asyncio loop ticks every millisecond while a chat body of one-character messages (the
shape that costs pydantic the most per byte) is prepared three ways: validated and counted on
the loop itself, in a thread (pydantic holds the GIL throughout), and by the server's
`Validator` (a worker process; the plain data it returns is unpickled on the pool's thread).
Prints, per way, the time to prepare the body and the longest the loop went without a tick,
min and max over the rounds: the longest stall is what `/health` and every stream wait.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from dflash_mlx.serve.schemas import ChatRequest
from dflash_mlx.serve.validation import Validator, prepared


async def stalled(work) -> tuple[float, float]:
    """(seconds `work()` took, the longest gap between the loop's 1 ms ticks meanwhile)."""
    longest = 0.0

    async def tick() -> None:
        nonlocal longest
        while True:
            tic = time.perf_counter()
            await asyncio.sleep(0.001)
            longest = max(longest, time.perf_counter() - tic)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    longest, tic = 0.0, time.perf_counter()
    await work()
    took = time.perf_counter() - tic
    await asyncio.sleep(0.01)  # the tick pending over the work ends, and counts
    ticker.cancel()
    return took, longest


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=120_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    one = {"role": "user", "content": "a"}
    body = json.dumps({"messages": [one] * args.messages, "max_tokens": 2}).encode()
    validator = Validator()
    validator.start()
    await asyncio.sleep(5)  # the worker processes have started

    async def on_loop() -> None:
        prepared(ChatRequest, body)

    async def in_thread() -> None:
        await asyncio.to_thread(prepared, ChatRequest, body)

    async def in_process() -> None:
        await validator(ChatRequest, body)

    ways = {"on the loop": on_loop, "in a thread": in_thread, "Validator": in_process}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.rounds):  # interleaved: the machine's load falls on every way alike
        for name, work in ways.items():
            results[name].append(await stalled(work))
    validator.close()
    print(f"{len(body) / 2**20:.1f} MiB, {args.messages} messages, {args.rounds} rounds")
    print("| way | prepared in, s (min-max) | longest loop stall, s (min-max) |")
    print("|---|---:|---:|")
    for name, runs in results.items():
        took, stall = [r[0] for r in runs], [r[1] for r in runs]
        print(f"| {name} | {min(took):.2f}-{max(took):.2f} | {min(stall):.3f}-{max(stall):.3f} |")


if __name__ == "__main__":
    asyncio.run(main())
