"""Host time of one speculative cycle against one mlx-lm decoding step: graph building and
bookkeeping only, nothing evaluated.

    python benchmarks/host_time.py                          # Qwen3-4B's and Qwen3-8B's shapes
    python benchmarks/host_time.py --shapes qwen3-8b --rounds 60 --json host.json
    python benchmarks/host_time.py --kernels none     # mlx-lm's forward, as on a GPU without ours

On a GPU the device computes a step while the host builds the next one's graph; whatever the
host spends per token beyond that is where the device waits. That host work is the same
Python and MLX graph building on every backend, so it is measured here without one: random
weights in the published shapes (`cycle_cost.SHAPES`, bf16) are created lazily and never
evaluated, so nothing is allocated (the peak memory is printed to show it), and the caches
hold `--context` positions of lazy zeros, fresh at every round: caches that kept each round's
graph made the process grow by a forward's graph a round, and each shape's figures then
depended on which was measured first (`detached`).

Measured, in one process, each a median over `--rounds` interleaved rounds (ms), each round
starting one case further along (what a round measures first costs more); a cycle in
mlx-lm steps is the median of its rounds' ratios (each cycle over the step of its own round):

- mlx-lm's step: the graph `mlx_lm.generate_step` builds per token (`_step`: the model over
  one token, the last position's log-probabilities, the greedy sampler);
- the loop's cycle, as `cycle.launch` and `cycle.settle` run it for one reply: for a chain of
  block 16, a tree of 8 and a plain step (block 1). Within the chain: the plan, the drafter's
  graph (`proposers.chains`), and the verify forward with its verdict; `launch` is all of that
  and its bookkeeping, `settle` the commit after the device's answer. The device's work is
  stubbed for the measurement alone: `mx.async_eval` returns at once and the one read of the
  verdicts (a tree's with its nodes, built on the device) returns every draft rejected. What
  a GPU adds per primitive when it dispatches a graph is not in these figures.

`--kernels cpu` (the default) builds the forwards as this CPU runs them (compiled norms and
RoPEs, `cpu_math`'s exps: more primitives than a GPU's forward); `--kernels none` as a backend
without this package's kernels builds them (mlx-lm's modules as they are), the nearest this
machine comes to a GPU's graph.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx
import numpy as np

# isort: on

from cycle_cost import DRAFT_LAYERS, random_target

from dflash_mlx.decode import cycle, proposers
from dflash_mlx.decode.cycle import Mark, Reply, ReplyState, Root, RowRequest
from dflash_mlx.decode.plan import resolve
from dflash_mlx.decode.prompt_cache import make_prompt_cache
from dflash_mlx.decode.proposers import DrafterProposer, LookupProposer
from dflash_mlx.decode.settings import GenerationSettings
from dflash_mlx.models import backends
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.target import TargetAdapter

CASES = {  # what each measured cycle verifies
    "chain 16": dict(block_size=16, adaptive=False),
    "tree 8": dict(tree_budget=8, adaptive=False),
    "block 1": dict(block_size=1),
}


@contextmanager
def device_stubbed(kernels: str) -> Iterator[None]:
    """The device's answers stubbed while a cycle's host work is measured: no evaluation is
    queued, the verdicts (and a tree's nodes) read as every draft rejected; with `kernels`
    "none" the forwards are built as on a backend without this package's kernels."""
    async_eval, read, current = mx.async_eval, cycle.read_together, backends.current

    def rejected(arrays: list[mx.array], dtype: mx.Dtype) -> list[np.ndarray]:
        """Zeros, the last array (a chain's token after its drafts, a tree's choices) -1:
        every draft rejected, chain or tree."""
        values = [np.zeros(a.shape, dtype=np.int32) for a in arrays]
        values[-1] -= 1
        return values

    mx.async_eval = lambda *arrays: None
    cycle.read_together = rejected
    if kernels == "none":
        backends.current = lambda: None
    try:
        yield
    finally:
        mx.async_eval, cycle.read_together, backends.current = async_eval, read, current


def lazy_context(caches: list, positions: int, like: Callable[[int], tuple]) -> None:
    """Fill each cache with `positions` positions of lazy zeros of the shapes `like` gives."""
    for cache in caches:
        shape = like(positions)
        cache.update_and_fetch(mx.zeros(shape, mx.bfloat16), mx.zeros(shape, mx.bfloat16))


def make_reply(model, draft, target: TargetAdapter, settings: GenerationSettings, context: int):
    """A reply of `settings` whose caches hold `context` lazy positions, as `stream_generate`
    makes one (no scheduler: its cycles are launched and settled by hand)."""
    args = model.args
    cache = make_prompt_cache(model, draft)
    kv = lambda n: (1, args.num_key_value_heads, n, args.head_dim)  # noqa: E731
    lazy_context(cache.target, context, kv)
    cfg = draft.config
    lazy_context(cache.draft, context, lambda n: (1, cfg.num_key_value_heads, n, cfg.head_dim))
    cache.tokens = np.random.default_rng(0).integers(4, 1000, size=context).tolist()
    plan = resolve(settings, draft, target, cache.target)
    verifier = settings.verifier.for_reply()
    proposer = DrafterProposer(draft, target, cache.draft, verifier.propose)
    if plan.lookup:
        proposer = LookupProposer(cache.tokens, proposer)
    state = ReplyState(target, cache, proposer, verifier)
    return Reply(state, plan, cache.tokens + [5], 10**6, set())


def detached(caches: list) -> None:
    """Each cache's arrays as fresh lazy zeros of their shapes: nothing is evaluated, so a
    cache's arrays would otherwise hold the graphs of every round before (a process whose
    memory grows by a forward's graph a round, unlike a decoding one's)."""
    for cache in caches:
        for name in ("keys", "values"):
            array = getattr(cache, name, None)
            if isinstance(array, mx.array):
                setattr(cache, name, mx.zeros(array.shape, array.dtype))


def timed(work: Callable[[], object]) -> tuple[float, object]:
    tic = time.perf_counter()
    out = work()
    return 1e3 * (time.perf_counter() - tic), out


def mlx_lm_step(model, cache) -> float:
    """ms to build the graph of mlx-lm's `generate_step` for one token (its `_step`)."""
    y = mx.array([5])

    def step():
        logits = model(y[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)

    ms, _ = timed(step)
    for c in cache:
        c.trim(1)
    return ms


def cycle_parts(reply: Reply) -> dict[str, float]:
    """ms of one cycle's host work for `reply`, by part; its caches are put back after."""
    state, policy = reply.state, reply.policy
    mark = Mark.of(state)
    rows = [RowRequest(reply, Root.known(5), policy)]
    out = {}
    out["plan"], plans = timed(lambda: cycle._plans(rows))
    if not plans[0].tree and plans[0].drafts:
        n = plans[0].drafts
        out["drafter graph"], chains = timed(
            lambda: proposers.chains([proposers.ChainRequest(state.proposer, mx.array([5]), n)])
        )
        drafts = chains[0][0]
        tokens = mx.concatenate([mx.array([5], dtype=mx.uint32), drafts])

        def verify():
            forward = state.target.forward(
                tokens[None], [state.cache], taps=state.proposer.layer_ids
            )
            return state.verifier.verify(drafts, None, forward.logits[0], None)

        out["verify graph + verdict"], _ = timed(verify)
        mark.put_back(state)
    out["launch"], pending = timed(lambda: cycle.launch(rows))
    out["settle"], _ = timed(lambda: cycle.settle(pending, time.perf_counter()))
    out["cycle"] = out["launch"] + out["settle"]
    mark.put_back(state)
    return out


def measure(shape: str, rounds: int, context: int, kernels: str) -> dict:
    model = random_target(shape)
    model.set_dtype(mx.bfloat16)
    draft = init_draft(model, num_layers=DRAFT_LAYERS[shape], block_size=16, seed=1, lazy=True)
    target = TargetAdapter(model)
    step_cache = target.make_cache()
    args = model.args
    lazy_context(step_cache, context, lambda n: (1, args.num_key_value_heads, n, args.head_dim))
    replies = {
        case: make_reply(model, draft, target, GenerationSettings(**kw), context)
        for case, kw in CASES.items()
    }
    samples: dict[str, list[float]] = {"mlx-lm step": []}
    order = [None, *replies]  # None: mlx-lm's step; each round starts one further along
    with device_stubbed(kernels):
        for turn in range(rounds + 2):  # the first two rounds compile and warm caches
            detached(step_cache)
            for reply in replies.values():
                detached(cycle.cycle_caches(reply.state))
            for case in order[turn % len(order) :] + order[: turn % len(order)]:
                if case is None:
                    samples["mlx-lm step"].append(mlx_lm_step(model, step_cache))
                    continue
                for part, ms in cycle_parts(replies[case]).items():
                    samples.setdefault(f"{case}: {part}", []).append(ms)
    medians = {name: statistics.median(values[2:]) for name, values in samples.items()}
    steps = samples["mlx-lm step"][2:]  # each cycle in steps of its own round: load cancels
    ratios = {
        case: statistics.median(c / s for c, s in zip(samples[f"{case}: cycle"][2:], steps))
        for case in CASES
    }
    return {"ms": medians, "steps": ratios, "peak_memory_mb": mx.get_peak_memory() / 2**20}


def report(shape: str, kernels: str, results: dict) -> None:
    memory = results["peak_memory_mb"]
    print(f"{shape}, bf16, kernels {kernels} (lazy random weights; peak memory {memory:.1f} MiB)")
    for name, ms in results["ms"].items():
        print(f"  {name:<36} {ms:7.2f} ms")
    for case, ratio in results["steps"].items():
        print(f"  {case} cycle / mlx-lm step: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-4b,qwen3-8b")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--context", type=int, default=512, help="positions the caches hold")
    parser.add_argument("--kernels", choices=("cpu", "none"), default="cpu")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {}
    for shape in args.shapes.split(","):
        results[shape] = measure(shape, args.rounds, args.context, args.kernels)
        report(shape, args.kernels, results[shape])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
