"""The OpenAI-compatible HTTP API behind `dflash-mlx serve` (flags in `serve.py`).

Built on FastAPI + uvicorn, not on `mlx_lm.server`: that server's handler is
wired to its own generation machinery (batch generator, LRU prompt cache,
mlx-lm's `stream_generate`), so taking our generator would mean copying most of
it. FastAPI gives validated requests (pydantic) and streaming on a maintained
ASGI stack, and leaves us only the OpenAI response shapes to write.

One worker thread owns the model and runs the generations, up to `--max-batch`
of them together; more wait their turn in arrival order, at most `--max-queue` of
them (more get 503 with Retry-After). The worker shares one prompt cache across requests (a
follow-up turn of a chat prefills only its new part). A client that
disconnects, streaming or not, sets its job's stop flag, which the worker
checks after every verify cycle; Ctrl-C or SIGTERM stops every job so, and each
reply ends with what it has (finish reason "length") before the server exits. A
request's failure ends its own reply only (a 500, or an error event), and only its
message crosses to the event loop: the error's frames hold the generation's caches.
Chat templates are rendered and prompts tokenized on a thread of their own, so a
long prompt does not stall the event loop (and every open stream with it).

Every number a request sends is bounded to what the model and MLX take (400 naming
the field): `max_tokens` by the model's context, indices by MLX's 32-bit ones,
sampling numbers so logits stay finite. A request names the model `/v1/models`
lists, or none (404 `model_not_found` otherwise). Every error is JSON in OpenAI's
shape, a logprob that is not a number reads as -9999.0.

Clients are bounded before they cost anything: only JSON bodies (415 otherwise) up
to `--max-body-bytes` (413, the rest of the body then read and dropped so a client
still sending reads the answer), only Host names this server answers to (421: DNS
rebinding), no CORS unless `--allowed-origins`; at most `--max-connections` open
connections (the longest idle one makes room for a new one), each given
`--request-timeout` seconds to send a whole request (uvicorn alone waits forever for
one). Errors a flood of such clients causes are logged at the 1st, 10th, 100th...
time, not once each.

Under `mlx.launch` rank 0 serves HTTP; its worker sends each job (prompt ids
and settings) to the other ranks, which run it in lockstep and discard the
output, so requests are still generated one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import mlx.core as mx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.server import ToolCallFormatter
from mlx_lm.tokenizer_utils import TokenizerWrapper
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from .chat_format import chat_prompt, encode_prompt
from .connections import GuardedH11, Repeats
from .distributed import Lockstep, abort, is_backend_error, world_group
from .generate import stream_generate
from .loop import make_batch
from .prompt_cache import PromptCache, PromptCacheStore, make_prompt_cache
from .response import GenerationResponse
from .session import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_PROMPT_CACHE_SIZE,
    PROCESSOR_SETTINGS,
    ReplyStats,
    generation_settings,
    load_cache_file,
    load_models,
    processor_settings,
)
from .settings import GenerationSettings
from .stops import stop_at_strings
from .target import TargetAdapter

log = logging.getLogger(__name__)


class Strict(BaseModel):
    # NaN and infinities parse from JSON in Python, and would reach the sampler as settings
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


MAX_SEED = 2**32 - 1  # what a request's `seed` may be
MAX_INDEX = 2**31 - 1  # MLX slices and counts with 32-bit integers
# Sampling numbers far past any useful value, bounded so logits stay finite: 1e308 is
# infinite in float32 already, the sampler scales logits by 1 / temperature (infinite for a
# temperature of 1e-300), a repetition penalty multiplies or divides them, and the additive
# penalties and biases add to them. An infinite logit makes every probability NaN.
MIN_SCALE, MAX_SCALE = 0.01, 100.0  # a temperature or repetition penalty, but for 0 (off)
MAX_PENALTY = 1000.0  # presence and frequency penalties, either sign
MAX_LOGIT_BIAS = 100.0  # as OpenAI's
# What a logprob that is not a number, or -inf, reads as in JSON (as OpenAI writes it).
NO_LOGPROB = -9999.0
# A prompt's text is bounded before it is tokenized, at this many characters per token
# of the model's context: more than any tokenizer packs into one token.
PROMPT_CHARS_PER_TOKEN = 64
# Stop strings a request may give, and their length: the matcher's work per piece of
# text grows with both.
MAX_STOPS, MAX_STOP_CHARS = 16, 1000
# apply_chat_template's own arguments and the names a template is rendered with: a
# request setting one would pick the template or how it is applied, which only the
# model (and the operator's --chat-template-args) decide.
TEMPLATE_OWN = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# Fields that change the output but that this server cannot honour: a request
# setting one to anything but a value that changes nothing is refused, naming it.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tool_choice": ("auto",),
    "functions": (),
    "function_call": (),
    "xtc_probability": (0, 0.0),
    "adapters": (),
}


class FieldError(ValueError):
    """A whole request's check that found one field wrong (its error names `field`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: dict[str, Any]

    @field_validator("arguments", mode="before")
    @classmethod
    def parse_arguments(cls, value: Any) -> Any:
        """OpenAI sends the arguments as a JSON string; templates want the object."""
        return json.loads(value) if isinstance(value, str) else value


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (text content, parsed tool arguments)."""
        message = self.model_dump(exclude_none=True)
        if not isinstance(self.content, str):
            message["content"] = "".join(p.text for p in self.content or [])
        return message


class StreamOptions(Strict):
    include_usage: bool = False


class CompletionParams(Strict):
    """Fields both endpoints take; unset sampling fields fall back to the server's flags."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INDEX)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INDEX)
    temperature: float | None = Field(None, ge=0, le=MAX_SCALE)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_INDEX)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        None
    )
    repetition_penalty: float | None = Field(None, ge=0, le=MAX_SCALE)
    repetition_context_size: int | None = Field(None, ge=0, le=MAX_INDEX)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_context_size: int | None = Field(None, ge=0, le=MAX_INDEX)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_context_size: int | None = Field(None, ge=0, le=MAX_INDEX)
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def alternatives(self) -> int | None:
        """How many most likely tokens to report per token; None: no logprobs.

        `logprobs=true` with `top_logprobs` (chat, mlx-lm), or `logprobs=k` (the
        completions API); `top_logprobs` alone also asks, as in `mlx_lm.server`.
        """
        if isinstance(self.logprobs, bool) or self.logprobs is None:
            return self.top_logprobs or 0 if self.logprobs or self.top_logprobs else None
        return self.logprobs

    @field_validator("temperature", "repetition_penalty")
    @classmethod
    def off_or_in_scale(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_SCALE:
            raise ValueError(f"0 or at least {MIN_SCALE}, got {value}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def token_ids(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        if not all(k.isdigit() for k in bias):
            raise ValueError("keys must be token ids")
        return {int(k): v for k, v in bias.items()}

    @field_validator("stop")
    @classmethod
    def few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name, harmless in UNSUPPORTED.items():
                value = body.get(name)
                if value is not None and value not in harmless:
                    message = f"{name}={json.dumps(value)} is not supported by this server"
                    raise FieldError(name, message)
        return body

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []


class ChatRequest(CompletionParams):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(TEMPLATE_OWN.intersection(kwargs or {}))
        if taken:
            raise ValueError(f"{taken[0]} is not for a request to set: the template is the model's")
        return kwargs


class TextRequest(CompletionParams):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, prompt: Any) -> str | list[int]:
        """A list of prompts is a batch; one prompt per request is served (n = 1)."""
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise ValueError(f"one prompt per request is supported, got {len(prompt)}")
            return prompt[0]
        return prompt


def error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    response: type[JSONResponse] = JSONResponse,
) -> JSONResponse:
    """An error in OpenAI's shape: the client's request (4xx) or the server's fault (5xx)."""
    return response(error_body(status, message, param, code), status_code=status)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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


