"""What `generate`, `chat` and `serve` share: model flags, loading, reply stats.

Kept apart from `cli.py` so the subcommand modules can import it without an
import cycle through the dispatcher.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache_file import load_prompt_cache
from .checkpoint import load_draft
from .distributed import DEFAULT_RANK_TIMEOUT, shared_seed, world_group
from .draft import KERNEL_BACKENDS, DFlashDraft
from .loading import DTYPES, KEEP_CHECKPOINT
from .prompt_cache import PromptCache
from .response import GenerationResponse
from .sampling import RULES
from .settings import GenerationSettings
from .target import load

DEFAULT_MAX_QUEUE = 16  # requests `serve` lets wait for the model
DEFAULT_MAX_BATCH = 8  # requests `serve` decodes together
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a request body `serve` reads at most
DEFAULT_MAX_CONNECTIONS = 64  # connections `serve` keeps open
DEFAULT_REQUEST_TIMEOUT_S = 10.0  # seconds a client has to send a whole request to `serve`
DEFAULT_PROMPT_CACHE_SIZE = 10  # conversations whose caches `serve` keeps (as mlx_lm.server)
DEFAULT_PROMPT_CACHE_BYTES = 8 * 2**30  # bytes of cached keys and values `serve` keeps at most


def add_model_arguments(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """The flags every model-running subcommand takes, named as in mlx-lm."""
    parser.add_argument("--model", required=True, help="target: mlx-lm directory or hub id")
    parser.add_argument("--draft", help="DFlash drafter: directory or hub id")
    parser.add_argument(
        "--no-draft",
        action="store_true",
        help="plain autoregressive decoding through the same loop (block size 1)",
    )
    parser.add_argument(
        "--dtype",
        choices=[*DTYPES, KEEP_CHECKPOINT],
        help="the target's dtype (default: float32 on the CPU, dequantized; the checkpoint's on "
        "a GPU); 'checkpoint' keeps its dtype and quantization",
    )
    parser.add_argument("--block-size", type=int, help="tokens per verify cycle (drafter's)")
    parser.add_argument(
        "--tree-budget",
        type=int,
        help="verify a tree of up to N draft tokens per cycle, --block-size - 1 deep",
    )
    parser.add_argument(
        "--kernels", default="auto", choices=KERNEL_BACKENDS, help="drafter kernels"
    )
    parser.add_argument(
        "--draft-window",
        type=int,
        help="drafter attends to the last N context positions only (default: the drafter's "
        "own, where its config sets one; 0: the whole context)",
    )
    parser.add_argument("--max-tokens", "-m", type=int, default=max_tokens)
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, help="random seed for sampling")
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
    penalties = parser.add_argument_group(
        "logits processors (mlx-lm's make_logits_processors; the output stays lossless)"
    )
    penalties.add_argument(
        "--logit-bias",
        type=logit_bias,
        help="""additive bias per token id as a JSON object, e.g. '{"42": -100}'""",
    )
    for name in ("repetition", "presence", "frequency"):
        penalties.add_argument(f"--{name}-penalty", type=float, help=f"{name} penalty")
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


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that takes one prompt: the text and how it is rendered."""
    parser.add_argument("--prompt", "-p", help="the prompt; read from stdin if omitted or '-'")
    parser.add_argument("--system", help="system message (with the chat template)")
    parser.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template, if it has one (default: on)",
    )
    add_template_config_argument(parser)


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
    """The cache `--prompt-cache-file` names, checked against the loaded models, or None."""
    if args.prompt_cache_file is None:
        return None
    return load_prompt_cache(args.prompt_cache_file, model, draft)


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
        raise ValueError("--draft is required (or pass --no-draft for plain decoding)")
    generation_settings(args)  # bad settings fail before anything loads
    group = world_group()
    if args.pipeline and group is None:
        raise ValueError("--pipeline splits the target over the ranks of mlx.launch; run it there")
    groups = {"pipeline_group" if args.pipeline else "tensor_group": group}
    model, tokenizer = load(
        args.model, args.dtype, trust_remote_code=args.trust_remote_code, **groups
    )
    draft = (
        None
        if args.no_draft
        else load_draft(args.draft, kernels=args.kernels, context_window=args.draft_window)
    )
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
    "acceptance": "--acceptance",
}


def generation_settings(args: argparse.Namespace) -> GenerationSettings:
    """The `stream_generate` settings the flags ask for; a bad one's ValueError names its flag."""
    try:
        return GenerationSettings(
            logits_processors=make_logits_processors(**processor_settings(args)),
            block_size=1 if args.no_draft else args.block_size,
            max_tokens=args.max_tokens,
            temperature=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            acceptance=args.acceptance,
            adaptive=args.adaptive,
            tree_budget=args.tree_budget,
        )
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


@dataclass
class ReplyStats:
    """Counters over one reply's responses.

    The first response carries the prefill's token, so τ (committed tokens per
    verify cycle) counts the responses after it.
    """

    start: float = field(default_factory=time.perf_counter)
    ttft: float = 0.0
    cycles: int = 0
    accepted: int = 0
    proposed: int = 0
    text: str = ""
    last: GenerationResponse | None = None

    def add(self, response: GenerationResponse) -> None:
        if self.last is None:
            self.ttft = time.perf_counter() - self.start
        else:
            self.cycles += 1
        self.accepted += response.accepted
        self.proposed += response.proposed
        self.text += response.text
        self.last = response

    @property
    def tokens(self) -> int:
        return self.last.generation_tokens if self.last else 0

    @property
    def tau(self) -> float:
        return (self.tokens - 1) / self.cycles if self.cycles else 0.0

    def as_dict(self) -> dict[str, Any]:
        last = self.last
        return {
            "prompt_tokens": last.prompt_tokens if last else 0,
            "prompt_tps": last.prompt_tps if last else 0.0,
            "generation_tokens": self.tokens,
            "generation_tps": last.generation_tps if last else 0.0,
            "ttft": self.ttft,
            "cycles": self.cycles,
            "tau": self.tau,
            "accepted": self.accepted,
            "proposed": self.proposed,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "peak_memory_gb": last.peak_memory if last else 0.0,
            "finish_reason": last.finish_reason if last else None,
            **(last.drafting.as_dict() if last and last.drafting else {}),
        }

    def summary(self) -> str:
        d = self.as_dict()
        return (
            f"{d['generation_tokens']} tokens, {d['generation_tps']:.1f} tok/s, "
            f"τ {d['tau']:.2f}, {d['acceptance_rate']:.0%} accepted{self.drafting()}, "
            f"TTFT {d['ttft'] * 1000:.0f} ms, prompt {d['prompt_tokens']} tokens"
        )

    def drafting(self) -> str:
        """The cycles by kind, and when and why drafting was off, as " (...)" ("" if unknown)."""
        drafting = self.last.drafting if self.last else None
        return f" ({drafting.summary()})" if drafting else ""
