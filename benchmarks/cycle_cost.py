"""What one speculative cycle costs, by part, counted in mlx-lm's own decoding steps.

    python benchmarks/cycle_cost.py                    # SmolLM2-135M's shape, random, fp32
    python benchmarks/cycle_cost.py --model smollm2    # the real SmolLM2-135M-Instruct
    python benchmarks/cycle_cost.py --model smollm2 \
        --draft dflash_mlx/drafters/smollm2-135m-instruct       # with the shipped drafter
    python benchmarks/cycle_cost.py --shape qwen3-8b --dtype bfloat16 --json q8b.json  # a GPU
    python benchmarks/cycle_cost.py --shape qwen3-8b --dtype bfloat16 -q 4   # 4-bit target
    python benchmarks/cycle_cost.py --shape qwen3-8b --dtype bfloat16 --tree-budgets 4,8,16,32

The same script runs on MLX's CPU, Metal and CUDA backends: everything runs on
`mx.default_device()` and every timing ends in an evaluation of what it timed.
For one target (`--model DIR`, or random weights in a published shape: `--shape`)
it measures, in ms and in mlx-lm decoding steps:

- mlx-lm's decoding step: `mlx_lm.stream_generate`, pipelined as mlx-lm runs it
  (step k+1's graph is built and queued while step k runs);
- the project's loop at block 1: `dflash_mlx.stream_generate(..., block_size=1)`, ms per token;
- one cycle at the drafter's block size: the loop with a drafter (default: random
  weights, which practically never match the target; the accepted drafts per cycle are
  reported), counting only cycles that verify a full block; split into the drafter's
  forward and the verify forward, each timed on its own (built, evaluated, argmax read;
  the verify, as in real cycles, over one more cached position each time, so work a
  backend caches by shape is paid as cycles pay it), and the host: cycle - draft - verify;
- the target forward over 1, 2, 4, 8, 16 new positions after the prompt, as the loop
  verifies (`TargetAdapter.forward`; the cache is trimmed back after each), by part. A
  part costs the full forward minus the same forward with that part replaced, on this
  model instance only and for that measurement only, by a stand-in of the same output
  shape that does no work (its input, or its input's first feature repeated):
  attention = the whole attention block (q/k/v/o projections, q/k norms, RoPE, cache
  update, SDPA), of which the q/k/v/o projections; the MLPs; norms and RoPE (every RMSNorm
  and RoPE, so it overlaps the attention block); the LM head; other = full - attention -
  MLPs - LM head (embedding, layer norms, residual adds). Graph building is the host time
  from the call until the lazy result is returned, before any evaluation;
- with `--tree-budgets`, for each budget: one tree forward over the budget's nodes + the
  root (the tree the drafter's top-k gives after the prompt: with random weights a flat
  one, every node a sibling at depth 1), and a whole tree cycle
  (`stream_generate(..., tree_budget=b)`), against the chain's 16-position verify.

Every timing is a median over `--rounds` interleaved rounds (each round measures
everything once, so a burst of load from other jobs hits every variant alike) of the
per-round medians. The prompt is `--prompt-tokens` random token ids; end-of-sequence
tokens do not stop generation, so every run generates `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.tokenizer_utils import TokenizerWrapper

# isort: on

from dflash_mlx import GenerationResponse, TargetAdapter, load, load_draft, stream_generate
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.target import TreeShape
from dflash_mlx.models.tree import ancestor_mask, ranked_tree

# Published configs (config.json on the hub) of the targets, with the drafter depth of
# z-lab's DFlash drafter for them (2 for SmolLM2: the project's shipped drafter).
SHAPES = {
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    "qwen3-4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
}
DRAFT_LAYERS = {"tiny": 1, "smollm2-135m": 2, "qwen3-4b": 5, "qwen3-8b": 5, "llama-3.1-8b": 5}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj"}


class IdTokenizer:
    """A tokenizer for random weights, where text means nothing: ids decode to their numbers."""

    eos_token_id = None
    bos_token = None
    chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Iterable[int], **kwargs) -> str:
        return "".join(f" {i}" for i in ids)

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("random weights have no chat template")


class Passthrough(nn.Module):
    """Stand-in for a part whose output has its input's shape (a layer's attention or MLP,
    a norm, RoPE): returns the input, so the part costs nothing."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return x


class Widened(nn.Module):
    """Stand-in for a projection: its input's first feature repeated to the output width.

    No matmul, but the result still depends on the input: a stand-in returning fresh
    zeros would let lazy evaluation skip everything before it.
    """

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return mx.broadcast_to(x[..., :1], (*x.shape[:-1], self.width))


