"""Offline study: should each tree cycle choose its own budget from the drafter's confidence?

    cd benchmarks && python tree_budget.py [--limit 12] [--max-tokens 64] [--out r.json]

For each prompt (the demo's, then the bench suite's, chat-templated as
`block_size.py` does) it takes the target's greedy reply (plain decoding), one
target forward over prompt + reply for the drafter's context features, and one
drafter forward from every reply position (the anchor: the last committed
token), as decoding would run it there. From each anchor's top candidates it
builds the tree of every budget 0..`--max-budget` (`tree.build_tree`) and walks
it against the greedy reply: the accepted length of that tree at that anchor. These are the
drafter's trees alone: the prompt lookup's chain that decoding grafts on (`lookup.py`) is not
modelled here (benchmarks/README.md, "Prompt lookup in trees", has its offline figures).

Then, along decoding's walk (a cycle that accepts L drafts moves the anchor
L + 1 tokens on):

- τ and tokens per unit of cost of every fixed budget, under a cost model c(b)
  measured here: the tree cycle's parts (drafter forward and top-k, tree build,
  tree forward, argmax) at the demo prompt's context, budgets interleaved, the
  minimum of `--repeats` timings each, in plain decoding steps (b = 0: a plain
  step without the drafter), then a least-squares line through the tree
  budgets (the loop's settle and context append are left out);
- the drafter's calibration: the share of tree nodes on the accepted path
  against their path probability under the drafter (exp of the summed
  log-probabilities `build_tree` ranks by);
- `adaptive.AdaptiveTree` itself fed those costs (choose b maximising E(b) / c(b)
  with E(b) = 1 + s Σ_{i≤b} p_i over the nodes best first, s its online
  calibration; plain steps without the drafter after b = 0 wins), with its
  skipping or its calibration turned off, and the oracle that knows each
  cycle's best budget, as a ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

import mlx.core as mx
import mlx_lm
import numpy as np

from dflash_mlx import load, load_draft
from dflash_mlx.adaptive import AdaptiveTree
from dflash_mlx.bench import PROMPTS_FILE, load_prompts, render
from dflash_mlx.demo import DEFAULT_PROMPT, SHIPPED_DRAFTER
from dflash_mlx.gguf import smollm2_model_dir
from dflash_mlx.target import TargetAdapter
from dflash_mlx.tree import ancestor_mask, build_tree, top_candidates, walk

COST_BUDGETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.01)


def anchor_candidates(model, draft, ids: list[int], prompt_len: int, block: int, k: int) -> list:
    """Per anchor j (reply positions prompt_len .. len - 2): the drafter's top-k per position."""
    target = TargetAdapter(model)
    cfg = draft.config
    with target.capture(cfg.target_layer_ids) as captured:
        model(mx.array(ids)[None])
        features = mx.concatenate([captured[i] for i in cfg.target_layer_ids], axis=-1)
    head = target.draft_head(cfg.draft_vocab)
    cache = draft.make_cache()
    draft.append_context(features[:, :prompt_len], cache)
    out = []
    for j in range(prompt_len, len(ids) - 1):
        block_ids = mx.array([ids[j]] + [cfg.mask_token_id] * (block - 1))
        logits = draft.draft_logits(block_ids, target.embed_tokens, head, cache)
        out.append(top_candidates(logits, k))
        draft.append_context(features[:, j : j + 1], cache)
    return out


def accepted_lengths(ids: list[int], j: int, candidates, max_budget: int) -> tuple[list, list]:
    """(accepted drafts of the tree of each budget 0..max_budget at anchor j, and for the
    largest tree: (path probability, accepted?) per node in best-first order)."""
    tree = build_tree(ids[j], *candidates, max_budget)

    def choose(node: int) -> int:
        after = j + tree.depths[node] + 1
        return ids[after] if after < len(ids) else -1

    path, _ = walk(tree, choose)
    on_path = set(path)
    nodes = [(p, n in on_path) for n, p in enumerate(tree.probabilities(), start=1)]
    # best-first order: the tree of budget b is the first b nodes, so it accepts the path's
    # nodes among them (a path is a prefix-closed chain, its nodes appear parents first)
    lengths = [sum(1 for n in path[1:] if n <= b) for b in range(max_budget + 1)]
    return lengths, nodes


