"""Several drafters side by side on the bench suite: τ, decode speed and identity with mlx-lm.

    python benchmarks/drafters.py DRAFT [DRAFT ...] [--limit 42] [--max-tokens 96] [--out r.json]
        [--policy] [--temperature 0.7 --top-p 0.9]

One process, one target (SmolLM2-135M-Instruct in float32 unless `--model`). Per prompt, in
turn: mlx-lm's greedy `stream_generate`, then each drafter's greedy chain at a fixed block
(`--block-size`, default each drafter's own; no adaptive sizing), so every drafter meets the
same prompts under the same machine load. τ is committed tokens per cycle; acceptance at k is
the share of cycles that proposed at least k drafts whose first k were accepted. A DSpark
drafter's confidence head may verify fewer than its block: `drafts/cycle` says how many it
proposed on average. A DRAFT `mtp:DIR` is the MTP layer of the target checkpoint DIR (one
`train export` wrote from an MTP layer: the same target, the layer beside it). `--policy` runs
each drafter as the library does by default (the cost-based policy sizes each cycle and
may decline to draft) instead of fixed chains; `--temperature`/`--top-p` sample, mlx-lm
with its own sampler (outputs then differ from mlx-lm's by chance, not by error).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on
import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from dflash_mlx import GenerationSettings, load, load_draft, stream_generate
from dflash_mlx.chat_format import render
from dflash_mlx.cli.bench import PROMPTS_FILE, acceptance, load_prompts, measure, throughput
from dflash_mlx.models.gguf import smollm2_model_dir


def summary(runs: list, ar_runs: list) -> dict:
    """τ, acceptance, decode tok/s, the speedup over mlx-lm and identical outputs of `runs`
    (a drafter's runs on some prompts; `ar_runs`: mlx-lm's on the same)."""
    cycles = [c for r in runs for c in r.cycles]
    accepted = acceptance(cycles)
    fast, slow = throughput(runs), throughput(ar_runs)
    return {
        "prompts": len(runs),
        "tau": accepted["tau"],
        "acceptance": accepted["per_position"][:3],
        "drafts_per_cycle": statistics.mean(p for _, _, p in cycles),
        "decode_tps": fast["decode_tps"],
        "ar_decode_tps": slow["decode_tps"],
        "speedup": fast["decode_tps"] / slow["decode_tps"],
        "identical": sum(r.tokens == a.tokens for r, a in zip(runs, ar_runs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("drafts", nargs="+", help="drafter directories (mtp:DIR: DIR's MTP layer)")
    parser.add_argument("--model", help="target (default: SmolLM2-135M-Instruct, float32)")
    parser.add_argument("--prompts", default=str(PROMPTS_FILE))
    parser.add_argument("--limit", type=int, help="the first N prompts only")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, help="default: each drafter's own")
    parser.add_argument("--policy", action="store_true", help="the library's default policy")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()

    model, tokenizer = load(args.model or str(smollm2_model_dir()))
    drafts = {
        path: load_draft("mtp", target=path[4:]) if path.startswith("mtp:") else load_draft(path)
        for path in args.drafts
    }
    sampler = make_sampler(args.temperature, args.top_p)
    prompts = load_prompts(args.prompts)[: args.limit]
    encoded = [render(tokenizer, p["prompt"], True) for p in prompts]

    def ar(ids: list[int]):
        return lambda: mlx_lm.stream_generate(
            model, tokenizer, mx.array(ids), max_tokens=args.max_tokens, sampler=sampler
        )

    def chain(path: str, ids: list[int]):
        draft = drafts[path]
        settings = GenerationSettings(
            block_size=args.block_size or (None if args.policy else draft.config.block_size),
            adaptive=None if args.policy else False,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
        )
        return lambda: stream_generate(model, draft, tokenizer, ids, settings=settings)

    measure(ar(encoded[0]))  # warm up
    for path in drafts:
        measure(chain(path, encoded[0]))
    ar_runs, runs = [], {path: [] for path in drafts}
    for p, ids in zip(prompts, encoded):
        ar_runs.append(measure(ar(ids)))
        for path in drafts:
            runs[path].append(measure(chain(path, ids)))
        taus = ", ".join(f"{acceptance(runs[d][-1].cycles)['tau']:.2f}" for d in drafts)
        print(f"{p['id']}: τ {taus}", flush=True)

    categories = sorted({p["category"] for p in prompts})
    results: dict = {"config": vars(args), "drafters": {}}
    for path in drafts:
        rows = {}
        for category in [*categories, "all"]:
            keep = [i for i, p in enumerate(prompts) if category in ("all", p["category"])]
            rows[category] = summary([runs[path][i] for i in keep], [ar_runs[i] for i in keep])
        results["drafters"][path] = rows

    print(
        f"\n{'drafter':<48} {'prompts':<9} {'τ':>5} {'acc k=1/2/3':>16} {'drafts':>7} "
        f"{'tok/s':>6} {'AR':>6} {'×AR':>6} {'same':>6}"
    )
    for path, rows in results["drafters"].items():
        for category, r in rows.items():
            acc = "/".join(f"{a:.2f}" for a in r["acceptance"])
            print(
                f"{path[-48:]:<48} {category:<9} {r['tau']:5.2f} {acc:>16} "
                f"{r['drafts_per_cycle']:7.1f} {r['decode_tps']:6.1f} {r['ar_decode_tps']:6.1f} "
                f"{r['speedup']:5.2f}x {r['identical']:>3}/{r['prompts']}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
