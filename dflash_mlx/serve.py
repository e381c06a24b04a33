"""`dflash-mlx serve`: an OpenAI-compatible HTTP API, like `mlx_lm.server`.

    dflash-mlx serve --model M --draft D            # http://127.0.0.1:8080/v1

The web stack (fastapi, uvicorn, pydantic) is imported only when this command
runs, so the other commands work on machines that do not have it.
"""

from __future__ import annotations

import argparse

from .session import DEFAULT_MAX_QUEUE, add_model_arguments, json_object

WEB_STACK = ("fastapi", "uvicorn", "pydantic", "starlette")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, max_tokens=512)
    parser.add_argument(
        "--chat-template-args",
        type=json_object,
        default={},
        help="""chat template arguments as a JSON object, e.g. '{"enable_thinking": false}' """
        "(a request's chat_template_kwargs override them)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait for the model; more get 503 with Retry-After",
    )
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
