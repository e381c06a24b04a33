"""Benchmark DFlash (or the target's own MTP layers, `--draft mtp`) against mlx-lm's own
decoding, on the same target and prompts.

python -m dflash_mlx.cli.bench --limit 6 --max-tokens 64 --out bench.json --plot bench.png

Per prompt, interleaved in one process: mlx-lm's `stream_generate` (the
autoregressive baseline), then DFlash's, both timed from outside (the clean
pass: all tok/s, TTFT and speedups come from it). Then an instrumented DFlash
pass splits each verify cycle into drafter / verify / rollback / host time: the
drafter, the target model and its caches get per-instance timing subclasses for
that pass only, which force evaluation inside each timed call. Forcing
serialises MLX's lazy pipeline, so that pass only splits a cycle; its
throughput is not reported. Without `--draft` the drafter is randomly
initialised (from `--seed`): its acceptance is meaningless, its costs are real.
Under `mlx.launch` every rank runs the whole benchmark on the sharded target in
lockstep (rank 0's prompts); rank 0 alone prints and writes the results.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..chat_format import render
from ..decode.plan import resolve
from ..decode.prompt_cache import PromptCache, make_prompt_cache
from ..decode.sampling import RULES
from ..decode.settings import GenerationSettings
from ..generate import stream_generate
from ..models.checkpoint import MTP, init_draft, load_draft
from ..models.distributed import Lockstep, is_rank0, share, world_group
from ..models.draft import KERNEL_BACKENDS, DFlashDraft
from ..models.loading import DTYPES, KEEP_CHECKPOINT
from ..models.mtp import MTPDraft, MTPRow
from ..models.target import TargetAdapter, load
from ..native.blas import active_blas
from ..native.swaps import swapped
from ..options import (
    add_draft_window_argument,
    add_mtp_bits_argument,
    add_rank_timeout_argument,
    add_trust_remote_code_argument,
)
from ..response import GenerationResponse

PROMPTS_FILE = Path(__file__).parent.parent / "data" / "bench_prompts.json"
PARTS = ("draft", "context", "verify", "rollback")
PART_LABELS = {
    "draft": "draft forward",
    "context": "draft context append",
    "verify": "verify forward",
    "rollback": "rollback",
    "host": "host (sampling, bookkeeping)",
}
VERIFY_REPS = 10
RANDOM_DRAFTER_WARNING = (
    "bench: WARNING: no --draft-model: the drafter is RANDOM (untrained), so its acceptance, "
    "tau and speedups mean nothing; only its costs are real"
)
NOTE = (
    "tok/s, TTFT and speedups come from a clean pass (AR and speculative decoding interleaved "
    "per prompt); the cycle split comes from a separate instrumented pass that forces "
    "evaluation inside each timed call (so its cycles are slower than the clean pass's)."
)


def chosen_prompts(args: argparse.Namespace) -> list[dict[str, str]]:
    """The prompts `--prompts`, `--category` and `--limit` choose (a one-line error for a
    category no prompt has)."""
    prompts = load_prompts(args.prompts or PROMPTS_FILE)
    if args.category is not None:
        categories = sorted({str(p.get("category")) for p in prompts})
        prompts = [p for p in prompts if p.get("category") == args.category]
        if not prompts:
            raise ValueError(f"no prompt of category {args.category!r}; there are {categories}")
    return prompts[: args.limit]


def load_prompts(path: str | Path = PROMPTS_FILE) -> list[dict[str, str]]:
    """Prompts from a JSON list of strings or of {"prompt", "id"?, "category"?} objects."""
    items = json.loads(Path(path).read_text())
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty JSON list of prompts")
    prompts = []
    for i, item in enumerate(items):
        item = {"prompt": item} if isinstance(item, str) else item
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}: item {i} is neither a string nor has a string 'prompt'")
        prompts.append(
            {
                "id": str(item.get("id", f"p{i + 1:02d}")),
                "category": str(item.get("category", "")),
                "prompt": item["prompt"],
            }
        )
    return prompts


class Stopwatch:
    """Seconds per part, accumulated between laps (one lap per verify cycle)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.laps: list[dict[str, float]] = []

    def add(self, part: str, seconds: float) -> None:
        self.current[part] += seconds

    def lap(self) -> None:
        self.laps.append(self.current)
        self.current = dict.fromkeys(PARTS, 0.0)


