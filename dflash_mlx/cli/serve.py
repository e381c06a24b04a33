"""`dflash-mlx serve`: an OpenAI-compatible HTTP API, like `mlx_lm.server`.

    dflash-mlx serve --model M --draft D            # http://127.0.0.1:8080/v1

The web stack (fastapi, uvicorn, pydantic) is imported only when this command
runs, so the other commands work on machines that do not have it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..options import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_PROMPT_CACHE_SIZE,
    DEFAULT_PROMPT_CONCURRENCY,
    DEFAULT_REQUEST_TIMEOUT_S,
    add_cache_file_argument,
    add_model_arguments,
    json_object,
)

WEB_STACK = ("fastapi", "uvicorn", "pydantic", "starlette")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, max_tokens=512)
    parser.add_argument(
        "--chat-template",
        dest="chat_template_source",
        metavar="CHAT_TEMPLATE",
        type=template_source,
        help="the chat template to use instead of the tokenizer's: a Jinja template, or a file "
        "holding one (default: the tokenizer's)",
    )
    parser.add_argument(
        "--chat-template-args",
        type=json_object,
        default={},
        help="""chat template arguments as a JSON object, e.g. '{"enable_thinking": false}' """
        "(a request's chat_template_kwargs override them)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)"
    )
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--decode-concurrency",
        "--max-batch",
        dest="max_batch",
        metavar="DECODE_CONCURRENCY",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="requests decoded together, one verify forward per cycle for all of them "
        f"(default {DEFAULT_MAX_BATCH}; 1: one at a time, as under mlx.launch)",
    )
    parser.add_argument(
        "--prompt-concurrency",
        type=int,
        default=DEFAULT_PROMPT_CONCURRENCY,
        help="new requests prefilled between two decoding cycles at most, so that a burst of "
        f"prompts holds the requests already decoding back by a bounded time (default "
        f"{DEFAULT_PROMPT_CONCURRENCY}, as mlx_lm.server's)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests that may wait beyond the batch; more get 503 with Retry-After "
        f"(default {DEFAULT_MAX_QUEUE})",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=int,
        default=DEFAULT_PROMPT_CACHE_SIZE,
        help="conversations whose caches are kept, so their next turn is prefilled only from "
        f"where it differs; least recently used out first (default {DEFAULT_PROMPT_CACHE_SIZE})",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=int,
        default=DEFAULT_PROMPT_CACHE_BYTES,
        help="bytes those caches may hold, target and drafter together "
        f"(default {DEFAULT_PROMPT_CACHE_BYTES})",
    )
    add_cache_file_argument(parser)
    parser.add_argument(
        "--record",
        metavar="DIR",
        type=Path,
        help="keep every finished reply's prompt and token ids in DIR/replies.jsonl, to "
        "fine-tune the drafter on this traffic (`dflash-mlx train finetune --from DIR`); this "
        "stores the conversations themselves, on this machine only (default: off)",
    )
    add_limit_arguments(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the server's log level, in any case",
    )


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Who may call the server and how much a client may take of it."""
    parser.add_argument(
        "--allowed-hosts",
        type=comma_list,
        default=(),
        help="more names requests may give in their Host header, comma-separated, e.g. "
        "'my-mac.local,192.168.1.20' ('*': any); the bound address, localhost, 127.0.0.1 and "
        "[::1] always may; others get 421, so a web page cannot reach the server by pointing "
        "its own name at this address (DNS rebinding)",
    )
    parser.add_argument(
        "--allowed-origins",
        type=comma_list,
        default=(),
        help="web origins whose pages may call the API (CORS), comma-separated, e.g. "
        "'http://localhost:3000' ('*': any); default: none, CORS off",
    )
    parser.add_argument(
        "--api-key",
        help="a key every request must send as 'Authorization: Bearer <key>' (the openai "
        "client's api_key); others get 401. Use it when --host is beyond this machine",
    )
    parser.add_argument(
        "--docs", action="store_true", help="serve the API's docs: /docs, /redoc, /openapi.json"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections; at the limit a new one closes the longest idle one, and "
        f"requests beyond it get 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a client has to send a whole request, head and body; slower ones are "
        f"dropped (default {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )


def template_source(text: str) -> str:
    """`--chat-template`: `text` itself where it is a Jinja template (it has a '{'), else the
    template in the file it names."""
    if "{" in text:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file {text} (and no Jinja template: it has no '{{')")
    return path.read_text()


def comma_list(text: str) -> tuple[str, ...]:
    """A comma-separated flag value's items."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def run(args: argparse.Namespace) -> None:
    try:
        from .. import serve
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if package not in WEB_STACK:
            raise
        raise ValueError(
            f"serving needs {package}, which is not installed: pip install fastapi uvicorn"
        ) from None
    serve.run(args)


if __name__ == "__main__":
    from . import run_as_module

    run_as_module("serve")
