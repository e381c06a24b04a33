"""What a DFlash 2 selector-scored draft tree costs next to an ordinary one (issue 19).

The drafter is the shipped SmolLM2 drafter grown into a DFlash 2 one as
`dflash-mlx train fit --init-from ... --arch dflash2` does (convolutions start
as the identity), with the selector at the published top-16 and rank 256 and
random, non-zero codebooks: its trees are selector trees of the real shape,
its acceptance says nothing. The same drafter without its selector builds the
ordinary tree (per-position top-N of the same logits). Two measurements, every
variant interleaved in one process:

- the tree's build from one block's drafter output (hidden states and logits
  already evaluated): the device part up to the one host read (selector: the
  (T, K, K) edge log-probabilities and their sort; ordinary: the top-N), then
  the host's best-first search; median of `--repeats`;
- the whole tree cycle: decoding `--max-tokens` tokens with `tree_budget`, the
  decode time over the cycles.

    python benchmarks/selector_tree.py --budgets 4,8,16,32
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

import mlx.core as mx
from mlx.utils import tree_flatten

from dflash_mlx import load, load_draft, make_prompt_cache, stream_generate
from dflash_mlx.bench import measure, render
from dflash_mlx.demo import DEFAULT_PROMPT, SHIPPED_DRAFTER
from dflash_mlx.draft import DFlashDraft
from dflash_mlx.gguf import smollm2_model_dir
from dflash_mlx.target import TargetAdapter
from dflash_mlx.train.trainer import DFlash2Shape, grow_draft
from dflash_mlx.tree import build_selector_tree, build_tree, ranked_edges, top_candidates


def selector_and_plain(rank: int, top_k: int) -> tuple[DFlashDraft, DFlashDraft]:
    """The shipped drafter grown into DFlash 2 (random codebooks), and the same without
    its selector."""
    source = load_draft(str(SHIPPED_DRAFTER))
    source.set_dtype(mx.float32)
    shape = DFlash2Shape(selector_top_k=top_k, selector_rank=rank)
    draft = grow_draft(source, source.config.num_hidden_layers, shape)
    selector = draft.candidate_selector
    mx.random.seed(0)
    selector.predecessor_codebook = mx.random.normal(selector.predecessor_codebook.shape)
    selector.successor_codebook = mx.random.normal(selector.successor_codebook.shape) / rank**0.5
    plain = DFlashDraft(replace(draft.config, selector_top_k=0, selector_rank=0))
    weights = [(k, v) for k, v in tree_flatten(draft.parameters()) if "selector" not in k]
    plain.load_weights(weights)
    mx.eval(draft.parameters(), plain.parameters())
    return draft, plain


def build_times(model, tokenizer, draft, ids, budgets, repeats) -> dict[str, list[float]]:
    """Milliseconds per build part, per variant: (device + read, host search) medians."""
    target = TargetAdapter(model)
    cache = make_prompt_cache(model, draft)
    *_, last = stream_generate(model, draft, tokenizer, ids, max_tokens=2, prompt_cache=cache)
    block_size = draft.config.block_size
    block = mx.array([last.tokens[-1]] + [draft.config.mask_token_id] * (block_size - 1))
    head = target.draft_head(draft.config.draft_vocab)
    hidden = draft.mask_hidden(block, target.embed_tokens, cache.draft)
    logits = draft.head_logits(hidden, head)
    columns = draft.head_logits(hidden, head.rows)  # as the loop ranks an ordinary tree's
    mx.eval(hidden, logits, columns)
    selector = draft.candidate_selector
    builders = {
        "plain": (lambda b: top_candidates(columns, b, head.token_ids), build_tree),
        "selector": (
            lambda b: ranked_edges(*selector.edge_logprobs(hidden, logits, block[0])),
            build_selector_tree,
        ),
    }
    times = {f"{kind}-{b}": ([], []) for b in budgets for kind in builders}
    for r in range(repeats):
        for b in budgets:
            for kind in sorted(builders, reverse=r % 2 == 1):  # each goes first half the time
                device, search = builders[kind]
                tic = time.perf_counter()
                lists = device(b)
                mid = time.perf_counter()
                search(0, *lists, b)
                times[f"{kind}-{b}"][0].append(mid - tic)
                times[f"{kind}-{b}"][1].append(time.perf_counter() - mid)
    return {k: [1e3 * statistics.median(part) for part in v] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="4,8,16,32")
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="decoding runs per variant")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]

    model, tokenizer = load(smollm2_model_dir())
    draft, plain = selector_and_plain(args.rank, args.top_k)
    ids = render(tokenizer, DEFAULT_PROMPT, chat=True)
    print(f"load average at the start: {os.getloadavg()}", flush=True)

    builds = build_times(model, tokenizer, draft, ids, budgets, args.repeats)
    print(f"tree build, ms (median of {args.repeats}): device + read | host search | total")
    for name, (device, host) in builds.items():
        print(f"  {name:>12}: {device:6.3f} | {host:6.3f} | {device + host:6.3f}")

    cycles: dict[str, list[tuple[float, int, int]]] = {k: [] for k in builds}
    for _ in range(args.rounds):
        for b in budgets:
            for name, drafter in ((f"plain-{b}", plain), (f"selector-{b}", draft)):
                for n in (8, args.max_tokens):  # a warm-up, then the run
                    setting = dict(max_tokens=n, tree_budget=b)
                    run = measure(
                        lambda d=drafter, s=setting: stream_generate(model, d, tokenizer, ids, **s)
                    )
                cycles[name].append(
                    (run.stamps[-1] - run.stamps[0], len(run.cycles), len(run.tokens) - 1)
                )
    print(f"load average at the end: {os.getloadavg()}")
    print("tree cycle: ms per cycle (decode time / cycles), tau, cycles; selector/plain by round")
    for name, runs in cycles.items():
        seconds, n, tokens = (sum(r[i] for r in runs) for i in range(3))
        line = f"  {name:>12}: {1e3 * seconds / n:7.1f} ms  tau {tokens / n:4.2f}  ({n} cycles)"
        if name.startswith("selector"):
            plain_runs = cycles[name.replace("selector", "plain")]
            ratios = [(s / c) / (p / d) for (s, c, _), (p, d, _) in zip(runs, plain_runs)]
            line += "  " + " ".join(f"{r:.2f}" for r in ratios)
        print(line)


if __name__ == "__main__":
    main()
