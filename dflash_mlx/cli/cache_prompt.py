"""`dflash-mlx cache-prompt`: prefill a long prompt once and save the target's and the
drafter's caches, as `mlx_lm.cache_prompt` does; `generate` and `serve` go on from the
file with `--prompt-cache-file`, prefilling only what follows it.

    dflash-mlx cache-prompt --model M --draft D --prompt-cache-file doc.safetensors < doc.txt
    dflash-mlx generate --model M --draft D --prompt-cache-file doc.safetensors \\
        -p "Summarise the document above."

With a chat template the cached prompt is a user message left open, and the
prompt given later continues that message (mlx-lm's convention).

The cache flags (`--max-kv-size`, `--kv-bits`, `--kv-group-size`, `--quantized-kv-start`)
are mlx-lm's; the file records them, and a run going on from it makes its caches with them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..chat_format import has_chat_template, open_prompt
from ..decode.cache_file import save_prompt_cache
from ..decode.prompt_cache import PromptCache, make_prompt_cache
from ..decode.settings import GenerationSettings
from ..generate import stream_generate
from ..models.checkpoint import load_draft
from ..models.draft import DFlashDraft
from ..models.target import load
from ..options import (
    add_draft_argument,
    add_dtype_argument,
    add_kv_cache_arguments,
    add_prompt_arguments,
    add_trust_remote_code_argument,
    cache_options,
    flagged_settings,
    read_prompt,
)

PROGRESS_STEP = 256  # prompt tokens per prefill forward: how often the bar moves


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="target: mlx-lm directory or hub id")
    add_draft_argument(parser)
    parser.add_argument("--no-draft", action="store_true", help="cache the target's only")
    add_dtype_argument(parser)
    parser.add_argument(
        "--adapter-path", help="LoRA adapter weights and config for the target (as mlx-lm's)"
    )
    add_trust_remote_code_argument(parser)
    parser.add_argument("--prompt-cache-file", required=True, help="the .safetensors to write")
    parser.add_argument(
        "--eos-token",
        help="the tokenizer's end-of-sequence token, as a chat template that names it renders it "
        "(as mlx-lm's; default: the tokenizer's own)",
    )
    add_prompt_arguments(parser)
    add_kv_cache_arguments(parser)


def prefill(
    model,
    tokenizer,
    draft: DFlashDraft | None,
    prompt: list[int],
    options: dict[str, Any] | None = None,
    step: int = PROGRESS_STEP,
) -> PromptCache:
    """Caches made with the cache `options` (`make_prompt_cache`'s) holding `prompt`,
    prefilled `step` tokens per forward under a progress bar that moves after each
    (generate's 2,048 would leave it still for a whole shorter prompt)."""
    cache = make_prompt_cache(model, draft, **(options or {}))
    settings = GenerationSettings(max_tokens=1, prefill_step_size=step)
    with tqdm(total=len(prompt), unit="tok", desc="prefill", file=sys.stderr) as bar:

        def advance(processed: int, total: int) -> None:
            bar.update(processed - bar.n)

        for _ in stream_generate(
            model,
            draft,
            tokenizer,
            prompt,
            settings=settings,
            prompt_cache=cache,
            prompt_progress_callback=advance,
        ):
            pass
    return cache


def run(args: argparse.Namespace) -> None:
    if args.draft is None and not args.no_draft:
        raise ValueError("--draft is required (or pass --no-draft to cache the target's only)")
    text = read_prompt(args)
    if not text.strip():
        raise ValueError("the prompt is empty (give --prompt or text on stdin)")
    out = Path(args.prompt_cache_file)
    if not out.parent.is_dir():
        raise ValueError(f"--prompt-cache-file: no directory {out.parent}")
    options = cache_options(args)
    flagged_settings(**options)  # a bad cache flag's error before the models load
    model, tokenizer = load(
        args.model,
        args.dtype,
        trust_remote_code=args.trust_remote_code,
        adapter_path=args.adapter_path,
        tokenizer_config={"eos_token": args.eos_token} if args.eos_token else {},
    )
    draft = None if args.no_draft else load_draft(args.draft)
    chat = args.chat_template and has_chat_template(tokenizer)
    if args.system and not chat:
        raise ValueError("--system needs the model's chat template")
    prompt = open_prompt(tokenizer, text, args.system, chat, args.chat_template_config)
    tic = time.perf_counter()
    cache = prefill(model, tokenizer, draft, prompt, options)
    save_prompt_cache(out, cache, model, draft, options)
    seconds = time.perf_counter() - tic
    print(
        f"cached {len(prompt)} prompt tokens in {seconds:.1f} s ({len(prompt) / seconds:.1f} "
        f"tok/s) to {out}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    from . import run_as_module

    run_as_module("cache-prompt")
