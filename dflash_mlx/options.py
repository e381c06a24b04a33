"""What `generate`, `chat` and `serve` share: model flags, loading, reply stats.

Kept apart from the `cli` package so that its command modules and the server can import
it without an import cycle through the dispatcher.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tqdm import tqdm

from .decode.cache_file import load_prompt_cache
from .decode.prompt_cache import CACHE_SETTINGS, PromptCache
from .decode.proposers import check_compatible
from .decode.sampling import RULES
from .decode.settings import PREFILL_STEP, GenerationSettings
from .models.checkpoint import MTP, load_draft
from .models.distributed import DEFAULT_RANK_TIMEOUT, is_rank0, shared_seed, world_group
from .models.draft import KERNEL_BACKENDS, DFlashDraft
from .models.loading import DTYPES, KEEP_CHECKPOINT
from .models.target import TargetAdapter, load

DEFAULT_MAX_QUEUE = 16  # requests `serve` lets wait for the model
DEFAULT_MAX_BATCH = 8  # requests `serve` decodes together
DEFAULT_PROMPT_CONCURRENCY = 8  # new requests `serve` prefills between two cycles, as mlx-lm
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a request body `serve` reads at most
DEFAULT_MAX_CONNECTIONS = 64  # connections `serve` keeps open
DEFAULT_REQUEST_TIMEOUT_S = 10.0  # seconds a client has to send a whole request to `serve`
DEFAULT_PROMPT_CACHE_SIZE = 10  # conversations whose caches `serve` keeps (as mlx_lm.server)
DEFAULT_PROMPT_CACHE_BYTES = 8 * 2**30  # bytes of cached keys and values `serve` keeps at most
PROGRESS_DELAY_S = 2.0  # a wait shorter than this draws no progress bar


def add_model_arguments(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """The flags every model-running subcommand takes, named as in mlx-lm (ours as aliases)."""
    parser.add_argument("--model", required=True, help="target: mlx-lm directory or hub id")
    add_draft_argument(parser)
    parser.add_argument(
        "--no-draft",
        action="store_true",
        help="plain autoregressive decoding through the same loop (block size 1)",
    )
    add_dtype_argument(parser)
    parser.add_argument(
        "--adapter-path", help="LoRA adapter weights and config for the target (as mlx-lm's)"
    )
    parser.add_argument(
        "--extra-eos-token",
        nargs="+",
        default=(),
        help="more tokens (strings or ids) that end the reply, as mlx-lm's",
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--num-draft-tokens",
        type=int,
        help="tokens drafted per verify cycle (mlx-lm's name; --block-size minus 1; default: "
        "the drafter's block size minus 1)",
    )
    sizes.add_argument(
        "--block-size",
        type=int,
        help="tokens per verify cycle: the drafted ones and the one they follow (default: the "
        "drafter's)",
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        help="verify a tree of up to N draft tokens per cycle, --block-size - 1 deep (default: "
        "none; without it, --block-size and --adaptive each cycle chooses a chain or a tree by "
        "cost)",
    )
    parser.add_argument(
        "--kernels", default="auto", choices=KERNEL_BACKENDS, help="drafter kernels"
    )
    add_draft_window_argument(parser)
    add_mtp_bits_argument(parser)
    parser.add_argument(
        "--max-tokens", "-m", type=int, default=max_tokens, help="most tokens to generate"
    )
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling top-p (0: off)")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0: off)")
    parser.add_argument(
        "--min-tokens-to-keep",
        type=int,
        default=1,
        help="tokens min-p sampling keeps however unlikely (as mlx-lm's)",
    )
    parser.add_argument(
        "--xtc-probability",
        type=float,
        default=0.0,
        help="XTC sampling: the chance, per token, that the likeliest choices above "
        "--xtc-threshold but the least of them are excluded (0: off; exact when drafting too)",
    )
    parser.add_argument(
        "--xtc-threshold",
        type=float,
        default=0.1,
        help="XTC sampling: the probability from which a choice counts as a top one",
    )
    parser.add_argument("--seed", type=int, help="random seed for sampling (default: none)")
    parser.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        help="the adaptive chain: each cycle's block size by cost, up to --block-size or the "
        "drafter's (without --block-size, --tree-budget or this flag each cycle chooses a "
        "chain or a tree by cost; runs sampled by the speculative or match rule cost them "
        "from fixed tables, so a --seed reproduces them); with --tree-budget, each tree's "
        "size from the drafter's confidence (default: off)",
    )
    parser.add_argument(
        "--acceptance",
        default="coupled",
        choices=RULES,
        help="when sampling (all exact): drafts coupled to the target's samples by position "
        "(the clock may size cycles), speculative sampling, or matches of independent samples",
    )
    add_kv_cache_arguments(parser)
    add_prefill_step_argument(parser)
    penalties = parser.add_argument_group(
        "logits processors (mlx-lm's make_logits_processors; the output stays lossless)"
    )
    penalties.add_argument(
        "--logit-bias",
        type=logit_bias,
        help="""additive bias per token id as a JSON object, e.g. '{"42": -100}'""",
    )
    for name in ("repetition", "presence", "frequency"):
        penalties.add_argument(
            f"--{name}-penalty", type=float, help=f"{name} penalty (default: none)"
        )
        penalties.add_argument(
            f"--{name}-context-size", type=int, help="tokens it looks back at (default 20)"
        )
    add_trust_remote_code_argument(parser)
    add_rank_timeout_argument(parser)
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: split the target's layers over the ranks (pipeline parallel, "
        "models with mlx-lm's pipeline(): qwen3_5, qwen3_next) instead of every layer's weights",
    )
    parser.set_defaults(chat_template_source=None)  # serve's --chat-template sets it


def add_draft_window_argument(parser: argparse.ArgumentParser) -> None:
    """`--draft-window`, for every command that loads a drafter."""
    parser.add_argument(
        "--draft-window",
        type=int,
        help="drafter attends to the last N context positions only (default: the drafter's "
        "own, where its config sets one; 0: the whole context)",
    )


def add_mtp_bits_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mtp-bits",
        type=int,
        choices=[2, 3, 4, 5, 6, 8],
        help="with --draft mtp: quantize the MTP layers to this many bits (default: as the "
        "checkpoint stores them; quantized MTP layers may be accepted much less)",
    )


def add_draft_argument(parser: argparse.ArgumentParser) -> None:
    """`--draft-model` (mlx-lm's name), or `--draft`."""
    parser.add_argument(
        "--draft-model",
        "--draft",
        dest="draft",
        metavar="DRAFT_MODEL",
        help="DFlash drafter: directory or hub id; 'mtp': the target's own MTP layers",
    )


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=[*DTYPES, KEEP_CHECKPOINT],
        help="the target's dtype (default: float32 on the CPU, dequantized; the checkpoint's on "
        "a GPU); 'checkpoint' keeps its dtype and quantization",
    )


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The target's cache options, with mlx_lm.generate's flags and defaults."""
    parser.add_argument(
        "--max-kv-size",
        type=int,
        help="keep at most this many positions in the target's cache, the oldest out first "
        "(a rotating cache, as mlx-lm's; default: all)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        help="quantize the target's cache to this many bits (default: no quantization)",
    )
    parser.add_argument(
        "--kv-group-size", type=int, default=64, help="group size of the cache's quantization"
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=DEFAULT_QUANTIZED_KV_START,
        help="with --kv-bits: quantize the cache once it holds this many positions",
    )


def add_prefill_step_argument(parser: argparse.ArgumentParser) -> None:
    """`--prefill-step-size`, with mlx_lm.generate's default."""
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=PREFILL_STEP,
        help="prompt tokens prefilled at a time; smaller lowers peak memory",
    )


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that takes one prompt: the text and how it is rendered."""
    parser.add_argument("--prompt", "-p", help="the prompt (default: read from stdin; '-' too)")
    add_system_prompt_argument(parser)
    templates = parser.add_mutually_exclusive_group()
    templates.add_argument(
        "--chat-template",
        action="store_true",
        default=True,
        help="wrap the prompt in the model's chat template, if it has one (default: on)",
    )
    templates.add_argument(
        "--ignore-chat-template",
        "--no-chat-template",
        dest="chat_template",
        action="store_false",
        help="use the prompt raw, without the chat template (mlx-lm's name)",
    )
    add_template_config_argument(parser)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt `--prompt` gives, or stdin's (with `-` or without the flag), read as bytes
    and refused in one line, before anything loads, where they are not UTF-8 text."""
    if args.prompt in (None, "-"):
        data, source = sys.stdin.buffer.read(), "the prompt on stdin"
    else:  # undecodable bytes of the command line come back as they were
        data, source = os.fsencode(args.prompt), "--prompt"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{source} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
            "convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None
    return text