async def parse(request: Request, schema: type[Strict], max_bytes: int) -> Any:
    """The validated request body, or an error response naming the first problem.

    Parsed here rather than by FastAPI's body injection so errors are in OpenAI's
    shape. Only JSON is taken (415): any other type a web page may send to this
    server without the browser asking it first (a CORS "simple request"). A body
    over `max_bytes` is refused (413) before it is parsed, or read whole.
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
        return schema.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        found = first.get("ctx", {}).get("error")
        where = ".".join(str(p) for p in first["loc"]) or getattr(found, "field", "")
        message = first["msg"].removeprefix("Value error, ")
        return error(400, f"{where or 'body'}: {message}", where or None)


async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a method a route does not take) in OpenAI's
    shape too, not as `{"detail": ...}`."""
    response = error(exc.status_code, f"{exc.detail}")
    response.headers.update(exc.headers or {})
    return response


async def server_fault(_: Request, exc: Exception) -> JSONResponse:
    """A bug's 500 in OpenAI's shape too (uvicorn still logs it, with its traceback)."""
    return error(500, f"internal error: {exc}")


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


def text_size(value: Any) -> int:
    """Characters in the strings of a JSON value (keys too): what a template may render."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(k) + text_size(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(map(text_size, value))
    return 0


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
    <key>` (compared in constant time). /health stays open for load balancers."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
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


RETRY_AFTER_S = 5
# The finish reason of a reply whose generation stopped before its end (the server shutting
# down): cut short, as by its token limit. OpenAI's reasons have none of its own.
CUT_SHORT = "length"
STARTUP_FAILURE = 3  # the exit status of a server that could not start, as `uvicorn.run`'s
KEEP_ALIVE_S = 5  # an idle connection is closed after this long


class QueueFull(Exception):
    """More requests are waiting for the worker than the server takes."""


class GenerationFailed(Exception):
    """A request's own generation failed (the others go on)."""


