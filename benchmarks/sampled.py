"""Sampled generation against mlx-lm: the library default under each acceptance rule.

    python benchmarks/sampled.py                      # SmolLM2-135M + the shipped drafter
    python benchmarks/sampled.py --rounds 3 --max-tokens 96
    python benchmarks/sampled.py --rules speculative coupled --mlx-exp
    python benchmarks/sampled.py --rules coupled --full-transforms

Per prompt and setting, interleaved in one process: mlx-lm's `stream_generate` with its
`make_sampler`; this project's loop as it runs by default (chains or trees chosen per cycle:
by the clock under the coupled rule, from the backend's fixed cycle costs under the others)
with `acceptance` set to each rule of `--rules`; with `--mlx-exp`, the default rule's loop
normalising with `mx.logsumexp` (the default before `cpu_math`); with `--full-transforms`, the
coupled rule's loop with every drafted and verified row through the full-vocabulary transform
(no near-candidate ranking for the drafter, no sort-free choice for the target). Each run
starts from the same seed; every rule's runs twice to check that a seeded sampled run is
reproducible.
Reports median decode tok/s, the ratio to mlx-lm and tau (tokens per verify cycle).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.chat_format import render
from dflash_mlx.cli.demo import SHIPPED_DRAFTER
from dflash_mlx.decode import sampling
from dflash_mlx.models.gguf import smollm2_model_dir

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works.",
    "Write a Python function that checks whether a number is prime.",
    "What is 17 * 23? Show your steps.",
]
SETTINGS = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0)]


def mlx_lm_rate(model, tokenizer, ids: list[int], seed: int, max_tokens: int, **setting) -> float:
    sampler = make_sampler(setting["temperature"], setting.get("top_p", 0.0))
    mx.random.seed(seed)
    responses = mlx_lm.stream_generate(
        model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler
    )
    return list(responses)[-1].generation_tps


def dflash_run(model, draft, tokenizer, ids: list[int], seed: int, **kwargs):
    """(tokens, decode tok/s, tokens per cycle) of one seeded run of the loop."""
    mx.random.seed(seed)
    responses = list(stream_generate(model, draft, tokenizer, ids, **kwargs))
    tokens = [t for r in responses for t in r.tokens]
    tau = (len(tokens) - len(responses[0].tokens)) / max(1, len(responses) - 1)
    return tokens, responses[-1].generation_tps, tau


@contextmanager
def full_transforms() -> Iterator[None]:
    """Verifiers made meanwhile take every row through `transform` (their cheap ways None)."""
    cheap = sampling.make_draft_ranking, sampling.make_coupled_choice
    sampling.make_draft_ranking = sampling.make_coupled_choice = lambda *setting: None
    try:
        yield
    finally:
        sampling.make_draft_ranking, sampling.make_coupled_choice = cheap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTER))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rules", nargs="+", default=["speculative", "coupled"])
    parser.add_argument("--mlx-exp", action="store_true", help="also normalise with MLX's exp")
    parser.add_argument(
        "--full-transforms",
        action="store_true",
        help="also run the coupled rule with every row through the full-vocabulary transform",
    )
    args = parser.parse_args()

    model, tokenizer = load(args.model or smollm2_model_dir())
    draft = load_draft(args.draft)
    default_logsumexp = sampling.logsumexp
    for setting in SETTINGS:
        rates: dict[str, list[float]] = {"mlx-lm": [], **{rule: [] for rule in args.rules}}
        taus: dict[str, list[float]] = {rule: [] for rule in args.rules}
        if args.mlx_exp:
            rates["mlx exp"] = []
        if args.full_transforms:
            rates["full transforms"] = []
        reproducible = True
        for r in range(args.rounds):
            for i, prompt in enumerate(PROMPTS):
                ids, seed = render(tokenizer, prompt, chat=True), 100 * r + i
                run = dict(seed=seed, max_tokens=args.max_tokens, **setting)
                rates["mlx-lm"].append(mlx_lm_rate(model, tokenizer, ids, **run))
                for rule in args.rules:
                    first, _, _ = dflash_run(model, draft, tokenizer, ids, acceptance=rule, **run)
                    again, rate, tau = dflash_run(
                        model, draft, tokenizer, ids, acceptance=rule, **run
                    )
                    reproducible &= first == again
                    rates[rule].append(rate)
                    taus[rule].append(tau)
                if args.mlx_exp:
                    sampling.logsumexp = lambda x: mx.logsumexp(x, axis=-1, keepdims=True)
                    try:
                        _, rate, _ = dflash_run(model, draft, tokenizer, ids, **run)
                    finally:
                        sampling.logsumexp = default_logsumexp
                    rates["mlx exp"].append(rate)
                if args.full_transforms:
                    with full_transforms():
                        _, rate, _ = dflash_run(
                            model, draft, tokenizer, ids, acceptance="coupled", **run
                        )
                    rates["full transforms"].append(rate)
        base = statistics.median(rates["mlx-lm"])
        print(f"{setting}: seeded reruns identical: {reproducible}")
        for name, values in rates.items():
            median = statistics.median(values)
            tau = f"  tau {statistics.mean(taus[name]):.2f}" if name in taus else ""
            print(f"  {name:12s} {median:6.2f} tok/s  ({median / base:.2f}x mlx-lm){tau}")


if __name__ == "__main__":
    main()