class HeadlessEmbedding(nn.Module):
    """Stand-in for a tied embedding: embeds as before; as the LM head, it does no matmul."""

    def __init__(self, embedding: nn.Module, vocab: int):
        super().__init__()
        self.embedding = embedding
        self.head = Widened(vocab)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.embedding(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.head(x)


Pick = Callable[[str, nn.Module], bool]
Make = Callable[[nn.Module], nn.Module]


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.RMSNorm | nn.LayerNorm)


def ablations(model: nn.Module) -> dict[str, tuple[Pick, Make]]:
    """Which submodules each ablation replaces (by their name in the parent) and with what."""
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    vocab = TargetAdapter(model).vocab_size
    if "lm_head" in names:
        head: tuple[Pick, Make] = (lambda n, m: n == "lm_head", lambda m: Widened(vocab))
    else:  # tied: the embedding is the head
        head = (lambda n, m: n == "embed_tokens", lambda m: HeadlessEmbedding(m, vocab))
    return {
        "attention": (lambda n, m: n == "self_attn", lambda m: Passthrough()),
        "attention_projections": (
            lambda n, m: n in PROJECTIONS,
            lambda m: Widened(m.weight.shape[0]),
        ),
        "mlp": (lambda n, m: n == "mlp", lambda m: Passthrough()),
        "norms_rope": (lambda n, m: is_norm(m) or n == "rope", lambda m: Passthrough()),
        "lm_head": head,
    }


@contextmanager
def ablated(model: nn.Module, pick: Pick, make: Make) -> Iterator[None]:
    """Replace the picked submodules of this instance by stand-ins; put them back after."""
    swaps = []
    for name, module in model.named_modules():
        parent_path, _, leaf = name.rpartition(".")
        if name and pick(leaf, module):
            parent = model
            for part in filter(None, parent_path.split(".")):
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            swaps.append((parent, leaf, module))
    if not swaps:
        raise ValueError("an ablation found nothing to replace in this model")
    try:
        for parent, leaf, module in swaps:
            parent[leaf] = make(module)
        yield
    finally:
        for parent, leaf, module in swaps:
            parent[leaf] = module


def random_target(shape: str) -> nn.Module:
    config = SHAPES[shape]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    return module.Model(module.ModelArgs.from_dict(config))


def load_target(args: argparse.Namespace) -> tuple[nn.Module, TokenizerWrapper]:
    """The target in `--dtype` (and `--q-bits`), with a tokenizer that never stops on EOS."""
    dtype = DTYPES[args.dtype]
    if args.model:
        path = args.model
        if path == "smollm2":
            from dflash_mlx.models.gguf import smollm2_model_dir

            path = smollm2_model_dir()
        model, tokenizer = load(path, dtype=dtype)
    else:
        model, tokenizer = random_target(args.shape), TokenizerWrapper(IdTokenizer())
        model.set_dtype(dtype)
    if args.q_bits:
        nn.quantize(model, group_size=64, bits=args.q_bits)
    mx.eval(model.parameters())
    tokenizer.eos_token_ids = []
    return model, tokenizer


def make_draft(args: argparse.Namespace, model: nn.Module) -> nn.Module:
    dtype = DTYPES[args.dtype]
    if args.draft:
        return load_draft(args.draft, dtype=dtype)
    layers = args.draft_layers or DRAFT_LAYERS.get(args.shape, 2)
    draft = init_draft(model, num_layers=layers, block_size=args.block_size or 16, seed=1)
    draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    return draft


def median_gap_ms(stamps: list[float]) -> float:
    """Median ms between successive responses, leaving out the first (it follows the prefill)."""
    return 1e3 * statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))