Sync = Callable[[Any, tuple, dict], None]  # forces a timed call's work: (output, args, kwargs)


def _eval_output(out: Any, args: tuple, kwargs: dict) -> None:
    mx.eval(out)


def _eval_cache(out: Any, args: tuple, kwargs: dict) -> None:
    """`append_context` returns nothing: its work is what it writes to each row's caches (a
    DFlash row's K/V caches, an MTP row's waiting features)."""
    rows = args[1] if len(args) > 1 else kwargs.get("caches", kwargs.get("rows"))
    mx.eval([c.state for row in rows for c in ([row.cache] if isinstance(row, MTPRow) else row)])


def _eval_drafts(out: Any, args: tuple, kwargs: dict) -> None:
    """The MTP layers' chains (token and log q arrays) or trees (read already)."""
    mx.eval([a for _, a in tree_flatten(out) if isinstance(a, mx.array)])


def _no_sync(out: Any, args: tuple, kwargs: dict) -> None:
    """A cache `trim` only moves an offset: nothing lazy to force."""


@contextmanager
def timed(obj: Any, watch: Stopwatch, methods: dict[str, tuple[str, Sync]]) -> Iterator[None]:
    """Time `methods` ({name: (part, sync)}) of this one instance while the context is open.

    The instance gets a subclass of its own class (its class is restored after),
    so neither the loop nor any mlx-lm class knows about the bench.
    """
    cls = type(obj)

    def wrap(name: str, part: str, sync: Sync) -> Callable:
        def method(self, *args, **kwargs):
            tic = time.perf_counter()
            out = getattr(cls, name)(self, *args, **kwargs)
            sync(out, args, kwargs)
            watch.add(part, time.perf_counter() - tic)
            return out

        return method

    body = {name: wrap(name, part, sync) for name, (part, sync) in methods.items()}
    with swapped([(obj, cls, type(f"Timed{cls.__name__}", (cls,), body))]):
        yield


@dataclass
class Run:
    """One generation timed from the consumer's side (seconds since the call)."""

    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    cycles: list[tuple[int, int, int]] = field(default_factory=list)  # committed, acc., proposed
    peak_memory: float = 0.0
    text: str = ""
    kinds: Counter = field(default_factory=Counter)  # DFlash's cycles: trees, chains, plain


def measure(generate: Callable[[], Iterable], watch: Stopwatch | None = None) -> Run:
    """Consume one generation (mlx-lm's or DFlash's responses), stamping each response."""
    run = Run()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for r in generate():
        run.stamps.append(time.perf_counter() - tic)
        if watch is not None:
            watch.lap()
        new = r.tokens if isinstance(r, GenerationResponse) else [r.token]
        if isinstance(r, GenerationResponse) and len(run.stamps) > 1:
            run.cycles.append((len(new), r.accepted, r.proposed))
        run.tokens += new
        run.text += r.text
        run.peak_memory = r.peak_memory
    if run.stamps and isinstance(r, GenerationResponse) and r.drafting is not None:
        d = r.drafting  # the last response's counts: every cycle of the reply
        run.kinds = Counter(trees=d.trees, chains=d.chains, plain=d.plain)
    # mlx-lm queues the step after its last token on its own stream; under mlx.launch that
    # step's collectives must be done before the next run queues its own, on every rank alike
    mx.synchronize(generation_stream)
    mx.synchronize()
    return run


def cycle_kinds(runs: list[Run]) -> dict[str, int]:
    """DFlash's cycles by kind over `runs`: which strategy the policy actually played."""
    total = sum((r.kinds for r in runs), Counter())
    return {kind: total[kind] for kind in ("trees", "chains", "plain")}


