"""The `dflash-mlx` command line: one subcommand per module that does the work.

Each module in `COMMANDS` has `add_arguments(parser)` and `run(args)`; adding a
subcommand is one line there.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from .. import __version__, train
from ..models.distributed import is_backend_error, refuse_distributed, world_group
from ..native.blas import active_blas
from ..native.cpu_attention import status as cpu_attention_status
from ..native.few_rows_quantized import status as few_rows_quantized_status
from ..native.kernels.cuda import cuda_available
from ..paths import cache_dir
from . import bench, cache_prompt, chat, convert, demo, generate, serve


def device_description() -> str:
    """The default device with its name and backend, e.g. "gpu: NVIDIA H100 (CUDA)"."""
    device = mx.default_device()
    details = mx.device_info(device) if hasattr(mx, "device_info") else {}
    if device.type != mx.gpu:
        backend = "CPU"
    else:
        backend = "Metal" if mx.metal.is_available() else "CUDA" if cuda_available() else "GPU"
    name = details.get("device_name") or details.get("architecture") or "unnamed"
    return f"{device.type.name}: {name} ({backend})"


def info(args: argparse.Namespace) -> None:
    from ..models.checkpoint import describe_draft
    from ..models.mtp import describe_mtp

    if args.model:
        rows = [("model", args.model), ("MTP layers", describe_mtp(args.model))]
    elif args.draft:
        rows = describe_draft(args.draft)
    else:
        rows = system_rows()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def system_rows() -> list[tuple[str, str]]:
    import mlx_lm
    from huggingface_hub.constants import HF_HUB_CACHE

    from ..models import backends
    from ..models.loading import default_dtype
    from ..native.kernels import active_backend

    return [
        ("dflash-mlx", __version__),
        ("distribution", distribution()),
        ("package", str(Path(__file__).resolve().parents[1])),
        ("python", platform.python_version()),
        ("platform", f"{platform.system()} {platform.machine()}"),
        ("mlx", mx.__version__),
        ("mlx-lm", mlx_lm.__version__),
        ("device", device_description()),
        ("metal available", str(mx.metal.is_available())),
        ("cuda available", str(cuda_available())),
        (
            "models load in",
            str(default_dtype() or "the checkpoint's dtype").removeprefix("mlx.core."),
        ),
        ("BLAS", active_blas()),
        (
            "quantized products",
            few_rows_quantized_status() if mx.default_device() == mx.cpu else "MLX's",
        ),
        ("verify attention", cpu_attention_status() if mx.default_device() == mx.cpu else "MLX's"),
        ("block-attention kernels", active_backend()),
        ("verify forward", backends.PATHS[backends.current()]),
        ("dflash-mlx cache", str(cache_dir())),
        ("hugging face cache", str(HF_HUB_CACHE)),
    ]


def distribution() -> str:
    """The installed distribution named dflash-mlx and where it was installed from. PyPI's
    dflash-mlx is another project with the same import name, so which one a user installed
    matters; the package row says which files run."""
    # installed ones only: a source tree's own build metadata (an egg-info beside the package,
    # made by `pip install -e`) may come first on the path, but no installer wrote it
    installed = [
        d
        for d in importlib.metadata.distributions(name="dflash-mlx")
        if d.read_text("INSTALLER") is not None
    ]
    if not installed:
        return "none installed (run from a source tree)"
    dist = installed[0]
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    url = origin.get("url", "")
    if not url:
        where = "from a package index (PyPI's dflash-mlx is another project)"
    elif origin.get("dir_info", {}).get("editable"):
        where = f"editable from {url.removeprefix('file://')}"
    else:
        where = f"from {url.removeprefix('file://')}"
    return f"{dist.metadata['Name']} {dist.version}, {where}"


# Subcommands that run under mlx.launch (target sharded over the ranks, run in lockstep).
SHARDED_COMMANDS = ("generate", "chat", "serve", "bench", "info")
COMMANDS = {
    "convert": (convert, "convert a drafter to the dflash-mlx layout"),
    "generate": (generate, "generate a reply to one prompt"),
    "chat": (chat, "chat with a model in the terminal"),
    "serve": (serve, "serve an OpenAI-compatible HTTP API"),
    "cache-prompt": (cache_prompt, "prefill a long prompt once and save it for generate/serve"),
    "bench": (bench, "benchmark DFlash against mlx-lm's own decoding"),
    "demo": (demo, "SmolLM2 with the shipped drafter: streamed reply, tau, speedup"),
    "train": (train, "train a DFlash drafter (data, features, fit, export)"),
}


# mlx-lm's flags (of mlx_lm.generate, chat, server, cache_prompt) that no command here takes,
# each with why: an mlx-lm user who passes one learns that, not just "unrecognized".
REFUSED = {
    "--image": "only dflash-mlx generate takes image prompts (for the models mlx-lm takes "
    "images for)",
    "--use-default-chat-template": "transformers has no default chat templates any more; "
    "give one with serve's --chat-template",
    "--quantize-activations": "activation quantization is not supported: the target runs "
    "its layers as mlx-lm loads them",
    "-qa": "activation quantization (--quantize-activations) is not supported",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default where it has one and does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return (
            text
            if "default" in text or not shown_default(action)
            else f"{text} (default: %(default)s)"
        )


def shown_default(action: argparse.Action) -> bool:
    """Whether `action`'s help should give its default: one that takes a value and has one."""
    default = action.default
    unset = default is None or default is argparse.SUPPRESS or action.nargs == 0
    return not unset and default not in ("", (), [], {})


