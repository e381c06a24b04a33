"""The FastAPI app (middleware, error handlers, routes) and the uvicorn server that runs it
until Ctrl-C or SIGTERM, which stop every generation so each reply ends with what it has.

At most `--max-connections` open connections (the longest idle one makes room for a new
one), each given `--request-timeout` seconds to send a whole request (uvicorn alone waits
forever for one): `connections.GuardedH11`. Under `mlx.launch` rank 0 serves HTTP and the
other ranks follow its worker.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from ..models.distributed import Lockstep, world_group
from ..models.target import TargetAdapter
from ..options import generation_settings, load_cache_file, load_models, processor_settings
from .connections import GuardedH11, Repeats
from .guards import LOCAL_HOSTS, NOISY, HostCheck, KeyCheck, Policy, host_name, served_hosts
from .page import FILES, add_page
from .record import Recorder
from .routes import Api
from .shapes import error
from .worker import Worker

log = logging.getLogger(__name__)

STARTUP_FAILURE = 3  # the exit status of a server that could not start, as `uvicorn.run`'s
KEEP_ALIVE_S = 5  # an idle connection is closed after this long
OPEN_PATHS = ("/health", *FILES)  # served without the API key


def create_app(worker: Worker, model_id: str, policy: Policy | None = None) -> FastAPI:
    """The FastAPI app serving `worker`'s model under the name `model_id`, to the clients
    `policy` lets in (by default: local ones, without CORS or docs)."""
    policy = policy or Policy()
    api = Api(worker, model_id, policy)
    docs = {} if policy.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="dflash-mlx", lifespan=api.lifespan, **docs)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_fault)
    if policy.api_key:  # inside CORS, which answers browsers' preflights without a key
        app.add_middleware(KeyCheck, key=policy.api_key, open_paths=frozenset(OPEN_PATHS))
    if policy.origins:
        app.add_middleware(
            JsonCors,
            allow_origins=list(policy.origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(HostCheck, hosts=policy.hosts)  # added last: runs first
    add_page(app)
    app.get("/health")(api.health)
    app.head("/health", include_in_schema=False)(api.health)  # as load balancers probe
    # Each route also without the /v1 prefix, as mlx_lm.server and OpenAI-style clients use.
    for path in ("/models", "/v1/models"):
        app.get(path)(api.models)
    for path in ("/chat/completions", "/v1/chat/completions"):
        app.post(path)(api.chat_completions)
    for path in ("/completions", "/v1/completions"):
        app.post(path)(api.completions)
    return app


class JsonCors(CORSMiddleware):
    """Starlette's CORS, its refused preflights (an origin, method or header not allowed)
    answered in OpenAI's JSON shape instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refusal = error(response.status_code, bytes(response.body).decode())
        kept = {k: v for k, v in response.headers.items() if not k.startswith("content-")}
        refusal.headers.update(kept)
        return refusal


async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a method a route does not take) in OpenAI's
    shape too, not as `{"detail": ...}`."""
    response = error(exc.status_code, f"{exc.detail}")
    response.headers.update(exc.headers or {})
    return response


async def server_fault(_: Request, exc: Exception) -> JSONResponse:
    """A bug's 500 in OpenAI's shape too (uvicorn still logs it, with its traceback)."""
    return error(500, f"internal error: {exc}")


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
        ("prompt_concurrency", 1),
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
    lockstep = Lockstep(world_group(), args.rank_timeout, "dflash-mlx serve")
    recorder = None  # rank 0's only: the other ranks' replies are the same
    if args.record is not None and lockstep.leader:
        vocab_size = TargetAdapter(model).vocab_size
        recorder = Recorder(args.record, model_name(args.model), vocab_size)
    worker = Worker(
        model,
        tokenizer,
        draft,
        generation_settings(args, tokenizer),
        args.chat_template_args,
        processor_settings(args),
        args.max_queue,
        lockstep,
        (args.prompt_cache_size, args.prompt_cache_bytes),
        args.max_batch,
        args.prompt_concurrency,
        recorder,
    )
    if cached is not None:  # requests that start with the cached prompt go on from it
        worker.caches.put(cached)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    if recorder is not None:
        log.warning("--record: every finished reply's prompt and tokens go to %s", recorder.path)
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