@dataclass
class Failed:
    """What the worker thread sends a request whose generation failed."""

    message: str


class Worker:
    """Runs generations on a single thread, where the model and caches live: up to
    `max_batch` requests decoded together (`loop.Batch`: one verify forward per cycle for
    all of them), each streaming its tokens as its cycles commit them; the rest wait."""

    def __init__(
        self,
        model,
        tokenizer,
        draft,
        defaults: GenerationSettings,
        template_kwargs: dict[str, Any] | None = None,
        processor_settings: dict[str, Any] | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE,
        lockstep: Lockstep | None = None,
        prompt_caches: tuple[int, int] = (DEFAULT_PROMPT_CACHE_SIZE, DEFAULT_PROMPT_CACHE_BYTES),
        max_batch: int = DEFAULT_MAX_BATCH,
    ):
        """`defaults`: the flags' generation settings, which requests override;
        `processor_settings` the flags' penalties, the base of a request's own;
        `lockstep` the ranks that run every job under `mlx.launch` (one job at a time
        there: every rank must run the same forwards, and ranks do not agree on when a
        request joins a batch); `prompt_caches` how many conversations' caches to keep,
        and in how many bytes at most; `max_batch` how many requests decode together."""
        self.model, self.tokenizer, self.draft, self.defaults = model, tokenizer, draft, defaults
        self.template_kwargs = template_kwargs or {}
        self.processor_settings = processor_settings or {}
        target = TargetAdapter(model)
        self.max_context, self.vocab_size = target.max_context, target.vocab_size
        self.caches = PromptCacheStore(lambda: make_prompt_cache(model, draft), *prompt_caches)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-tokenize")
        self.max_queue = max_queue
        self.lockstep = lockstep or Lockstep(None, 0, "serve")
        self.max_batch = max_batch if self.lockstep.group is None else 1
        self.batch = make_batch(model, draft)
        self.waiting: deque[tuple[Job, threading.Event, Callable]] = deque()
        self.scheduling = False  # whether the worker thread runs `_schedule`
        self.closing = False  # the server is shutting down: every generation stops
        self.pending = 0  # generations waiting or running
        self._pending_lock = threading.Lock()

    def stop_all(self) -> None:
        """Stop every generation, running or waiting, at its next cycle: the server is
        shutting down, and each reply ends with what it has (`CUT_SHORT`). A flag, not a
        lock: this runs in a signal handler, on the thread that may hold the lock."""
        self.closing = True

    def stopped(self, stop: threading.Event) -> bool:
        """Whether a generation must stop now: its client left, or the server is closing."""
        return stop.is_set() or self.closing

    def close(self) -> None:
        """Let the worker threads go, after the jobs they have. Each first frees the MLX
        streams and compiled graphs it made: left to the thread's exit during interpreter
        shutdown, MLX 0.32 frees them holding the GIL, which aborts the process
        ("terminate called without an active exception")."""
        for executor in (self.executor, self.tokenizing):
            executor.submit(mx.clear_streams).result()
            executor.shutdown()

    async def prepare(self, render: Callable[[], str | list[int]]) -> list[int]:
        """Token ids of the prompt `render` gives (e.g. a chat template), off the event loop."""

        def ids() -> list[int]:
            return encode_prompt(self.tokenizer, render())

        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, ids)

    def generate(
        self, job: Job, stop: Callable[[], bool] = lambda: False
    ) -> Iterator[GenerationResponse]:
        """The job's responses, ended early when `stop()` (on every rank under mlx.launch)."""
        settings = self.defaults.but(**job.kwargs)
        if job.seed is not None:  # its own stream: the other requests' draws never touch it
            settings = settings.but(seed=job.seed)
        if job.settings:
            processors = make_logits_processors(**{**self.processor_settings, **job.settings})
            settings = settings.but(logits_processors=processors)
        cache = self.caches.take(job.prompt)
        if job.seed is not None and settings.temperature > 0 and not settings.timed:
            # under a rule whose draws follow the cycles' shapes (not the coupled one), the
            # sizes of its cycles from a fresh policy: its seed alone decides its reply
            cache.block_policy = None
        responses = stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            job.prompt,
            settings=settings,
            prompt_cache=cache,
            batch=self.batch,
        )
        return self.lockstep.steps(self.keeping(cache, stop_at_strings(responses, job.stops)), stop)

    def keeping(
        self, cache: PromptCache, responses: Iterator[GenerationResponse]
    ) -> Iterator[GenerationResponse]:
        """`responses`, then `cache` back in the store once they end or are stopped: the
        caches hold what `cache.tokens` lists, and anything past it is trimmed when reused.
        Not after an error, which may leave them between two states."""
        try:
            yield from responses
        except GeneratorExit:
            self.caches.put(cache)
            raise
        self.caches.put(cache)

    def follow(self) -> None:
        """Ranks but 0: run rank 0's jobs until it shuts down; a job's error (the same
        on every rank) ends only that job, as on rank 0."""
        for unit in self.lockstep.units():
            try:
                for _ in self.generate(Job.from_unit(unit)):
                    pass
            except Exception as exc:
                if is_backend_error(exc):
                    raise
                log.info("job failed: %s", exc)

    def _schedule(self) -> None:
        """The worker thread's loop: admit waiting requests up to `max_batch`, then hand each
        running one its next response (a batch cycle advances them all), until none is
        left."""
        running: list[Running] = []
        while True:
            with self._pending_lock:
                room = min(len(self.waiting), self.max_batch - len(running))
                admitted = [self.waiting.popleft() for _ in range(room)]
                if not running and not admitted:
                    self.scheduling = False
                    return
            running += filter(None, [self._start(*waiting) for waiting in admitted])
            running = [r for r in running if self._advance(r)]

    def _start(self, job: Job, stop: threading.Event, put: Callable) -> Running | None:
        """The request's running generation, or None when it ended before starting."""
        started = Running(job, stop, put, (response for response in ()))
        if self.stopped(stop):  # the client left while waiting its turn
            self._end(started)
            return None
        log.info("generating: %d prompt tokens", len(job.prompt))
        try:
            self.lockstep.send(asdict(job))
            started.responses = self.generate(job, partial(self.stopped, stop))
        except Exception as exc:
            self._fail(started, exc)
            return None
        return started

    def _advance(self, running: Running) -> bool:
        """Hand the request its next response; False once it has ended."""
        job = running.job
        try:
            response = next(running.responses)
            entries = None
            if job.top_logprobs is not None:
                entries = logprob_entries(self.tokenizer, response, job.top_logprobs)
        except StopIteration:
            self._end(running)
            return False
        except Exception as exc:
            self._fail(running, exc)
            return False
        running.put((response, entries))
        if running.stop.is_set() and response.finish_reason is None:
            log.info("client gone: stopped after %d tokens", response.generation_tokens)
        return True

    def _fail(self, running: Running, exc: Exception) -> None:
        """End the request with its error's message: only the message crosses to the event
        loop, not the error, whose frames hold this generation's caches and arrays."""
        log.warning("generation failed: %s", exc)
        running.put(Failed(str(exc)))
        if self.lockstep.group is not None and is_backend_error(exc):
            abort(f"dflash-mlx serve: error: rank 0: {exc}")  # the ranks are out of step
        self._end(running)

    def _end(self, running: Running) -> None:
        running.responses.close()
        with self._pending_lock:
            self.pending -= 1
        running.put(None)

    def submit(
        self, job: Job, stop: threading.Event
    ) -> AsyncIterator[tuple[GenerationResponse, list[dict] | None]]:
        """Queue a generation; iterate the result for its responses (with their logprobs
        entries when asked for). QueueFull if no room."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        with self._pending_lock:
            if self.pending >= self.max_batch + self.max_queue:  # max_batch run, max_queue wait
                raise QueueFull
            self.pending += 1
            self.waiting.append((job, stop, put))
            if not self.scheduling:
                self.scheduling = True
                self.executor.submit(self._schedule)

        async def responses() -> AsyncIterator[tuple[GenerationResponse, list[dict] | None]]:
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Failed):
                        raise GenerationFailed(item.message)
                    yield item
            finally:
                stop.set()

        return responses()


@dataclass
class Running:
    """A request the worker thread is generating: its job, its client's stop flag, where
    its responses go (`put`) and where they come from."""

    job: Job
    stop: threading.Event
    put: Callable[[Any], None]
    responses: Iterator[GenerationResponse]


@dataclass
class Job:
    """One request's generation, as the worker thread runs it (JSON-able, to send to ranks)."""

    prompt: list[int]
    kwargs: dict[str, Any]  # generation settings, over the server's defaults
    settings: dict[str, Any] = field(default_factory=dict)  # penalties, over the server's
    seed: int | None = None
    stops: list[str] = field(default_factory=list)
    top_logprobs: int | None = None  # None: no logprobs

    @classmethod
    def from_unit(cls, unit: dict[str, Any]) -> Job:
        """The job rank 0 sent as JSON (whose object keys are strings)."""
        job = cls(**unit)
        if "logit_bias" in job.settings:
            job.settings["logit_bias"] = {int(k): v for k, v in job.settings["logit_bias"].items()}
        return job