class Parser(argparse.ArgumentParser):
    """An argparse parser that never guesses: no flag prefixes, and an unknown flag is an
    error that names the flag it was likely meant to be (or why mlx-lm's is refused).

    Each subcommand's parser refuses its own left-over arguments, where its flags are known.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        return namespace, extras

    def unrecognized(self, extras: list[str]) -> str:
        """The error for arguments this parser does not take, about the first flag among them."""
        flag = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), None)
        if flag is None:
            return f"unrecognized argument {extras[0]!r}"
        if flag in REFUSED:
            return f"{flag} (mlx-lm's) is not supported here: {REFUSED[flag]}"
        options = [o for action in self._actions for o in action.option_strings]
        close = difflib.get_close_matches(flag, options, n=1)
        hint = f"did you mean {close[0]}?" if close else f"{self.prog} --help lists the flags"
        return f"unrecognized argument {flag}; {hint}"

    def error(self, message: str):
        """One line, without the usage: the message names the flag and the fix."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def any_case(choices: Sequence[str]):
    """An argparse `type` that takes a choice in any case, as the choice's own spelling."""
    by_lower = {c.lower(): c for c in choices}

    def choice(text: str) -> str:
        return by_lower.get(text.lower(), text)

    return choice


def case_insensitive_choices(parser: argparse.ArgumentParser) -> None:
    """Every string-choice flag of `parser` and its subcommands takes any case
    (`--log-level INFO`, as mlx_lm.server spells it)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                case_insensitive_choices(sub)
        elif (
            action.choices
            and action.type is None
            and all(isinstance(c, str) for c in action.choices)
        ):
            action.type = any_case(list(action.choices))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dflash-mlx", description="DFlash speculative decoding on MLX")
    parser.add_argument("--version", action="version", version=f"dflash-mlx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, help="the command to run")

    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(func=module.run)

    p = sub.add_parser("info", help="show MLX, BLAS, Metal and cache information, or a drafter's")
    p.add_argument("draft", nargs="?", help="describe this drafter (directory or hub id) instead")
    p.add_argument("--model", help="say whether this target has MTP layers (--draft mtp)")
    p.set_defaults(func=info)
    case_insensitive_choices(parser)
    return parser


def run_as_module(command: str) -> None:
    """`python -m dflash_mlx.cli.<module>` (or `dflash_mlx.generate`): the same as
    `dflash-mlx <command>`."""
    main([command, *sys.argv[1:]])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command not in SHARDED_COMMANDS:
            refuse_distributed(args.command)
        args.func(args)
    except (ValueError, OSError) as exc:  # bad input, or files that cannot be read or written
        print(f"dflash-mlx {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as exc:
        if not is_backend_error(exc):
            raise
        rank = world_group().rank()
        print(f"dflash-mlx {args.command}: error: rank {rank}: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