class CycleCost:
    """Every measurement of one target and drafter; `round()` runs each once."""

    def __init__(self, model, tokenizer, draft, args: argparse.Namespace):
        self.model, self.tokenizer, self.draft = model, tokenizer, draft
        self.block = args.block_size
        rng = random.Random(0)
        vocab = TargetAdapter(model).vocab_size
        self.prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
        self.positions = sorted(set(args.positions) | {self.block})
        self.inputs = {
            n: mx.array([rng.randrange(vocab) for _ in range(n)])[None] for n in self.positions
        }
        self.ablations = ablations(model)
        self.target = TargetAdapter(model)
        self.cache, self.draft_cache = self.target.make_cache(), draft.make_cache()
        self.growing_cache = self.target.make_cache()  # the verify at a new length each time
        mx.eval(model(mx.array(self.prompt)[None], cache=self.growing_cache))
        layer_ids = draft.config.target_layer_ids
        prompt = mx.array(self.prompt)[None]
        prefill = self.target.forward(prompt, [self.cache], taps=layer_ids, prompt=True)
        draft.append_context(prefill.features, [self.draft_cache])
        mx.eval([c.state for c in self.cache + self.draft_cache])
        self.draft_head = self.target.draft_head(draft.config.draft_vocab)
        self.draft_block = mx.array(
            [[self.prompt[-1]] + [draft.config.mask_token_id] * (self.block - 1)]
        )
        self.trees = {b: self.draft_tree(b) for b in args.tree_budgets}

    def draft_tree(self, budget: int):
        """The tree a cycle after the prompt would verify: from the drafter's top-k."""
        logits = self.draft.draft_logits(
            self.draft_block, self.target.embed_tokens, self.target.lm_head, [self.draft_cache]
        )[0]
        return ranked_tree(mx.array(self.prompt[-1:]), logits, budget).read()

    def mlx_lm_step(self, max_tokens: int) -> float:
        responses = mlx_lm.stream_generate(
            self.model, self.tokenizer, mx.array(self.prompt), max_tokens=max_tokens
        )
        return median_gap_ms([time.perf_counter() for _ in responses])

    def loop_block1(self, max_tokens: int) -> float:
        responses = stream_generate(
            self.model, self.draft, self.tokenizer, self.prompt, block_size=1, max_tokens=max_tokens
        )
        return median_gap_ms([time.perf_counter() for _ in responses])

    def stamped(self, max_tokens: int, **settings) -> list[tuple[float, GenerationResponse]]:
        """The loop's responses at the block size, each with the time it arrived."""
        responses = stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            self.prompt,
            block_size=self.block,
            max_tokens=max_tokens,
            **settings,
        )
        return [(time.perf_counter(), r) for r in responses]

    def tree_cycle(self, budget: int, max_tokens: int) -> tuple[float, float]:
        """Median ms of a tree cycle at `budget` and the mean tokens it accepted."""
        stamps = self.stamped(max_tokens, tree_budget=budget)
        gaps = [(t1 - t0, r.accepted) for (t0, _), (t1, r) in zip(stamps[1:], stamps[2:])]
        return 1e3 * statistics.median(t for t, _ in gaps), statistics.mean(a for _, a in gaps)

    def tree_forward(self, budget: int) -> float:
        """ms of one tree forward over the budget's nodes + the root (built, run, argmaxes read)."""
        tree, offsets = self.trees[budget], [c.offset for c in self.cache]
        tic = time.perf_counter()
        shape = TreeShape(tree.depths, ancestor_mask(tree.parents))
        logits = self.target.forward(mx.array(tree.tokens)[None], [self.cache], [shape]).logits
        mx.argmax(logits, axis=-1).tolist()
        elapsed = time.perf_counter() - tic
        for c, offset in zip(self.cache, offsets):
            c.trim(c.offset - offset)
        return 1e3 * elapsed

    def cycle(self, max_tokens: int) -> tuple[float, list[int]]:
        """Median ms of the cycles that verify a full block, and their accepted counts.

        Response k+1 reports the cycle whose result the loop waits for between
        responses k and k+1; the last cycles are shorter when max_tokens cuts them.
        """
        stamps = self.stamped(max_tokens)
        full = [
            (t1 - t0, r.accepted)
            for (t0, _), (t1, r) in zip(stamps[1:], stamps[2:])
            if r.proposed == self.block - 1
        ]
        if not full:
            raise ValueError(f"no full cycle: raise --max-tokens above the block size {self.block}")
        return 1e3 * statistics.median(t for t, _ in full), [a for _, a in full]

    def draft_forward(self) -> float:
        tic = time.perf_counter()
        logits = self.draft.draft_logits(
            self.draft_block, self.target.embed_tokens, self.draft_head, [self.draft_cache]
        )
        mx.argmax(logits, axis=-1).tolist()
        return 1e3 * (time.perf_counter() - tic)

    def forward(self, n: int) -> tuple[float, float]:
        """(ms to build the graph, ms in all) of one target forward over n new positions,
        the loop's verify forward (`TargetAdapter.forward`)."""
        offsets = [c.offset for c in self.cache]
        tic = time.perf_counter()
        tokens = mx.argmax(self.target.forward(self.inputs[n], [self.cache]).logits, axis=-1)
        built = time.perf_counter()
        tokens.tolist()
        done = time.perf_counter()
        for c, offset in zip(self.cache, offsets):
            c.trim(c.offset - offset)
        return 1e3 * (built - tic), 1e3 * (done - tic)

    def verify_at_a_new_length(self) -> float:
        """ms of the block's verify forward (built, run, argmaxes read) as cycles meet it: one
        cached position more than the last time, in a cache of its own. A backend that
        caches work by shape (MLX's cuDNN attention) pays at every real cycle; `forward`
        repeats one shape."""
        n = self.block
        tic = time.perf_counter()
        logits = self.target.forward(self.inputs[n], [self.growing_cache]).logits
        mx.argmax(logits, axis=-1).tolist()
        elapsed = time.perf_counter() - tic
        for c in self.growing_cache:
            c.trim(n - 1)
        return 1e3 * elapsed

    def round(self, max_tokens: int, reps: int) -> dict[str, float]:
        """Each timing once, keyed by name; the forwards `reps` times each (their median),
        every variant once per repetition so that a burst of load hits them all."""
        out = {"mlx_lm_step": self.mlx_lm_step(max_tokens)}
        out["loop_block1"] = self.loop_block1(max_tokens)
        out["cycle"], accepted = self.cycle(max_tokens)
        out["accepted_per_cycle"] = statistics.mean(accepted)
        for b in self.trees:
            out[f"tree{b}/cycle"], out[f"tree{b}/accepted_per_cycle"] = self.tree_cycle(
                b, max_tokens
            )
        times = defaultdict(list)
        for _ in range(reps):
            times["draft"].append(self.draft_forward())
            times["verify"].append(self.verify_at_a_new_length())
            for b in self.trees:
                times[f"tree{b}/forward"].append(self.tree_forward(b))
            for n in self.positions:
                build, full = self.forward(n)
                times[f"{n}/graph_build"].append(build)
                times[f"{n}/full"].append(full)
                for name, (pick, make) in self.ablations.items():
                    with ablated(self.model, pick, make):
                        times[f"{n}/without_{name}"].append(self.forward(n)[1])
        return out | {key: statistics.median(ts) for key, ts in times.items()}