def measured_costs(model, draft, ids: list[int], block: int, repeats: int) -> tuple[dict, float]:
    """A cycle's cost per budget in mlx-lm decoding steps, the tree cycle's parts run as the
    loop runs them at a context of `ids`: the drafter's forward and top-k, the tree's build,
    the tree forward and its argmax (b = -1: a plain step, no drafter; b = 0: a plain step
    after the drafter). Budgets interleaved, the minimum over `repeats` (robust to load)."""
    target, cfg = TargetAdapter(model), draft.config
    cache, draft_cache = target.make_cache(), draft.make_cache()
    with target.capture(cfg.target_layer_ids, cache) as captured:
        model(mx.array(ids[:-1])[None], cache=cache)
        features = mx.concatenate([captured[i] for i in cfg.target_layer_ids], axis=-1)
        draft.append_context(features, draft_cache)
        mx.eval([c.state for c in cache + draft_cache])
        head = target.draft_head(cfg.draft_vocab)
        last = ids[-1]

        def step() -> None:
            mx.eval(mx.argmax(model(mx.array([[last]]), cache=cache)[0, -1]))
            target.rollback(cache, 1)

        def tree_cycle(budget: int) -> None:
            block_ids = mx.array([last] + [cfg.mask_token_id] * (block - 1))
            logits = draft.draft_logits(block_ids, target.embed_tokens, head, draft_cache)
            candidates = top_candidates(logits, max(budget, 1))
            if budget == 0:
                return step()
            tree = build_tree(last, *candidates, budget)
            with target.tree_attention(cache, tree.depths, ancestor_mask(tree.parents)):
                logits = target.forward(mx.array(tree.tokens), cache)
            mx.eval(mx.argmax(logits, axis=-1))
            target.rollback(cache, len(tree))

        seconds: dict[int, list[float]] = {b: [] for b in (-1, *COST_BUDGETS)}
        for _ in range(repeats + 1):  # the first round warms up
            for b in seconds:
                tic = time.perf_counter()
                step() if b < 0 else tree_cycle(b)
                seconds[b].append(time.perf_counter() - tic)
    plain = min(seconds.pop(-1)[1:])
    return {b: min(s[1:]) / plain for b, s in seconds.items()}, plain


def interpolate(costs: dict[int, float], b: int) -> float:
    if b in costs:
        return costs[b]
    below = max(m for m in costs if m < b)
    above = min(m for m in costs if m > b)
    share = (b - below) / (above - below)
    return (1 - share) * costs[below] + share * costs[above]


def run_walk(records: list, choose) -> tuple[float, float, int]:
    """(tokens, cost, cycles) along decoding's walk; `choose(lengths, nodes, j)` gives the
    budget at anchor j and its cost."""
    tokens = cost = cycles = 0
    for lengths, nodes in records:
        j = 0
        while j < len(lengths):
            b, c = choose(lengths, nodes, j)
            accepted = lengths[j][b]
            tokens += accepted + 1
            cost += c
            cycles += 1
            j += accepted + 1
    return tokens, cost, cycles