def throughput(runs: list[Run]) -> dict[str, float]:
    """Decode tok/s (tokens after the first, over the time after it), end-to-end tok/s, TTFT."""
    tokens = sum(len(r.tokens) for r in runs)
    decode_time = sum(r.stamps[-1] - r.stamps[0] for r in runs)
    return {
        "generated_tokens": tokens,
        "decode_tps": (tokens - len(runs)) / decode_time if decode_time > 0 else float("nan"),
        "e2e_tps": tokens / sum(r.stamps[-1] for r in runs),
        "ttft_s": statistics.mean(r.stamps[0] for r in runs),
        "peak_memory_gb": max(r.peak_memory for r in runs),
    }


def acceptance(cycles: list[tuple[int, int, int]]) -> dict[str, Any]:
    """τ (committed tokens per cycle) and, per draft position k, the fraction of cycles
    that proposed at least k tokens and had the first k accepted."""
    depth = max((p for _, _, p in cycles), default=0)
    rates = []
    for k in range(1, depth + 1):
        reached = [a for _, a, p in cycles if p >= k]
        rates.append(sum(a >= k for a in reached) / len(reached))
    return {
        "cycles": len(cycles),
        "tau": statistics.mean(c for c, _, _ in cycles) if cycles else float("nan"),
        "per_position": rates,
    }


def cycle_split(run: Run, laps: list[dict[str, float]]) -> list[dict[str, float]]:
    """Seconds per part for each verify cycle; host = cycle time minus the timed parts."""
    split = []
    for k in range(1, len(run.stamps)):
        parts = dict(laps[k])
        parts["host"] = run.stamps[k] - run.stamps[k - 1] - sum(parts.values())
        split.append(parts)
    return split


def mean_split_ms(cycles: list[dict[str, float]]) -> dict[str, float]:
    keys = (*PARTS, "host")
    means = {k: 1e3 * statistics.mean(c[k] for c in cycles) if cycles else 0.0 for k in keys}
    return {**means, "cycle": sum(means.values())}


def divergence(
    model: nn.Module, prompt: list[int], ar: list[int], dflash: list[int]
) -> dict[str, Any] | None:
    """Where DFlash's tokens first leave AR's, and the target's top-2 logit gap there."""
    if ar == dflash:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ar, dflash)) if a != b), min(len(ar), len(dflash)))
    logits = model(mx.array(prompt + ar[:i])[None])[0, -1].astype(mx.float32)
    top = mx.argsort(-logits)[:2]
    first, second = top.tolist()
    return {
        "index": i,
        "ar_token": ar[i] if i < len(ar) else None,
        "dflash_token": dflash[i] if i < len(dflash) else None,
        "top2": [first, second],
        "top2_gap": (logits[first] - logits[second]).item(),
    }


def verify_cost(
    model: nn.Module, context: list[int], sizes: list[int], reps: int = VERIFY_REPS
) -> dict[str, float]:
    """Median ms of one target forward over `n` new positions after `context`, per n, each
    rolled back as a rejected block is (caches a trim cannot roll back included)."""
    target = TargetAdapter(model)
    cache = target.make_cache()
    mx.eval(target.forward(mx.array(context)[None], [cache], prompt=True).logits)
    costs = {}
    for n in sizes:
        x = mx.array((context * n)[:n])[None]
        times = []
        for _ in range(reps + 1):
            tic = time.perf_counter()
            mx.eval(target.forward(x, [cache]).logits)
            times.append(time.perf_counter() - tic)
            target.rollback(cache, n)
        costs[str(n)] = 1e3 * statistics.median(times[1:])
    return costs