def add_system_prompt_argument(parser: argparse.ArgumentParser) -> None:
    """`--system-prompt` (mlx-lm's name), or `--system`."""
    parser.add_argument(
        "--system-prompt",
        "--system",
        dest="system",
        metavar="SYSTEM_PROMPT",
        help="system message (with the chat template)",
    )


def add_cache_file_argument(parser: argparse.ArgumentParser) -> None:
    """`--prompt-cache-file`, for the commands that go on from a cached prompt."""
    parser.add_argument(
        "--prompt-cache-file",
        help="go on from a prompt 'dflash-mlx cache-prompt' cached with this target and drafter: "
        "only what follows it is prefilled",
    )


def load_cache_file(
    args: argparse.Namespace, model: nn.Module, draft: DFlashDraft | None
) -> PromptCache | None:
    """The cache `--prompt-cache-file` names, checked against the loaded models and the
    cache flags (the file's options are used: those flags set must be its own), or None."""
    if args.prompt_cache_file is None:
        return None
    return load_prompt_cache(args.prompt_cache_file, model, draft, cache_options(args))


def cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """The cache options the flags of `add_kv_cache_arguments` set."""
    return {name: getattr(args, name) for name in CACHE_SETTINGS}


def add_trust_remote_code_argument(parser: argparse.ArgumentParser) -> None:
    """`--trust-remote-code`, for every subcommand that loads the target's tokenizer."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the target's own tokenizer and model code run (as mlx-lm's flag); "
        "some tokenizers need it, e.g. Kimi's",
    )


def add_rank_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """`--rank-timeout`, for the subcommands that run under `mlx.launch`."""
    parser.add_argument(
        "--rank-timeout",
        type=float,
        default=DEFAULT_RANK_TIMEOUT,
        help="under mlx.launch: end every rank when a generation makes no progress for this "
        f"many seconds, e.g. a peer that hangs (default {DEFAULT_RANK_TIMEOUT:g}; 0: never)",
    )


def load_models(
    args: argparse.Namespace,
) -> tuple[nn.Module, TokenizerWrapper, DFlashDraft | None]:
    """Target, tokenizer and drafter from the flags; `--no-draft` gets no drafter (None).

    `--seed` seeds after loading, so the seed alone decides the samples.
    Under `mlx.launch` the target is sharded over the ranks (tensor parallel, or
    with `--pipeline` its layers split over them), the drafter is whole on every
    rank, and every rank seeds with rank 0's seed.
    """
    if args.draft is None and not args.no_draft:
        raise ValueError("--draft-model is required (or pass --no-draft for plain decoding)")
    generation_settings(args)  # bad settings fail before anything loads
    group = world_group()
    if args.pipeline and group is None:
        raise ValueError("--pipeline splits the target over the ranks of mlx.launch; run it there")
    groups = {"pipeline_group" if args.pipeline else "tensor_group": group}
    drafter = "" if args.no_draft else f" and the drafter {args.draft}"
    if args.draft == MTP and not args.no_draft:
        drafter = " and its MTP layers"
    say(args, f"loading {args.model}{drafter}...")
    template = {"chat_template": args.chat_template_source} if args.chat_template_source else {}
    model, tokenizer = load(
        args.model,
        args.dtype,
        trust_remote_code=args.trust_remote_code,
        adapter_path=args.adapter_path,
        tokenizer_config=template,
        **groups,
    )
    for token in args.extra_eos_token:
        try:
            tokenizer.add_eos_token(token)
        except ValueError as exc:
            raise ValueError(f"--extra-eos-token: {exc}") from None
    draft = (
        None
        if args.no_draft
        else load_draft(
            args.draft,
            kernels=args.kernels,
            context_window=args.draft_window,
            target=args.model,
            mtp_bits=args.mtp_bits,
        )
    )
    if draft is not None:  # a drafter made for another model fails now, not at a request
        check_compatible(TargetAdapter(model), draft)
    if group is not None:  # same draws on every rank, or their verdicts would differ
        args.seed = shared_seed(args.seed, group)
    if args.seed is not None:  # after loading, which draws random numbers (more when sharding)
        mx.random.seed(args.seed)
    return model, tokenizer, draft


PROCESSOR_SETTINGS = (
    "logit_bias",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
)


def processor_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `make_logits_processors` arguments the flags set."""
    return {k: getattr(args, k) for k in PROCESSOR_SETTINGS if getattr(args, k) is not None}


