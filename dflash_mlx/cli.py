"""The `dflash-mlx` command line: one subcommand per module that does the work.

Each module in `COMMANDS` has `add_arguments(parser)` and `run(args)`; adding a
subcommand is one line there.
"""

from __future__ import annotations

import argparse
import platform
import sys

import mlx.core as mx

from . import __version__, bench, cache_prompt, chat, convert, demo, oneshot, serve, train
from .blas import active_blas
from .cpu_attention import status as cpu_attention_status
from .distributed import is_backend_error, refuse_distributed, world_group
from .few_rows_quantized import status as few_rows_quantized_status
from .kernels.cuda import cuda_available
from .paths import cache_dir


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
    from .checkpoint import describe_draft

    rows = describe_draft(args.draft) if getattr(args, "draft", None) else system_rows()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def system_rows() -> list[tuple[str, str]]:
    import mlx_lm
    from huggingface_hub.constants import HF_HUB_CACHE

    from . import backends
    from .kernels import active_backend
    from .loading import default_dtype

    return [
        ("dflash-mlx", __version__),
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


# Subcommands that run under mlx.launch (target sharded over the ranks, run in lockstep).
SHARDED_COMMANDS = ("generate", "chat", "serve", "bench", "info")
COMMANDS = {
    "convert": (convert, "convert a drafter to the dflash-mlx layout"),
    "generate": (oneshot, "generate a reply to one prompt"),
    "chat": (chat, "chat with a model in the terminal"),
    "serve": (serve, "serve an OpenAI-compatible HTTP API"),
    "cache-prompt": (cache_prompt, "prefill a long prompt once and save it for generate/serve"),
    "bench": (bench, "benchmark DFlash against mlx-lm's own decoding"),
    "demo": (demo, "SmolLM2 with the shipped drafter: streamed reply, tau, speedup"),
    "train": (train, "train a DFlash drafter (data, features, fit, export)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-mlx", description="DFlash speculative decoding on MLX"
    )
    parser.add_argument("--version", action="version", version=f"dflash-mlx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(func=module.run)

    p = sub.add_parser("info", help="show MLX, BLAS, Metal and cache information, or a drafter's")
    p.add_argument("draft", nargs="?", help="describe this drafter (directory or hub id) instead")
    p.set_defaults(func=info)
    return parser


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


if __name__ == "__main__":
    main()
