"""What a client may send before it costs anything: who may call (Host names, the API key,
CORS origins: `Policy`) and how much (a JSON body of at most `--max-body-bytes`).

Only JSON bodies are taken (415 otherwise), up to `--max-body-bytes` (413, the rest of the
body then read and dropped so a client still sending reads the answer); only Host names
this server answers to (421: DNS rebinding); no CORS unless `--allowed-origins`. Errors a
flood of such clients causes are logged at the 1st, 10th, 100th... time, not once each
(`NOISY`, `connections.Repeats`).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from ..options import DEFAULT_MAX_BODY_BYTES
from .schemas import Strict
from .shapes import error
from .validation import Invalid, Validator

log = logging.getLogger(__name__)

DRAIN_BYTES = 64 * 2**20  # of a refused request's body read and dropped, at most


class Unread(JSONResponse):
    """An error answered before the request's body is read, which then reads the rest of the
    body and drops it (at most `DRAIN_BYTES`; `--request-timeout` bounds the time), as
    nginx lingers before closing. Closing with the body unread resets the connection, and a
    client still sending (urllib, requests, http.client) never reads the answer.

    The answer goes first, whole (its length is in its head): a client waiting to send its
    body (`Expect: 100-continue`, as curl's large uploads) reads it and sends nothing."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        drained = 0
        while drained <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
            drained += len(message.get("body", b""))
        await send({"type": "http.response.body", "body": b""})


CLIENT_GONE = "client gone before sending its whole request"


async def parse(request: Request, schema: type[Strict], max_bytes: int, validate: Validator) -> Any:
    """The validated request body, prepared (`validation.Prepared`), or an error response
    naming the first problem.

    Parsed here rather than by FastAPI's body injection so errors are in OpenAI's
    shape. Only JSON is taken (415): any other type a web page may send to this
    server without the browser asking it first (a CORS "simple request"). A body
    over `max_bytes` is refused (413) before it is parsed, or read whole; a large one is
    validated off the event loop (`validate`).
    """
    if media_type(request) != "application/json":
        return error(415, "Content-Type must be application/json", "Content-Type")
    try:
        body = await read_body(request, max_bytes)
    except ClientDisconnect:  # or dropped for sending too slowly (GuardedH11)
        log.info(CLIENT_GONE)
        return error(400, CLIENT_GONE)  # to no one: uvicorn drops it
    if body is None:
        message = f"the request body is over {max_bytes} bytes (--max-body-bytes)"
        return error(413, message, response=Unread)
    try:
        return await validate(schema, body)
    except Invalid as exc:
        return error(400, f"{exc.where or 'body'}: {exc.message}", exc.where or None)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as it is known to be over `limit` bytes: from
    its Content-Length (h11 has checked it is a number), else (chunked) while reading."""
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def host_name(host: str) -> str:
    """A Host header's name, without its port: "[::1]:8080" -> "[::1]"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1]
    return host.partition(":")[0]


def served_hosts(bound: str, allowed: tuple[str, ...] = ()) -> frozenset[str]:
    """The Host names to answer: the local ones, the bound address and `allowed`."""
    bound = f"[{bound}]" if ":" in bound else bound  # an IPv6 address, as Host gives it
    return frozenset([*LOCAL_HOSTS, bound.lower(), *map(host_name, allowed)])


@dataclass(frozen=True)
class Policy:
    """Who may call the server and how much one request may send (the flags)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    hosts: frozenset[str] = frozenset(LOCAL_HOSTS)  # Host names answered; "*": any
    origins: tuple[str, ...] = ()  # web origins CORS lets in; none: CORS off
    docs: bool = False  # /docs, /redoc, /openapi.json
    api_key: str | None = None  # the bearer token every API request must send; None: no check


class HostCheck:
    """ASGI middleware answering 421 to a request whose Host is not one of `hosts`.

    A web page can point its own domain name at this machine's address (DNS
    rebinding) and then call the server as its own origin, past CORS; its
    requests still name that domain in Host.
    """

    def __init__(self, app: ASGIApp, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.hosts:
            host = host_name(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                message = f"Host {host!r} is not served here (allow it with --allowed-hosts)"
                await error(421, message, "Host", response=Unread)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class KeyCheck:
    """ASGI middleware answering 401 to an API request without `Authorization: Bearer
    <key>` (compared in constant time). `open_paths` need none: /health for load balancers,
    the chat page's files (the page asks for the key, and sends it to the API)."""

    def __init__(self, app: ASGIApp, key: str, open_paths: frozenset[str]):
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            matches = hmac.compare_digest(token.strip(), self.key)
            if not (matches and scheme.lower() == b"bearer"):  # a case-insensitive name (RFC 9110)
                message = "a valid API key is needed (Authorization: Bearer <key>)"
                response = error(401, message, response=Unread)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Per logger, the messages a flood of bad connections logs once each (`Repeats`).
NOISY = {
    "asyncio": (
        "socket.accept() out of system resource",  # e.g. too many open files
        # its retries, a second later, when the server has stopped meanwhile
        "Exception in callback BaseSelectorEventLoop._start_serving",
    ),
    "uvicorn.error": ("Exceeded concurrency limit", "Invalid HTTP request received"),
    __name__: (CLIENT_GONE,),
}
