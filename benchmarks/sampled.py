"""Sampled generation against mlx-lm: today's default beside it with MLX's own exp.

    python benchmarks/sampled.py                      # SmolLM2-135M + the shipped drafter
    python benchmarks/sampled.py --rounds 3 --max-tokens 96

Per prompt and setting, interleaved: mlx-lm's `stream_generate` with its `make_sampler`;
this project's loop as it runs by default (block sizes chosen from the acceptance against
the backend's fixed cycle costs, top-p sorted by numpy on the CPU, the full-vocabulary
normalisations through `cpu_math`'s exp on the CPU); and the same loop normalising with
`mx.logsumexp` ("mlx exp", the default before `cpu_math`). Each run starts from the same
seed; the default one runs twice to check that a seeded sampled run is reproducible.
Reports median decode tok/s and the ratio to mlx-lm.
"""

from __future__ import annotations

import argparse
import statistics

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from dflash_mlx import load, load_draft, sampling, stream_generate
from dflash_mlx.chat_format import render
from dflash_mlx.demo import SHIPPED_DRAFTER
from dflash_mlx.gguf import smollm2_model_dir

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
    """(tokens, decode tok/s) of one seeded run of the loop."""
    mx.random.seed(seed)
    responses = list(stream_generate(model, draft, tokenizer, ids, **kwargs))
    return [t for r in responses for t in r.tokens], responses[-1].generation_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTER))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    model, tokenizer = load(args.model or smollm2_model_dir())
    draft = load_draft(args.draft)
    default_logsumexp = sampling.logsumexp
    for setting in SETTINGS:
        rates = {"mlx-lm": [], "default": [], "mlx exp": []}
        reproducible = True
        for r in range(args.rounds):
            for i, prompt in enumerate(PROMPTS):
                ids, seed = render(tokenizer, prompt, chat=True), 100 * r + i
                run = dict(seed=seed, max_tokens=args.max_tokens, **setting)
                rates["mlx-lm"].append(mlx_lm_rate(model, tokenizer, ids, **run))
                first, _ = dflash_run(model, draft, tokenizer, ids, **run)
                again, rate = dflash_run(model, draft, tokenizer, ids, **run)
                reproducible &= first == again
                rates["default"].append(rate)
                sampling.logsumexp = lambda x: mx.logsumexp(x, axis=-1, keepdims=True)
                try:
                    _, rate = dflash_run(model, draft, tokenizer, ids, **run)
                finally:
                    sampling.logsumexp = default_logsumexp
                rates["mlx exp"].append(rate)
        base = statistics.median(rates["mlx-lm"])
        print(f"{setting}: seeded reruns identical: {reproducible}")
        for name, values in rates.items():
            median = statistics.median(values)
            print(f"  {name:8s} {median:6.2f} tok/s  ({median / base:.2f}x mlx-lm)")


if __name__ == "__main__":
    main()
