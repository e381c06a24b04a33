"""Bounded draft context at long contexts: tau and tok/s with and without a window.

One prompt per context length: Python standard-library source (read from this
machine, cut to the length with the target's tokenizer) followed by a request
to explain it, in the chat template. For each drafter window (`--windows`: 0 is the
whole context, "default" the drafter's own) the bench harness runs mlx-lm's AR decode
and DFlash (library default) interleaved on the same prompts, so every speedup and
time-to-first-token ratio is side by side.

    python benchmarks/long_context.py [--lengths 2048,4096,8000] [--windows default,0,256]
"""

from __future__ import annotations

import argparse
import inspect
import json

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

from dflash_mlx import load, load_draft
from dflash_mlx.chat_format import render
from dflash_mlx.cli.bench import bench
from dflash_mlx.models.gguf import smollm2_model_dir

SOURCES = ("textwrap", "calendar", "difflib", "fractions", "statistics", "shlex", "heapq")
QUESTION = "\n\nExplain what the code above does, one paragraph per main function."


def long_prompt(tokenizer, length: int) -> str:
    """Stdlib source cut so that the chat-templated prompt has about `length` tokens."""
    overhead = len(render(tokenizer, QUESTION, chat=True))
    budget, ids = max(1, length - overhead), []
    for name in SOURCES:  # module by module: never tokenize more than the model's context
        ids += tokenizer.encode(inspect.getsource(__import__(name)) + "\n\n")
        if len(ids) >= budget:
            break
    ids = ids[:budget]
    return tokenizer.decode(ids) + QUESTION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default="dflash_mlx/drafters/smollm2-135m-instruct")
    parser.add_argument("--lengths", default="2048,4096,8000")
    parser.add_argument("--windows", default="default,0,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args()

    model, tokenizer = load(smollm2_model_dir())
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = [
        {"id": f"ctx-{n}", "category": "long", "prompt": long_prompt(tokenizer, n)} for n in lengths
    ]
    results = {}
    for window in args.windows.split(","):
        draft = load_draft(args.draft, context_window=None if window == "default" else int(window))
        run = bench(model, tokenizer, draft, prompts, max_tokens=args.max_tokens, split=False)
        results[str(window)] = run
        for r in run["prompts"]:
            print(
                f"window {str(window):>5} {r['id']:>9} ({r['prompt_tokens']} tokens): "
                f"tau {r['acceptance']['tau']:.2f}  AR {r['ar']['decode_tps']:.1f} tok/s  "
                f"DFlash {r['dflash']['decode_tps']:.1f} tok/s  "
                f"speedup {r['speedup_decode']:.2f}x  "
                f"TTFT {r['dflash']['ttft_s']:.2f} s / {r['ar']['ttft_s']:.2f} s  "
                f"identical {r['identical']}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