def summarize(rounds: list[dict[str, float]], bench: CycleCost) -> dict:
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    step = med["mlx_lm_step"]

    def timed(ms: float) -> dict[str, float]:
        return {"ms": ms, "steps": ms / step}

    verify = med["verify"]
    forward = {}
    for n in bench.positions:
        full = med[f"{n}/full"]
        ablated_ms = {name: med[f"{n}/without_{name}"] for name in bench.ablations}
        parts = {name: full - ms for name, ms in ablated_ms.items()}
        parts["other"] = full - parts["attention"] - parts["mlp"] - parts["lm_head"]
        parts["graph_build"] = med[f"{n}/graph_build"]
        forward[str(n)] = {
            "full": timed(full),
            "ablated_ms": ablated_ms,
            "parts_ms": parts,
            "vs_one_position": full / med[f"{bench.positions[0]}/full"],
        }
    return {
        "mlx_lm_step": timed(step),
        "loop_block1": timed(med["loop_block1"]),
        "cycle": {
            "block_size": bench.block,
            "accepted_per_cycle": med["accepted_per_cycle"],
            "cycle": timed(med["cycle"]),
            "draft": timed(med["draft"]),
            "verify": timed(verify),
            "host": timed(med["cycle"] - med["draft"] - verify),
        },
        "forward": forward,
        "trees": {
            str(b): {
                "nodes": len(tree),
                "depth": max(tree.depths),
                "accepted_per_cycle": med[f"tree{b}/accepted_per_cycle"],
                "cycle": timed(med[f"tree{b}/cycle"]),
                "forward": timed(med[f"tree{b}/forward"]),
            }
            for b, tree in bench.trees.items()
        },
    }


ROWS = (
    ("mlx_lm_step", "mlx-lm decoding step (pipelined)"),
    ("loop_block1", "project loop at block 1, per token"),
)
CYCLE_ROWS = (
    ("draft", "  draft forward (synced)"),
    ("verify", "  verify forward (synced), a new length"),
    ("host", "  host (cycle - draft - verify)"),
)
PART_COLUMNS = (
    ("graph_build", "build"),
    ("attention", "attention"),
    ("attention_projections", "(qkvo)"),
    ("mlp", "mlp"),
    ("norms_rope", "norm+rope"),
    ("lm_head", "lm_head"),
    ("other", "other"),
)


