"""Fixed block sizes against the cost-chosen one, side by side with mlx-lm's decoding.

For each prompt, mlx-lm's own `stream_generate` and DFlash at every fixed block
size in `--sizes` and with the adaptive choice (`adaptive.py`) run one after the
other in one process (each after a short warm-up), so a burst of load on this
shared machine hits all variants alike. Reports decode tok/s relative to mlx-lm,
τ, a cycle's cost in mlx-lm decoding steps (τ / speedup), and the block sizes
the adaptive policy chose; "default" is the library's default, chains or trees chosen
per cycle (`AdaptiveStrategy`). `--trees` adds tree verification at those budgets,
`--adaptive-trees` trees of those largest budgets sized per cycle (`AdaptiveTree`),
`--trees-without-lookup` trees of those budgets without the prompt lookup's chain
(`lookup.py`), `--lookup-only` no drafter: plain decoding through the loop and the prompt
lookup's chain alone up to those depths.

    python benchmarks/block_size.py                          # shipped SmolLM2 drafter
    python benchmarks/block_size.py --draft random           # a drafter that never helps
    python benchmarks/block_size.py --context 2048 --limit 2 # long prompts
    python benchmarks/block_size.py --sizes 16 --trees 4,8,16,32  # chain vs tree
    python benchmarks/block_size.py --sizes 16 --trees 4,8 --adaptive-trees 16
    python benchmarks/block_size.py --sizes "" --trees 6,8 --trees-without-lookup 6,8,12
    python benchmarks/block_size.py --sizes "" --trees 6 --lookup-only 4,8
    python benchmarks/block_size.py --sizes "" --trees 8 --category coding --limit 14
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import Counter

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

import mlx.core as mx
import mlx_lm
from long_context import long_prompt

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.cli.bench import PROMPTS_FILE, load_prompts, measure, render, throughput
from dflash_mlx.cli.demo import DEFAULT_PROMPT, SHIPPED_DRAFTER
from dflash_mlx.decode.adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree, Cycle
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.gguf import smollm2_model_dir


class CountingStrategy(AdaptiveStrategy):
    """The default's policy, counting the chains ("chain-n") and trees ("tree-b") it played."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.played: Counter[str] = Counter()

    def record(self, cycle: Cycle) -> None:
        tree = cycle.path is not None
        self.played[f"tree-{cycle.proposed}" if tree else f"chain-{cycle.proposed + 1}"] += 1
        super().record(cycle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default=str(SHIPPED_DRAFTER), help="drafter dir or 'random'")
    parser.add_argument("--sizes", default="1,2,3,4,16", help="fixed block sizes to compare")
    parser.add_argument("--trees", default="", help="tree budgets to compare, e.g. 4,8,16,32")
    parser.add_argument(
        "--adaptive-trees", default="", help="largest budgets of trees sized per cycle, e.g. 16"
    )
    parser.add_argument(
        "--trees-without-lookup", default="", help="tree budgets without the prompt lookup"
    )
    parser.add_argument(
        "--lookup-only",
        default="",
        help="without a drafter: the prompt lookup's chain up to these depths (and plain decoding)",
    )
    parser.add_argument(
        "--limit", type=int, default=6, help="prompts: the demo's, then the suite's"
    )
    parser.add_argument("--context", type=int, help="long prompts of about this many tokens")
    parser.add_argument("--category", help="the suite's prompts of this category only, e.g. coding")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args()

    model, tokenizer = load(smollm2_model_dir())
    if args.draft == "random":
        draft = init_draft(model, num_layers=2, block_size=16, seed=0)
    else:
        draft = load_draft(args.draft)
    if args.context:
        texts = [long_prompt(tokenizer, args.context)] * args.limit
    elif args.category:
        suite = load_prompts(PROMPTS_FILE)
        texts = [p["prompt"] for p in suite if p["category"] == args.category]
    else:
        texts = [DEFAULT_PROMPT] + [p["prompt"] for p in load_prompts(PROMPTS_FILE)]
    prompts = [render(tokenizer, t, chat=True) for t in texts[: args.limit]]
    sizes = [int(n) for n in args.sizes.split(",") if n]
    trees = [f"tree-{n}" for n in args.trees.split(",") if n]
    sized = [f"tree-{n}-adaptive" for n in args.adaptive_trees.split(",") if n]
    bare = [f"tree-{n}-no-lookup" for n in args.trees_without_lookup.split(",") if n]
    alone = [f"lookup-{n}" for n in args.lookup_only.split(",") if n]
    variants = ["mlx-lm", "default", *map(str, sizes), "adaptive", *trees, *sized, *bare]
    variants += ["no-draft", *alone] if alone else []
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    # one policy for the whole run, as `dflash-mlx bench`, chat and serve keep theirs
    adapting = {"adaptive": True, "block_policy": AdaptiveBlock(draft.config.block_size)}
    default = {"block_policy": CountingStrategy(draft.config.block_size)}
    tree_policies = {v: AdaptiveTree(int(v.split("-")[1])) for v in sized}

    def generate(variant: str, ids: list[int], n: int):
        if variant == "mlx-lm":
            return lambda: mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=n)
        if variant == "no-draft":
            return lambda: stream_generate(model, None, tokenizer, ids, max_tokens=n)
        if variant.startswith("lookup-"):
            depth = int(variant.removeprefix("lookup-"))
            return lambda: stream_generate(
                model, None, tokenizer, ids, max_tokens=n, tree_budget=depth
            )
        if variant == "adaptive":
            setting = adapting
        elif variant == "default":
            setting = default
        elif variant in tree_policies:
            budget = tree_policies[variant].max_budget
            setting = {
                "tree_budget": budget,
                "adaptive": True,
                "block_policy": tree_policies[variant],
            }
        elif variant.startswith("tree-"):
            setting = {
                "tree_budget": int(variant.split("-")[1]),
                "prompt_lookup": not variant.endswith("-no-lookup"),
            }
        else:
            setting = {"block_size": int(variant)}
        return lambda: stream_generate(model, draft, tokenizer, ids, max_tokens=n, **setting)

    tps = {v: [] for v in variants}
    tau = {v: [] for v in variants[1:]}
    chosen: Counter[int] = Counter()
    budgets: dict[str, Counter[int]] = {v: Counter() for v in sized}
    for i, ids in enumerate(prompts):
        for variant in variants:
            measure(generate(variant, ids, 8))
            run = measure(generate(variant, ids, args.max_tokens))
            tps[variant].append(throughput([run])["decode_tps"])
            if variant != "mlx-lm":
                tau[variant].append((len(run.tokens) - 1) / max(len(run.cycles), 1))
            if variant == "adaptive":
                chosen.update(proposed + 1 for _, _, proposed in run.cycles)

            if variant in tree_policies:
                budgets[variant].update(proposed for _, _, proposed in run.cycles)
        print(
            f"prompt {i} ({len(ids)} tokens): "
            + "  ".join(f"{v} {tps[v][-1] / tps['mlx-lm'][-1]:.2f}x" for v in variants[1:]),
            flush=True,
        )
    summary = {
        v: {
            "speedup": statistics.mean(a / b for a, b in zip(tps[v], tps["mlx-lm"])),
            # a burst of load on one run skews the mean of ratios: the median resists it
            "median_speedup": statistics.median(a / b for a, b in zip(tps[v], tps["mlx-lm"])),
            "decode_tps": statistics.mean(tps[v]),
            "tau": statistics.mean(tau[v]) if v in tau else 1.0,
            # a cycle's wall time in mlx-lm decoding steps: (1 / tok/s) * tau over 1 / mlx-lm's
            "cycle_steps": statistics.mean(
                t * m / d for t, m, d in zip(tau[v], tps["mlx-lm"], tps[v])
            )
            if v in tau
            else 1.0,
        }
        for v in variants
    }
    print(f"load average at the end: {os.getloadavg()}")
    print(
        f"{'variant':>17} {'tok/s':>7} {'x mlx-lm':>9} {'median':>7} {'tau':>5} {'cycle/step':>10}"
    )
    for v, s in summary.items():
        print(
            f"{v:>17} {s['decode_tps']:7.1f} {s['speedup']:8.2f}x {s['median_speedup']:6.2f}x "
            f"{s['tau']:5.2f} "
            f"{s['cycle_steps']:10.2f}"
        )
    share = {n: round(c / sum(chosen.values()), 3) for n, c in sorted(chosen.items())}
    print(f"adaptive block sizes (share of cycles): {share}")
    counts = default["block_policy"].played
    shares = {k: round(c / sum(counts.values()), 3) for k, c in sorted(counts.items())}
    print(f"default: chains and trees played (share of cycles, warm-ups included): {shares}")
    for v, counts in budgets.items():
        shares = {b: round(c / sum(counts.values()), 3) for b, c in sorted(counts.items())}
        print(f"{v} tree sizes (share of cycles, 0: a plain step): {shares}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "summary": summary, "chosen": share}, f, indent=1)


if __name__ == "__main__":
    main()