def logprob_entries(
    tokenizer: TokenizerWrapper, response: GenerationResponse, top: int
) -> list[dict[str, Any]]:
    """`mlx_lm.server`'s logprobs entries for a response's tokens: each token's
    log-probability and the `top` most likely tokens at its position, best first."""
    logprobs = response.logprobs
    ids = mx.array(response.tokens)[:, None]
    chosen = mx.take_along_axis(logprobs, ids, axis=-1)[:, 0]
    best = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top] if top else ids[:, :0]
    best_logprobs = mx.take_along_axis(logprobs, best, axis=-1)
    order = mx.argsort(-best_logprobs, axis=-1)
    best = mx.take_along_axis(best, order, axis=-1).tolist()
    best_logprobs = mx.take_along_axis(best_logprobs, order, axis=-1).tolist()

    def entry(token: int, logprob: float) -> dict[str, Any]:
        logprob = logprob if math.isfinite(logprob) else NO_LOGPROB
        return {"id": token, "token": tokenizer.convert_ids_to_tokens(token), "logprob": logprob}

    return [
        {**entry(token, logprob), "top_logprobs": [entry(*e) for e in zip(ts, lps, strict=True)]}
        for token, logprob, ts, lps in zip(
            response.tokens, chosen.tolist(), best, best_logprobs, strict=True
        )
    ]


