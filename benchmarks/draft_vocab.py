"""What a reduced draft vocabulary saves per cycle, and how much of the target's output it covers.

    python benchmarks/draft_vocab.py [--reps 40] [--prompts 12] [--max-tokens 64] [--out r.json]

On SmolLM2-135M (fp32) with the shipped drafter, in one process:
- `draft_logits` for one 16-token block over ~300 context positions, greedy argmax
  included, with the full LM head and with the top 4k/8k/16k reply tokens of the
  training data, and 2k (interleaved repetitions, medians);
- coverage: the share of mlx-lm's greedy tokens on the bench prompts that fall
  inside each vocabulary (a draft outside it can never be accepted);
- end to end: DFlash tok/s and τ with the full head and the 8k vocabulary
  (top_tokens returns fewer ids than asked when the replies hold fewer distinct tokens),
  interleaved per prompt, and whether the outputs are identical;
- `mx.compile` of the drafter body: the context grows every cycle, so a compiled
  body retraces on every call; timed against a shape-stable (cache-hit) call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.chat_format import render
from dflash_mlx.cli.bench import load_prompts
from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.paths import cache_dir
from dflash_mlx.train.data import read_records
from dflash_mlx.train.export import top_tokens

ROOT = Path(__file__).resolve().parent.parent
DRAFTER = ROOT / "dflash_mlx" / "drafters" / "smollm2-135m-instruct"
SIZES = (2048, 4096, 8192, 16384)


def median_ms(fns: dict, reps: int) -> dict[str, float]:
    """Median wall time of each zero-argument function, calls interleaved round-robin."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            tic = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - tic)
    return {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()}


def context(model, draft, target: TargetAdapter, ids: list[int]) -> list:
    """The drafter's cache after the target has read `ids`."""
    cache = draft.make_cache()
    taps = draft.config.target_layer_ids
    draft.append_context(target.forward(mx.array(ids)[None], None, taps=taps).features, [cache])
    mx.eval([c.state for c in cache])
    return cache


def body(draft, h: mx.array, kv: list[tuple[mx.array, mx.array]]) -> mx.array:
    """The drafter's own forward, its context K/V passed as explicit inputs (compilable)."""
    caches = []
    for keys, values in kv:
        cache = KVCache()
        cache.keys, cache.values, cache.offset = keys, values, keys.shape[2]
        caches.append(cache)
    return draft(h, caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--e2e-prompts", type=int, default=6)
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    args = parser.parse_args()

    model, tokenizer = load(smollm2_model_dir())
    draft = load_draft(DRAFTER, full_vocab=True)
    target = TargetAdapter(model)
    records = read_records(cache_dir() / "train" / "smollm2-135m-instruct" / "replies.jsonl")
    always = [*tokenizer.eos_token_ids, draft.config.mask_token_id]
    vocabs = {n: top_tokens(records, n, always) for n in SIZES}
    prompts = [render(tokenizer, p["prompt"], chat=True) for p in load_prompts()[: args.prompts]]
    results: dict = {"reply_tokens": sum(len(r["ids"]) - r["start"] for r in records)}

    ids = [t for p in prompts for t in p][:300]
    cache = context(model, draft, target, ids)
    block = mx.array([[ids[-1]] + [draft.config.mask_token_id] * 15])
    heads = {"full": target.draft_head(None)}
    heads.update({f"{n // 1024}k": target.draft_head(vocabs[n]) for n in SIZES})
    hidden = draft(target.embed_tokens(block), cache)[0, 1:]
    mx.eval(hidden)
    fns = {
        f"draft_logits+argmax {name}": lambda h=head: mx.argmax(
            draft.draft_logits(block, target.embed_tokens, h, [cache])[0], axis=-1
        )
        for name, head in heads.items()
    }
    fns["body only"] = lambda: draft(target.embed_tokens(block), cache)
    fns.update({f"head only {name}": lambda h=head: h(hidden) for name, head in heads.items()})
    results["vocab_sizes"] = {f"{n // 1024}k": len(vocab) for n, vocab in vocabs.items()}
    results["ms"] = median_ms(fns, args.reps)

    generated = []
    for p in prompts:
        steps = generate_step(mx.array(p), model, max_tokens=args.max_tokens)
        generated += [int(t) for t, _ in steps]
    results["coverage"] = {
        f"{n // 1024}k": round(sum(t in set(vocab) for t in generated) / len(generated), 4)
        for n, vocab in vocabs.items()
    }

    e2e = {"full": {"tps": [], "tau": []}, "8k": {"tps": [], "tau": []}}
    identical = True
    for p in prompts[: args.e2e_prompts]:
        outs = []
        for name, vocab in (("full", None), ("8k", vocabs[8192])):
            draft.config.draft_vocab = vocab
            rs = list(stream_generate(model, draft, tokenizer, p, max_tokens=args.max_tokens))
            e2e[name]["tps"].append(rs[-1].generation_tps)
            e2e[name]["tau"].append((rs[-1].generation_tokens - 1) / max(len(rs) - 1, 1))
            outs.append([t for r in rs for t in r.tokens])
        identical &= outs[0] == outs[1]
    draft.config.draft_vocab = None
    results["end_to_end"] = {
        name: {k: round(statistics.median(v), 2) for k, v in d.items()} for name, d in e2e.items()
    }
    results["end_to_end"]["identical"] = identical

    embedded = target.embed_tokens(block)
    kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]
    compiled = mx.compile(lambda h, kv: body(draft, h, kv))
    grown = [
        [(k[..., : k.shape[2] - i, :], v[..., : v.shape[2] - i, :]) for k, v in kv]
        for i in range(args.reps + 1)
    ]
    state = {"i": 0}

    def retrace() -> mx.array:
        state["i"] += 1
        return compiled(embedded, grown[state["i"] % len(grown)])

    results["compile_ms"] = median_ms(
        {
            "body eager": lambda: body(draft, embedded, kv),
            "body compiled, same shape": lambda: compiled(embedded, kv),
            "body compiled, growing context (retrace)": retrace,
        },
        args.reps,
    )

    for section in ("ms", "coverage", "end_to_end", "compile_ms"):
        print(section)
        for name, value in results[section].items():
            print(f"  {name:45s} {value}")
    print(f"vocab sizes {results['vocab_sizes']}; reply tokens {results['reply_tokens']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