def report(results: dict) -> None:
    c, cycle = results["config"], results["cycle"]
    quantized = f", {c['q_bits']}-bit" if c["q_bits"] else ""
    print(
        f"\n{c['target']} ({c['weights']}, {c['dtype']}{quantized}) on {c['device']}; "
        f"drafter: {c['draft']}; prompt {c['prompt_tokens']} tokens, {c['max_tokens']} generated, "
        f"medians of {c['rounds']} rounds"
    )
    print(f"{'':40s}{'ms':>8s}{'steps':>8s}")
    cycle_label = (
        f"cycle at block {cycle['block_size']} ({cycle['accepted_per_cycle']:.2f} accepted)"
    )
    rows = [(label, results[key]) for key, label in ROWS] + [(cycle_label, cycle["cycle"])]
    rows += [(label, cycle[key]) for key, label in CYCLE_ROWS]
    for label, t in rows:
        print(f"{label:40s}{t['ms']:8.2f}{t['steps']:8.2f}")
    print("\ntarget forward over n new positions, ms; part = full - the forward without it")
    header = "".join(f"{title:>10s}" for _, title in PART_COLUMNS)
    print(f"{'n':>4s}{'full':>9s}{'steps':>7s}{'x n=1':>7s}{header}")
    for n, f in results["forward"].items():
        parts = "".join(f"{f['parts_ms'][key]:10.2f}" for key, _ in PART_COLUMNS)
        print(
            f"{n:>4s}{f['full']['ms']:9.2f}{f['full']['steps']:7.2f}"
            f"{f['vs_one_position']:7.2f}{parts}"
        )
    if results["trees"]:
        print("\ntree verification (--tree-budget), ms (steps)")
        print(
            f"{'budget':>7s}{'nodes':>7s}{'depth':>7s}{'forward':>16s}{'cycle':>16s}{'accepted':>10s}"
        )
        for b, t in results["trees"].items():
            forward, cycle = t["forward"], t["cycle"]
            print(
                f"{b:>7s}{t['nodes']:7d}{t['depth']:7d}"
                f"{forward['ms']:10.2f} ({forward['steps']:.2f}){cycle['ms']:10.2f} "
                f"({cycle['steps']:.2f}){t['accepted_per_cycle']:10.2f}"
            )


def measure(args: argparse.Namespace) -> dict:
    """Load the target and drafter, warm up, run the rounds; the results as written to JSON."""
    model, tokenizer = load_target(args)
    draft = make_draft(args, model)
    args.block_size = args.block_size or draft.config.block_size
    if args.max_tokens <= args.block_size + 2:
        raise ValueError(
            f"--max-tokens ({args.max_tokens}) must exceed the block size + 2 "
            f"({args.block_size + 2}) to time full cycles"
        )
    bench = CycleCost(model, tokenizer, draft, args)
    bench.round(args.block_size + 3, reps=1)  # warm-up: kernels, buffers, caches
    rounds = [bench.round(args.max_tokens, args.reps) for _ in range(args.rounds)]
    return {
        "config": {
            "target": args.model or args.shape,
            "weights": "checkpoint" if args.model else "random",
            "dtype": args.dtype,
            "q_bits": args.q_bits,
            "device": str(mx.default_device()),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "draft": args.draft or f"random, {len(draft.layers)} layers",
            "block_size": args.block_size,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "reps": args.reps,
            "tree_budgets": args.tree_budgets,
        },
        **summarize(rounds, bench),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        results = measure(args)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"cycle_cost.py: error: {exc}")
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--model", help="mlx-lm model directory, or 'smollm2' for SmolLM2-135M")
    target.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="smollm2-135m",
        help="random weights in this published shape (default: smollm2-135m)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("-q", "--q-bits", type=int, choices=(4, 8), help="quantize the target")
    parser.add_argument("--draft", help="drafter directory (default: random weights)")
    parser.add_argument(
        "--draft-layers", type=int, help="random drafter depth (default: per shape)"
    )
    parser.add_argument("--block-size", type=int, help="default: the drafter's (random: 16)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--positions", default="1,2,4,8,16", help="forward sizes, comma-separated")
    parser.add_argument(
        "--tree-budgets", default="", help="also time tree cycles at these budgets, e.g. 4,8,16,32"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3, help="repeats of each forward per round")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    try:
        args.positions = [int(n) for n in args.positions.split(",")]
        args.tree_budgets = [int(n) for n in args.tree_budgets.split(",") if n]
    except ValueError:
        parser.error("--positions and --tree-budgets must be comma-separated integers")
    if min(args.positions + args.tree_budgets) < 1:
        parser.error("--positions and --tree-budgets must be at least 1")
    if args.block_size is not None and args.block_size < 2:
        parser.error("--block-size must be at least 2")
    if min(args.rounds, args.reps, args.prompt_tokens) < 1:
        parser.error("--rounds, --reps and --prompt-tokens must be at least 1")
    if args.model:
        args.shape = None
    return args


if __name__ == "__main__":
    main()