def create_app(worker: Worker, model_id: str, policy: Policy | None = None) -> FastAPI:
    """The FastAPI app serving `worker`'s model under the name `model_id`, to the clients
    `policy` lets in (by default: local ones, without CORS or docs)."""
    policy = policy or Policy()
    max_chars = (
        PROMPT_CHARS_PER_TOKEN * worker.max_context if worker.max_context else policy.max_body_bytes
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if worker.lockstep.group is not None:  # shutting down: after the last job, the end
            done = worker.executor.submit(worker.lockstep.send, None)
            await asyncio.wrap_future(done)
        await asyncio.get_running_loop().run_in_executor(None, worker.close)

    docs = {} if policy.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="dflash-mlx", lifespan=lifespan, **docs)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_fault)
    if policy.api_key:  # inside CORS, which answers browsers' preflights without a key
        app.add_middleware(KeyCheck, key=policy.api_key)
    if policy.origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(policy.origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(HostCheck, hosts=policy.hosts)  # added last: runs first
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    # Each route also without the /v1 prefix, as mlx_lm.server and OpenAI-style clients use.
    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict:
        entry = {"id": model_id, "object": "model", "created": created, "owned_by": "dflash-mlx"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest, policy.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        if unknown := unknown_model(body.model):
            return unknown
        messages = [m.for_template() for m in body.messages]
        if too_long := over(text_size(messages) + text_size(body.tools), "messages"):
            return too_long
        template_kwargs = {**worker.template_kwargs, **(body.chat_template_kwargs or {})}
        try:
            ids = await worker.prepare(
                lambda: chat_prompt(worker.tokenizer, messages, body.tools, **template_kwargs)
            )
        except Exception as exc:  # a template may reject a conversation (e.g. role order)
            return error(400, f"messages: the chat template failed: {exc}", "messages")
        return await complete(request, body, ids, "chat.completion")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        body = await parse(request, TextRequest, policy.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        if unknown := unknown_model(body.model):
            return unknown
        if too_long := over(text_size(body.prompt), "prompt"):
            return too_long
        try:
            ids = await worker.prepare(lambda: body.prompt)
        except ValueError as exc:
            return error(400, str(exc), "prompt")
        return await complete(request, body, ids, "text_completion")

    def unknown_model(name: str | None) -> JSONResponse | None:
        """404 for a model this server does not serve, as OpenAI answers: a client asking
        for another model must not be answered by this one."""
        if name is None or name == model_id:
            return None
        message = f"the model {name!r} does not exist here; this server serves {model_id!r}"
        return error(404, message, "model", "model_not_found")

    def over(chars: int, name: str) -> JSONResponse | None:
        if chars <= max_chars:
            return None
        return error(400, f"{name}: {chars} characters, over the {max_chars} taken", name)

    async def complete(request: Request, body: CompletionParams, ids: list[int], kind: str):
        if any(not 0 <= t < worker.vocab_size for t in ids):
            return error(400, "prompt: token ids must be in the vocabulary", "prompt")
        room = worker.max_context - len(ids) if worker.max_context else None
        if room is not None and room < 1:
            return error(
                400, f"the prompt has {len(ids)} tokens; the context holds {worker.max_context}"
            )
        asked = body.max_completion_tokens or body.max_tokens
        if worker.max_context and asked and asked > worker.max_context:
            name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            message = f"{name}: {asked} is over the model's context of {worker.max_context} tokens"
            return error(400, message, name)
        requested = {
            "max_tokens": asked,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
        }
        kwargs = {k: v for k, v in requested.items() if v is not None}
        max_tokens = kwargs.get("max_tokens", worker.defaults.max_tokens)
        kwargs["max_tokens"] = min(max_tokens, room or max_tokens)
        settings = {k: getattr(body, k) for k in PROCESSOR_SETTINGS if getattr(body, k) is not None}
        if any(not 0 <= t < worker.vocab_size for t in settings.get("logit_bias", {})):
            return error(400, "logit_bias: token ids must be in the vocabulary", "logit_bias")
        stop = threading.Event()
        job = Job(ids, kwargs, settings, body.seed, body.stops, body.alternatives)
        try:
            responses = worker.submit(job, stop)
        except QueueFull:
            response = error(
                503, f"the server is busy ({worker.max_queue} requests waiting); retry later"
            )
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        tools = getattr(body, "tools", None)
        with_logprobs = job.top_logprobs is not None
        reply = Reply(kind, model_id, body.stream, worker.tokenizer, ids, tools, with_logprobs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                reply.events(responses, include_usage),
                media_type="text/event-stream",
                background=BackgroundTask(stop.set),
            )
        watcher = asyncio.create_task(stop_on_disconnect(request, stop))
        try:
            async for response, logprobs in responses:
                reply.add(response, logprobs)
        except Exception as exc:
            return error(500, f"generation failed: {exc}")
        finally:
            watcher.cancel()
        return reply.whole()

    return app


def initial_state(tokenizer: TokenizerWrapper, prompt: list[int]) -> str:
    """Where the reply starts in mlx-lm's text state machine: "reasoning" when the prompt
    opens a thinking block it does not close (as `mlx_lm.server` decides)."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(
        prompt
    ):
        state = "reasoning"
    return tokenizer.response_initial_state or state


async def stop_on_disconnect(request: Request, stop: threading.Event) -> None:
    """Set `stop` when the client of a non-streaming request goes away.

    The body has been read, so the next ASGI message is the disconnect.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stop.set()


class Reply:
    """The OpenAI response shapes for one request (as `mlx_lm.server` writes them), plus
    DFlash stats under `dflash`.

    A chat reply runs through mlx-lm's text state machine, which splits the text
    into content, reasoning (thinking models) and tool calls (parsed by the
    tokenizer's tool parser); a text completion is the raw text.
    """

    def __init__(
        self,
        kind: str,
        model_id: str,
        stream: bool,
        tokenizer: TokenizerWrapper,
        prompt: list[int],
        tools: list[dict[str, Any]] | None = None,
        with_logprobs: bool = False,
    ):
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id, self.kind, self.model_id, self.stream = (
            f"{prefix}-{uuid.uuid4().hex}",
            kind,
            model_id,
            stream,
        )
        self.created = int(time.time())
        self.stats = ReplyStats()
        self.chat = kind == "chat.completion"
        if self.chat:
            machine = make_text_state_machine(tokenizer)
            self.state = machine.make_state(initial_state(tokenizer, prompt))
        self.tool_calls = ToolCallFormatter(tokenizer.tool_parser, tools, stream)
        self.made_tool_call, self.previous = False, None
        self.content, self.reasoning, self.tool_text, self.calls = "", "", "", []
        self.with_logprobs, self.logprobs = with_logprobs, []

    def add(self, response: GenerationResponse, logprobs: list[dict] | None = None) -> None:
        """Take one response's text into content, reasoning and finished tool calls, and
        its tokens' logprobs entries (`logprob_entries`) if asked for."""
        self.stats.add(response)
        self.logprobs.extend(logprobs or [])
        if not self.chat:
            self.content += response.text
            return
        self.state, segments = TextStateMachine.split(self.state, response.text)
        if response.finish_reason == "stop":
            self.state, current = TextStateMachine.discard(self.state)
            segments.append((current, ""))
        elif response.finish_reason == "length":
            self.state, flushed, current = TextStateMachine.flush(self.state)
            segments.append((current, flushed))
        for state, text in segments:
            if state == "reasoning":
                self.reasoning += text
            elif state == "tool":
                self.tool_text += text
            elif state == "normal":
                if self.previous == "tool":
                    self.end_tool_call()
                self.content += text
            self.previous = state
        if response.finish_reason is not None and self.previous == "tool":
            self.end_tool_call()

    def end_tool_call(self) -> None:
        if self.tool_text:
            self.calls.append(self.tool_text)
            self.made_tool_call = True
        self.tool_text = ""

    def finish_reason(self) -> str:
        """Why the reply ended; `CUT_SHORT` when its generation was stopped before its end."""
        finish = self.stats.last.finish_reason if self.stats.last else None
        return "tool_calls" if finish == "stop" and self.made_tool_call else finish or CUT_SHORT

    def take(self) -> tuple[str, str, list, dict | None]:
        """Content, reasoning, formatted tool calls and logprobs gathered since the last take."""
        logprobs = {"content": self.logprobs} if self.with_logprobs else None
        taken = self.content, self.reasoning, self.tool_calls(self.calls), logprobs
        self.content, self.reasoning, self.calls, self.logprobs = "", "", [], []
        return taken

    def choice(self, finish_reason: str | None) -> dict:
        text, reasoning, tool_calls, logprobs = self.take()
        if not self.chat:
            if logprobs is not None:  # also in the completions API's own shape
                content = logprobs["content"]
                logprobs["tokens"] = [e["token"] for e in content]
                logprobs["token_logprobs"] = [e["logprob"] for e in content]
                logprobs["top_logprobs"] = [
                    {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content
                ]
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        message: dict[str, Any] = {"role": "assistant"}
        if not self.stream:
            message["content"] = text or None  # the schema requires the field
        elif text:
            message["content"] = text
        if reasoning:
            message["reasoning"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        key = "delta" if self.stream else "message"
        return {"index": 0, key: message, "finish_reason": finish_reason, "logprobs": logprobs}

    def usage(self) -> dict:
        d = self.stats.as_dict()
        prompt, completion = d["prompt_tokens"], d["generation_tokens"]
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def body(self, *choices: dict, **extra: Any) -> dict:
        chunk = self.stream and self.chat
        return {
            "id": self.id,
            "object": f"{self.kind}.chunk" if chunk else self.kind,
            "created": self.created,
            "model": self.model_id,
            "choices": list(choices),
            **extra,
        }

    def whole(self) -> dict:
        choice = self.choice(self.finish_reason())
        return self.body(choice, usage=self.usage(), dflash=self.stats.as_dict())

    async def events(
        self, responses: AsyncIterator[GenerationResponse], include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per verify cycle with something to show (a tool
        call once whole), stats on the last, then usage if asked, then [DONE]."""

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        if self.chat:
            yield event(self.body(self.choice(None)))  # the role, before any text
        try:
            async for response, logprobs in responses:
                self.add(response, logprobs)
                if response.finish_reason is None and (
                    self.content or self.reasoning or self.calls
                ):
                    yield event(self.body(self.choice(None)))
            # the last chunk, also of a reply stopped before its end
            yield event(self.body(self.choice(self.finish_reason()), dflash=self.stats.as_dict()))
        except Exception as exc:
            yield event(error_body(500, f"generation failed: {exc}"))
        if include_usage:
            yield event(self.body(usage=self.usage()))
        yield "data: [DONE]\n\n"


def model_name(model: str) -> str:
    """The model's id for clients: a local directory's name (where it lies on disk is
    none of theirs), or the hub id as given."""
    path = Path(model)
    return path.resolve().name if path.exists() else model


def check_flags(args: argparse.Namespace) -> None:
    """Bad limits fail before anything loads."""
    for flag, least in (
        ("max_queue", 0),
        ("max_batch", 1),
        ("max_body_bytes", 1),
        ("max_connections", 1),
        ("prompt_cache_size", 1),
        ("prompt_cache_bytes", 0),
    ):
        if getattr(args, flag) < least:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} must be at least {least}, got {getattr(args, flag)}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be above 0, got {args.request_timeout}")


class Server(uvicorn.Server):
    """uvicorn's server, which on Ctrl-C or SIGTERM also stops every generation at its next
    cycle: uvicorn waits for every open response to end before it exits, and a stream
    would otherwise run to its `max_tokens` first."""

    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.stop_all()
        super().handle_exit(sig, frame)


def serve_http(app: FastAPI, worker: Worker, args: argparse.Namespace) -> None:
    """Serve `app` (on `worker`) with the flags' bounds on connections and slow clients."""
    for name, messages in NOISY.items():  # uvicorn's logging set-up keeps loggers' filters
        logging.getLogger(name).addFilter(Repeats(messages))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=partial(GuardedH11, request_timeout=args.request_timeout),
        limit_concurrency=args.max_connections,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = Server(config, worker)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C while shutting down, as `uvicorn.run`
        pass
    if not server.started:  # e.g. the port taken: uvicorn has logged why
        raise SystemExit(STARTUP_FAILURE)


def run(args: argparse.Namespace) -> None:
    """Load the models from the flags and serve them until interrupted."""
    check_flags(args)
    model, tokenizer, draft = load_models(args)
    cached = load_cache_file(args, model, draft)
    worker = Worker(
        model,
        tokenizer,
        draft,
        generation_settings(args),
        args.chat_template_args,
        processor_settings(args),
        args.max_queue,
        Lockstep(world_group(), args.rank_timeout, "dflash-mlx serve"),
        (args.prompt_cache_size, args.prompt_cache_bytes),
        args.max_batch,
    )
    if cached is not None:  # requests that start with the cached prompt go on from it
        worker.caches.put(cached)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    if not worker.lockstep.leader:
        worker.follow()
        return
    policy = Policy(
        args.max_body_bytes,
        served_hosts(args.host, args.allowed_hosts),
        args.allowed_origins,
        args.docs,
        args.api_key,
    )
    if args.api_key is None and host_name(args.host) not in LOCAL_HOSTS:
        log.warning("serving %s without --api-key: anyone who can reach it may use it", args.host)
    serve_http(create_app(worker, model_name(args.model), policy), worker, args)