def collect(model, draft, tokenizer, prompts: list, args) -> dict:
    """Per prompt: the accepted lengths and largest-tree nodes at every anchor (`records`), and
    the accepted lengths of budgets 4 and 8 drafted with their own block of b + 1 (`matched`)."""
    block = min(draft.config.block_size, args.max_budget + 1)
    data: dict = {"records": [], "matched": {4: [], 8: []}}
    for ids in prompts:
        reply = mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=args.max_tokens)
        full = ids + [r.token for r in reply]
        cands = anchor_candidates(model, draft, full, len(ids), block, args.max_budget)
        anchors = [
            accepted_lengths(full, len(ids) + a, c, args.max_budget) for a, c in enumerate(cands)
        ]
        data["records"].append(([a[0] for a in anchors], [a[1] for a in anchors]))
        for b in data["matched"]:
            small = anchor_candidates(model, draft, full, len(ids), b + 1, b)
            lengths = [accepted_lengths(full, len(ids) + a, c, b)[0] for a, c in enumerate(small)]
            data["matched"][b].append((lengths, None))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-budget", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7, help="cost model: timings per budget")
    parser.add_argument("--data", help="JSON cache of the collected anchors (read if present)")
    parser.add_argument("--out")
    args = parser.parse_args()
    print(f"load average at the start: {os.getloadavg()}", flush=True)

    model, tokenizer = load(smollm2_model_dir())
    draft = load_draft(str(SHIPPED_DRAFTER))
    texts = [DEFAULT_PROMPT] + [p["prompt"] for p in load_prompts(PROMPTS_FILE)]
    prompts = [render(tokenizer, t, chat=True) for t in texts[: args.limit]]
    block = min(draft.config.block_size, args.max_budget + 1)

    costs, step = measured_costs(model, draft, prompts[0], block, args.repeats)
    print(
        f"cost model (plain step {1000 * step:.1f} ms, load {os.getloadavg()[0]:.1f}), cycle in "
        "plain steps by budget: " + ", ".join(f"{b}: {c:.2f}" for b, c in costs.items()),
        flush=True,
    )
    # timings under load are noisy: the tree cycles' costs as a least-squares line in b
    trees = [b for b in costs if b > 0]
    slope, intercept = np.polyfit(trees, [costs[b] for b in trees], 1)
    costs = {0: costs[0], **{b: intercept + slope * b for b in trees}}
    print(f"fitted: a tree cycle costs {intercept:.2f} + {slope:.3f} b plain steps", flush=True)
    if args.data and os.path.exists(args.data):
        with open(args.data) as f:
            data = json.load(f)
        data["matched"] = {int(b): m for b, m in data["matched"].items()}
    else:
        data = collect(model, draft, tokenizer, prompts, args)
        if args.data:
            with open(args.data, "w") as f:
                json.dump(data, f)
    records = data["records"]
    print(f"data: {sum(len(r[0]) for r in records)} anchors", flush=True)

    def cost(b: int) -> float:
        """b = 0 here: a plain step with no drafter."""
        return 1.0 if b == 0 else interpolate(costs, b)

    results: dict = {"costs_in_steps": costs, "plain_step_ms": 1000 * step, "fixed": {}}
    for b in range(args.max_budget + 1):
        tokens, spent, cycles = run_walk(records, lambda lengths, nodes, j, b=b: (b, cost(b)))
        results["fixed"][b] = {"tau": tokens / cycles, "tokens_per_step": tokens / spent}
    for b, matched in data["matched"].items():
        tokens, spent, cycles = run_walk(matched, lambda lengths, nodes, j, b=b: (b, cost(b)))
        results[f"fixed {b}, own block"] = {
            "tau": tokens / cycles,
            "tokens_per_step": tokens / spent,
        }

    # calibration: nodes of the largest tree, by path probability
    flat = [n for _, nodes in records for cycle in nodes for n in cycle]
    p, hit = np.array([n[0] for n in flat]), np.array([n[1] for n in flat])
    bands = [(lo, hi, (p >= lo) & (p < hi)) for lo, hi in zip(BUCKETS, BUCKETS[1:])]
    results["calibration"] = {
        f"{lo:.2f}-{min(hi, 1):.2f}": {
            "nodes": int(inside.sum()),
            "predicted": float(p[inside].mean()),
            "accepted": float(hit[inside].mean()),
        }
        for lo, hi, inside in bands
        if inside.any()
    }

    def policy(**settings):
        """`AdaptiveTree` itself, fed the cost model's cycle times."""
        chooser = AdaptiveTree(args.max_budget, **settings)

        def choose(lengths, nodes, j):
            if not chooser.draft_next():
                return 0, 1.0
            probabilities = [n[0] for n in nodes[j]]
            b = chooser.budget(probabilities)
            spent = cost(b) if b else costs[0]
            chooser.record(probabilities[:b], lengths[j][b], spent)
            return b, spent

        return choose

    def oracle(lengths, nodes, j):
        b = max(range(args.max_budget + 1), key=lambda b: (lengths[j][b] + 1) / cost(b))
        return b, cost(b)

    policies = {
        "AdaptiveTree": policy(),
        "AdaptiveTree, never skipping": policy(min_probe_gap=0, max_probe_gap=0),
        "AdaptiveTree, uncalibrated": policy(decay=1.0, accepted=1e9, predicted=1e9),
        "oracle (knows each cycle)": oracle,
    }
    for name, choose in policies.items():
        tokens, spent, cycles = run_walk(records, choose)
        results[name] = {"tau": tokens / cycles, "tokens_per_step": tokens / spent}
    best_fixed = max(results["fixed"], key=lambda b: results["fixed"][b]["tokens_per_step"])
    print(f"{'variant':>28} {'tau':>5} {'tokens/step':>11}")
    for b in sorted({0, 1, 2, 3, 4, 8, 16, 32, best_fixed}):
        r = results["fixed"][b]
        print(f"{'fixed ' + str(b):>28} {r['tau']:5.2f} {r['tokens_per_step']:11.3f}")
    for name in ("fixed 4, own block", "fixed 8, own block", *policies):
        r = results[name]
        print(f"{name:>28} {r['tau']:5.2f} {r['tokens_per_step']:11.3f}")
    print("calibration (path probability band: predicted -> accepted, nodes):")
    for band, c in results["calibration"].items():
        print(f"  {band}: {c['predicted']:.3f} -> {c['accepted']:.3f} ({c['nodes']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), **results}, f, indent=1)


if __name__ == "__main__":
    main()