def instrumented(
    model: nn.Module, draft: DFlashDraft | MTPDraft, generate: Callable[[PromptCache], Callable]
) -> tuple[Run, Stopwatch]:
    """One speculative generation with the drafter, target and target caches timed per call."""
    watch = Stopwatch()
    cache = make_prompt_cache(model, draft)
    drafting = (
        {"propose": ("draft", _eval_drafts), "trees": ("draft", _eval_drafts)}
        if isinstance(draft, MTPDraft)
        else {"draft_logits": ("draft", _eval_output)}
    )
    with ExitStack() as stack:
        stack.enter_context(
            timed(draft, watch, {**drafting, "append_context": ("context", _eval_cache)})
        )
        stack.enter_context(timed(model, watch, {"__call__": ("verify", _eval_output)}))
        for c in cache.target:
            stack.enter_context(timed(c, watch, {"trim": ("rollback", _no_sync)}))
        run = measure(generate(cache), watch)
    return run, watch


def bench(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    draft: DFlashDraft | MTPDraft,
    prompts: list[dict[str, str]],
    *,
    block_size: int | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 0.0,
    repeat: int = 1,
    baseline: bool = True,
    split: bool = True,
    chat: bool = True,
    seed: int = 0,
    adaptive: bool | None = None,
    acceptance_rule: str = "coupled",
    tree_budget: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the interleaved benchmark; the JSON-ready results (config left to the caller)."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    max_block = block_size or draft.config.block_size
    sampler = make_sampler(temperature, top_p)
    settings = GenerationSettings(
        block_size=block_size,
        temperature=temperature,
        top_p=top_p,
        adaptive=adaptive,
        acceptance=acceptance_rule,
        tree_budget=tree_budget,
    )
    # the policy a reply would start with; when adapting, each prompt goes on from the last
    plan = resolve(settings, draft, TargetAdapter(model), make_prompt_cache(model, draft).target)
    policy = plan.policy if plan.adapts else None

    def ar(ids: list[int], n: int) -> Callable[[], Iterable]:
        return lambda: mlx_lm.stream_generate(
            model, tokenizer, mx.array(ids), max_tokens=n, sampler=sampler
        )

    def dflash(ids: list[int], n: int, cache: Any = None) -> Callable[[], Iterable]:
        return lambda: stream_generate(
            model,
            draft,
            tokenizer,
            ids,
            settings=settings.but(max_tokens=n),
            prompt_cache=cache,
            block_policy=policy,
        )

    encoded = [render(tokenizer, p["prompt"], chat) for p in prompts]
    warm = min(max_tokens, 2 * max_block)
    for make in ([ar] if baseline else []) + [dflash]:
        measure(make(encoded[0], warm))

    records, all_ar, all_df, all_cycles, all_split = [], [], [], [], []
    for p, ids in zip(prompts, encoded):
        log(f"{p['id']}: {len(ids)} prompt tokens")
        ar_runs, df_runs = [], []
        for _ in range(repeat):
            if baseline:
                mx.random.seed(seed)
                ar_runs.append(measure(ar(ids, max_tokens)))
            mx.random.seed(seed)
            df_runs.append(measure(dflash(ids, max_tokens)))
        cycles = [c for r in df_runs for c in r.cycles]
        record: dict[str, Any] = {
            **p,
            "prompt_tokens": len(ids),
            "dflash": throughput(df_runs),
            "acceptance": acceptance(cycles),
            "cycle_kinds": cycle_kinds(df_runs),
            "dflash_text": df_runs[0].text,
        }
        if baseline:
            record["ar"] = throughput(ar_runs)
            record["speedup_decode"] = record["dflash"]["decode_tps"] / record["ar"]["decode_tps"]
            record["speedup_e2e"] = record["dflash"]["e2e_tps"] / record["ar"]["e2e_tps"]
            pair = next(((a, d) for a, d in zip(ar_runs, df_runs) if a.tokens != d.tokens), None)
            record["identical"] = pair is None
            record["divergence"] = pair and divergence(model, ids, pair[0].tokens, pair[1].tokens)
        if split:
            mx.random.seed(seed)
            run, watch = instrumented(model, draft, partial(dflash, ids, max_tokens))
            record["split_ms"] = mean_split_ms(cycle_split(run, watch.laps))
            all_split += cycle_split(run, watch.laps)
        records.append(record)
        all_ar += ar_runs
        all_df += df_runs
        all_cycles += cycles

    overall: dict[str, Any] = {
        "dflash": throughput(all_df),
        "acceptance": acceptance(all_cycles),
        "cycle_kinds": cycle_kinds(all_df),
    }
    if baseline:
        overall["ar"] = throughput(all_ar)
        overall["speedup_decode"] = overall["dflash"]["decode_tps"] / overall["ar"]["decode_tps"]
        overall["speedup_e2e"] = overall["dflash"]["e2e_tps"] / overall["ar"]["e2e_tps"]
        overall["identical"] = sum(r["identical"] for r in records)
        overall["prompts"] = len(records)
    if split:
        overall["split_ms"] = mean_split_ms(all_split)
    sizes = sorted({1, max(1, max_block // 2), max_block})
    return {
        "verify_cost_ms": verify_cost(model, encoded[0], sizes),
        "prompts": records,
        "overall": overall,
    }


def report(results: dict[str, Any]) -> None:
    """Print the results as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    cfg, overall = results["config"], results["overall"]
    system = cfg.get("system", "DFlash")
    console.print(
        f"[bold]target[/] {cfg['model']}  [bold]drafter[/] {cfg['draft']}  "
        f"[bold]block[/] {cfg['block_size']}  [bold]max tokens[/] {cfg['max_tokens']}  "
        f"[bold]temp[/] {cfg['temperature']}  [bold]repeat[/] {cfg['repeat']}"
    )
    console.print(f"[dim]{results['note']}[/]")
    baseline = "ar" in overall
    table = Table(title="Per prompt (decode tok/s after the first token | end-to-end tok/s)")
    for name in ("prompt", "in", "out", "AR tok/s", f"{system} tok/s", "speedup", "τ", "TTFT ms"):
        table.add_column(name, justify="left" if name == "prompt" else "right")
    if baseline:
        table.add_column("identical to AR")

    def row(name: str, r: dict[str, Any], prompt_tokens: str, end: bool = False) -> None:
        df = r["dflash"]
        cells = [name, prompt_tokens, str(df["generated_tokens"])]
        if baseline:
            cells.append(f"{r['ar']['decode_tps']:.1f} | {r['ar']['e2e_tps']:.1f}")
        else:
            cells.append("-")
        cells.append(f"{df['decode_tps']:.1f} | {df['e2e_tps']:.1f}")
        if baseline:
            cells.append(f"{r['speedup_decode']:.2f}x | {r['speedup_e2e']:.2f}x")
        else:
            cells.append("-")
        cells.append(f"{r['acceptance']['tau']:.2f}")
        ttft = f"{1e3 * df['ttft_s']:.0f}"
        cells.append(f"{1e3 * r['ar']['ttft_s']:.0f} | {ttft}" if baseline else ttft)
        if baseline:
            cells.append(identical_cell(r))
        table.add_row(*cells, end_section=end)

    for r in results["prompts"]:
        row(r["id"], r, str(r["prompt_tokens"]))
    table.add_section()
    row("overall", overall, "")
    console.print(table)

    rates = overall["acceptance"]["per_position"]
    console.print(
        "Acceptance per draft position: "
        + "  ".join(f"{k}:{rate:.2f}" for k, rate in enumerate(rates, 1))
    )
    kinds = overall["cycle_kinds"]
    console.print(f"{system} cycles: " + ", ".join(f"{kind} {n}" for kind, n in kinds.items()))
    console.print(f"Peak memory: {overall['dflash']['peak_memory_gb']:.3f} GB ({system})")
    if "split_ms" in overall:
        split = Table(title=f"{system} cycle split (instrumented pass, forced evaluation)")
        split.add_column("part")
        split.add_column("ms / cycle", justify="right")
        split.add_column("share", justify="right")
        total = overall["split_ms"]["cycle"]
        for key, label in PART_LABELS.items():
            ms = overall["split_ms"][key]
            split.add_row(label, f"{ms:.2f}", f"{ms / total:.0%}")
        split.add_row("cycle", f"{total:.2f}", "100%")
        console.print(split)
    verify = Table(title="Target forward over n new positions (verify cost)")
    verify.add_column("n", justify="right")
    verify.add_column("ms", justify="right")
    verify.add_column("ms / position", justify="right")
    for n, ms in results["verify_cost_ms"].items():
        verify.add_row(n, f"{ms:.2f}", f"{ms / int(n):.2f}")
    console.print(verify)


def identical_cell(r: dict[str, Any]) -> str:
    if "prompts" in r:
        return f"{r['identical']}/{r['prompts']}"
    if r["identical"]:
        return "yes"
    d = r["divergence"]
    return f"no: token {d['index']}, top-2 gap {d['top2_gap']:.3g}"


def plot(results: dict[str, Any], path: str | Path) -> None:
    """PNG: acceptance rate per draft position; speedup per prompt (with a baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall, records = results["overall"], results["prompts"]
    baseline = "ar" in overall
    fig, axes = plt.subplots(1, 2 if baseline else 1, figsize=(12 if baseline else 6, 4))
    axes = list(axes) if baseline else [axes]
    rates = overall["acceptance"]["per_position"]
    axes[0].bar(range(1, len(rates) + 1), rates)
    axes[0].set(
        title=f"Acceptance per draft position (τ = {overall['acceptance']['tau']:.2f})",
        xlabel="draft position",
        ylabel="rate",
        ylim=(0, 1),
    )
    if baseline:
        axes[1].bar([r["id"] for r in records], [r["speedup_decode"] for r in records])
        axes[1].axhline(1.0, color="grey", linewidth=1)
        axes[1].set(
            title=f"Decode speedup over mlx-lm (overall {overall['speedup_decode']:.2f}x)",
            ylabel=f"{results['config'].get('system', 'DFlash')} / AR decode tok/s",
        )
        axes[1].tick_params(axis="x", rotation=90)
    fig.suptitle(f"{results['config']['model']} | {results['config']['draft']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target model dir or hub id (default: SmolLM2-135M)")
    parser.add_argument(
        "--draft-model",
        "--draft",
        dest="draft",
        metavar="DRAFT_MODEL",
        help="drafter dir or hub id; 'mtp': the target's own MTP layers (default: a random "
        "drafter, said on stderr)",
    )
    add_mtp_bits_argument(parser)
    parser.add_argument(
        "--dtype",
        choices=[*DTYPES, KEEP_CHECKPOINT],
        help="the target's dtype (default: float32 on the CPU; checkpoint: keep its quantization)",
    )
    parser.add_argument(
        "--draft-layers", type=int, default=1, help="layers of the random drafter (no --draft)"
    )
    parser.add_argument("--block-size", type=int, help="default: the drafter's (16 if random)")
    parser.add_argument("--max-tokens", "-m", type=int, default=128, help="most tokens per reply")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus when sampling (0: off)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per prompt and system")
    parser.add_argument("--prompts", help="JSON prompt list (default: the built-in suite)")
    parser.add_argument("--limit", type=int, help="use only the first N prompts (default: all)")
    parser.add_argument(
        "--category",
        help="use only the prompts of this category (coding, math, chat; default: all)",
    )
    parser.add_argument("--no-chat-template", action="store_true", help="use prompts raw")
    parser.add_argument("--no-baseline", action="store_true", help="skip mlx-lm's decoding")
    parser.add_argument("--no-split", action="store_true", help="skip the instrumented pass")
    parser.add_argument(
        "--kernels", default="auto", choices=KERNEL_BACKENDS, help="drafter block attention"
    )
    parser.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        help="choose each cycle's block size by measured cost "
        "(default: on for greedy decoding without --block-size)",
    )
    parser.add_argument(
        "--acceptance", default="coupled", choices=RULES, help="the rule for sampled drafts"
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        help="verify trees of up to N draft tokens (default: chains, or by cost)",
    )
    add_draft_window_argument(parser)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sampling and of the random drafter"
    )
    add_trust_remote_code_argument(parser)
    add_rank_timeout_argument(parser)
    parser.add_argument("--out", default="dflash_bench.json", help="JSON results file")
    parser.add_argument("--plot", default=None, help="PNG plot file (default: --out as .png)")


def run(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "repeat", "draft_layers", "block_size", "limit", "tree_budget"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    group = world_group()  # under mlx.launch: rank 0 reads the prompts and alone writes
    prompts = share(lambda: chosen_prompts(args), group)
    if args.model is None:
        from ..models.gguf import smollm2_model_dir

        args.model = str(smollm2_model_dir())
    if is_rank0(group):
        print(f"bench: loading {args.model}...", file=sys.stderr, flush=True)
    model, tokenizer = load(
        args.model,
        dtype=args.dtype,
        tensor_group=group,
        trust_remote_code=args.trust_remote_code,
    )
    if args.draft:
        draft = load_draft(
            args.draft,
            kernels=args.kernels,
            context_window=args.draft_window,
            target=args.model,
            mtp_bits=args.mtp_bits,
        )
        draft_label = "the target's MTP layers" if args.draft == MTP else args.draft
    else:
        mx.random.seed(args.seed)  # the same drafter on every rank
        draft = init_draft(
            model,
            num_layers=args.draft_layers,
            block_size=args.block_size or 16,
            kernels=args.kernels,
            context_window=args.draft_window,
        )
        draft_label = f"random drafter ({args.draft_layers} layers)"
        if is_rank0(group):
            print(RANDOM_DRAFTER_WARNING, file=sys.stderr, flush=True)
    lockstep = Lockstep(group, args.rank_timeout, "dflash-mlx bench")

    def log(message: str) -> None:  # once per prompt: progress for the watchdog
        lockstep.beat()
        if lockstep.leader:
            print(message, file=sys.stderr)

    log(f"bench: {len(prompts)} prompts, target {args.model}, {draft_label}")
    with lockstep.watched():
        results = bench(
            model,
            tokenizer,
            draft,
            prompts,
            block_size=args.block_size,
            max_tokens=args.max_tokens,
            temperature=args.temp,
            top_p=args.top_p,
            repeat=args.repeat,
            baseline=not args.no_baseline,
            split=not args.no_split,
            chat=not args.no_chat_template,
            seed=args.seed,
            adaptive=args.adaptive,
            acceptance_rule=args.acceptance,
            tree_budget=args.tree_budget,
            log=log,
        )
    results = {
        "config": {
            "model": args.model,
            "draft": draft_label,
            "dtype": args.dtype,
            "random_draft": args.draft is None,
            "system": "MTP" if isinstance(draft, MTPDraft) else "DFlash",
            "block_size": args.block_size or draft.config.block_size,
            "max_tokens": args.max_tokens,
            "temperature": args.temp,
            "top_p": args.top_p,
            "adaptive": args.adaptive,
            "acceptance": args.acceptance,
            "tree_budget": args.tree_budget,
            "draft_window": args.draft_window,
            "repeat": args.repeat,
            "chat_template": not args.no_chat_template,
            "prompts": str(args.prompts or PROMPTS_FILE),
            "command": " ".join(sys.argv),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "device": str(mx.default_device()),
            "blas": active_blas(),
            "platform": f"{platform.system()} {platform.machine()}",
        },
        "note": NOTE,
        **results,
    }
    if not lockstep.leader:
        return
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    png = args.plot or str(Path(args.out).with_suffix(".png"))
    plot(results, png)
    print(f"wrote {args.out} and {png}", file=sys.stderr)


if __name__ == "__main__":
    from . import run_as_module

    run_as_module("bench")
