"""`dflash-mlx serve`: an OpenAI-compatible HTTP API, like `mlx_lm.server`.

    dflash-mlx serve --model M --draft D            # http://127.0.0.1:8080/v1

The web stack (fastapi, uvicorn, pydantic) is imported only when this command
runs, so the other commands work on machines that do not have it.
"""

from __future__ import annotations

import argparse

from .session import add_model_arguments

WEB_STACK = ("fastapi", "uvicorn", "pydantic", "starlette")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, max_tokens=512)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )


def run(args: argparse.Namespace) -> None:
    try:
        from . import server
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if package not in WEB_STACK:
            raise
        raise ValueError(
            f"serving needs {package}, which is not installed: pip install fastapi uvicorn"
        ) from None
    server.run(args)