# The flags of the settings whose checks name them (mlx-lm's flag names).
SETTING_FLAGS = {
    "max_tokens": "--max-tokens",
    "block_size": "--block-size",
    "tree_budget": "--tree-budget",
    "temperature": "--temp",
    "min_tokens_to_keep": "--min-tokens-to-keep",
    "xtc_probability": "--xtc-probability",
    "xtc_threshold": "--xtc-threshold",
    "acceptance": "--acceptance",
    "max_kv_size": "--max-kv-size",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
    "quantized_kv_start": "--quantized-kv-start",
    "prefill_step_size": "--prefill-step-size",
}


def say(args: argparse.Namespace, message: str) -> None:
    """A line on stderr about what a wait is for, unless `--verbose False` asked for quiet;
    under `mlx.launch` from rank 0 alone."""
    if getattr(args, "verbose", True) and is_rank0(world_group()):
        print(message, file=sys.stderr, flush=True)


class PrefillProgress:
    """A `prompt_progress_callback` drawing the prefill's progress on stderr, only once it has
    taken `PROGRESS_DELAY_S` (a short prompt shows nothing), and gone when the prefill ends."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def __call__(self, processed: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm(
                total=total,
                unit="tok",
                desc="prefill",
                file=sys.stderr,
                delay=PROGRESS_DELAY_S,
                leave=False,
            )
        self.bar.update(processed - self.bar.n)
        if processed >= total:
            self.bar.close()
            self.bar = None


def block_size(args: argparse.Namespace) -> int | None:
    """The block size `--block-size`, `--num-draft-tokens` (one less) or `--no-draft` (1) set."""
    if args.no_draft:
        return 1
    if args.num_draft_tokens is not None:
        return args.num_draft_tokens + 1
    return args.block_size


def generation_settings(
    args: argparse.Namespace, tokenizer: TokenizerWrapper | None = None
) -> GenerationSettings:
    """The `stream_generate` settings the flags ask for; a bad one's ValueError names its flag.
    XTC spares `tokenizer`'s newline and end-of-sequence tokens, as mlx-lm's commands do."""
    spared = tokenizer.encode("\n") + list(tokenizer.eos_token_ids) if tokenizer else []
    return flagged_settings(
        logits_processors=make_logits_processors(**processor_settings(args)),
        block_size=block_size(args),
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        min_tokens_to_keep=args.min_tokens_to_keep,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tuple(spared),
        acceptance=args.acceptance,
        adaptive=args.adaptive,
        tree_budget=args.tree_budget,
        prefill_step_size=args.prefill_step_size,
        **cache_options(args),
    )


def flagged_settings(**fields: Any) -> GenerationSettings:
    """`GenerationSettings(**fields)`, whose ValueError for a bad field names its flag."""
    try:
        return GenerationSettings(**fields)
    except ValueError as exc:
        message = str(exc)
        field = next((f for f in SETTING_FLAGS if message.startswith(f"{f} ")), None)
        if field is None:
            raise
        raise ValueError(SETTING_FLAGS[field] + message[len(field) :]) from None


def add_template_config_argument(parser: argparse.ArgumentParser) -> None:
    """`--chat-template-config`, as `mlx_lm.generate` names it."""
    parser.add_argument(
        "--chat-template-config",
        type=json_object,
        default={},
        help="""chat template arguments as a JSON object, e.g. '{"enable_thinking": false}'""",
    )


def logit_bias(text: str) -> dict[int, float]:
    """`--logit-bias`: a JSON object of token id -> bias."""
    return {int(k): float(v) for k, v in json_object(text).items()}


def json_object(text: str) -> dict[str, Any]:
    """A JSON object from the command line (argparse reports the ValueError as a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
