"""`dflash-mlx generate`: one prompt in, one reply out, like `mlx_lm.generate`.

The reply streams to stdout between mlx_lm.generate's rules, followed by its stats lines and
one on what drafting did; `--verbose False` prints the reply alone, for a pipe, and `--json`
one JSON object with the text and the stats.
Under `mlx.launch` the target is sharded over the ranks and rank 0 alone reads
the prompt and writes the reply.

    echo "Why is the sky blue?" | dflash-mlx generate --model M --draft D
"""

from __future__ import annotations

import argparse
import json

from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..chat_format import chat_prompt, continued_prompt, encode_chat, has_chat_template
from ..decode.stops import stop_at_strings
from ..generate import stream_generate
from ..images import image_prompt
from ..models.distributed import Lockstep, broadcast_text, is_rank0, world_group
from ..models.loading import read_config, resolve_path
from ..models.target import TARGET_PATTERNS
from ..options import (
    PrefillProgress,
    add_cache_file_argument,
    add_model_arguments,
    add_prompt_arguments,
    generation_settings,
    load_cache_file,
    load_models,
    read_prompt,
    say,
)
from ..response import RULE, ReplyStats


def true_unless_false(text: str) -> bool:
    """`--verbose`'s value as mlx_lm.generate reads it: false for 'False' or 'F' (any case)."""
    return text.lower() not in ("false", "f")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_prompt_arguments(parser)
    add_cache_file_argument(parser)
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="end the reply where this text appears, without printing it (repeatable)",
    )
    parser.add_argument(
        "--prefill-response",
        help="the start of the reply: the model goes on from it (with the chat template; "
        "as mlx_lm.generate's)",
    )
    parser.add_argument(
        "--image",
        nargs="+",
        default=[],
        metavar="FILE",
        help="image files for the image placeholders of the prompt, in order (as "
        "mlx_lm.generate's; for the models mlx-lm takes images for)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object: text + stats")
    parser.add_argument(
        "--verbose",
        type=true_unless_false,
        default=True,
        help="'False' or 'F': print the reply alone, without the loading line, the prefill's "
        "progress and the stats (as mlx_lm.generate's)",
    )


def chat_text(tokenizer: TokenizerWrapper, args: argparse.Namespace, prompt: str) -> str:
    """The prompt as a user turn after the system prompt, rendered with the chat template
    for the reply, or for the rest of it after `--prefill-response` (as mlx_lm.generate)."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    if args.prefill_response is None:
        return chat_prompt(tokenizer, messages, **args.chat_template_config)
    messages.append({"role": "assistant", "content": args.prefill_response})
    return tokenizer.apply_chat_template(
        messages, tokenize=False, continue_final_message=True, **args.chat_template_config
    )


def run(args: argparse.Namespace) -> None:
    group = world_group()  # under mlx.launch: rank 0 reads the prompt and alone writes
    prompt = None
    if is_rank0(group):
        prompt = read_prompt(args)
    prompt = broadcast_text(prompt, group)
    if not prompt.strip():
        raise ValueError("the prompt is empty (give --prompt or text on stdin)")
    model, tokenizer, draft = load_models(args)
    chat = args.chat_template and has_chat_template(tokenizer)  # as mlx_lm.generate: else raw
    cache = load_cache_file(args, model, draft)
    if cache is not None:  # the prompt goes on from the cached one
        if args.system or args.prefill_response is not None:
            raise ValueError(
                "--system-prompt belongs to the cached prompt (dflash-mlx cache-prompt), and "
                "--prefill-response does not go on from one"
            )
        prompt = continued_prompt(tokenizer, cache.tokens, prompt, chat, args.chat_template_config)
    elif chat:
        prompt = chat_text(tokenizer, args, prompt)
    elif args.system:  # as mlx_lm.generate, which uses it only in the template, but said
        say(args, "note: --system-prompt is not used without the chat template")
    embeddings = None
    if args.image:
        if cache is not None:
            raise ValueError("--image cannot go on from a cached prompt (--prompt-cache-file)")
        config = read_config(resolve_path(args.model, "target model", TARGET_PATTERNS))
        prompt, embeddings = image_prompt(model, tokenizer, config, prompt, args.image, chat)
    elif chat and cache is None:
        prompt = encode_chat(tokenizer, prompt)
    stats = ReplyStats()
    settings = generation_settings(args, tokenizer)
    rank0 = is_rank0(group)
    progress = PrefillProgress() if args.verbose and rank0 else None
    responses = stream_generate(
        model,
        draft,
        tokenizer,
        prompt,
        settings=settings,
        prompt_cache=cache,
        prompt_progress_callback=progress,
        input_embeddings=embeddings,
    )
    lockstep = Lockstep(group, args.rank_timeout, "dflash-mlx generate")
    show = rank0 and not args.json
    if show and args.verbose:
        print(RULE)
    for response in lockstep.steps(stop_at_strings(responses, args.stop)):
        stats.add(response)
        if show:
            print(response.text, end="", flush=True)
    if not rank0:
        return
    if args.json:
        print(json.dumps({"text": stats.text, **stats.as_dict()}))
        return
    print()
    if args.verbose:
        print(stats.verbose_report())
