"""The OpenAI-compatible HTTP API behind `dflash-mlx serve` (flags in `serve.py`).

Built on FastAPI + uvicorn, not on `mlx_lm.server`: that server's handler is
wired to its own generation machinery (batch generator, LRU prompt cache,
mlx-lm's `stream_generate`), so taking our generator would mean copying most of
it. FastAPI gives validated requests (pydantic) and streaming on a maintained
ASGI stack, and leaves us only the OpenAI response shapes to write.

One worker thread owns the model and runs one generation at a time; requests
wait their turn in arrival order. The worker shares one prompt cache across
requests (a follow-up turn of a chat prefills only its new part). A streaming
client that disconnects sets its job's stop flag, which the worker checks
after every verify cycle before moving on to the next request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import mlx.core as mx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask

from .chat_format import chat_prompt
from .generate import GenerationResponse, encode_prompt, make_prompt_cache, stream_generate
from .session import ReplyStats, generation_kwargs, load_models
from .target import TargetAdapter

log = logging.getLogger(__name__)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(Strict):
    include_usage: bool = False


class CompletionParams(Strict):
    """Fields both endpoints take; unset sampling fields fall back to the server's flags."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    n: Literal[1] = 1
    stop: None | Literal[""] | list[str] = Field(None, max_length=0)
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatRequest(CompletionParams):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class TextRequest(CompletionParams):
    prompt: str | list[int] = Field(min_length=1)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=status)


async def parse(request: Request, schema: type[Strict]) -> Any:
    """The validated request body, or a 400 response naming the first problem.

    Parsed here rather than by FastAPI's body injection so any content type is
    accepted (as `mlx_lm.server` does) and errors are 400s in OpenAI's shape.
    """
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return error(400, f"{where or 'body'}: {first['msg']}", where or None)


class Worker:
    """Runs generations one at a time on a single thread; the model and cache live there."""

    def __init__(self, model, tokenizer, draft, defaults: dict[str, Any]):
        self.model, self.tokenizer, self.draft, self.defaults = model, tokenizer, draft, defaults
        target = TargetAdapter(model)
        self.max_context, self.vocab_size = target.max_context, target.vocab_size
        self.cache = make_prompt_cache(model, draft)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")

    def _run(self, prompt, kwargs, seed, stop: threading.Event, put) -> None:
        try:
            if stop.is_set():  # the client left while waiting its turn
                return
            if seed is not None:
                mx.random.seed(seed)
            responses = stream_generate(
                self.model, self.draft, self.tokenizer, prompt, prompt_cache=self.cache, **kwargs
            )
            try:
                for response in responses:
                    put(response)
                    if stop.is_set():
                        log.info("client gone: stopped after %d tokens", response.generation_tokens)
                        break
            finally:
                responses.close()
        except Exception as exc:
            put(exc)
        finally:
            put(None)

    def submit(
        self, prompt: list[int], kwargs: dict[str, Any], seed: int | None, stop: threading.Event
    ) -> AsyncIterator[GenerationResponse]:
        """Queue a generation; iterate the result for its responses."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        self.executor.submit(self._run, prompt, kwargs, seed, stop, put)

        async def responses() -> AsyncIterator[GenerationResponse]:
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                stop.set()

        return responses()


def create_app(worker: Worker, model_id: str) -> FastAPI:
    """The FastAPI app serving `worker`'s model under the name `model_id`."""
    app = FastAPI(title="dflash-mlx")
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": model_id, "object": "model", "created": created, "owned_by": "dflash-mlx"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        if isinstance(body, JSONResponse):
            return body
        messages = [
            {
                "role": m.role,
                "content": m.content
                if isinstance(m.content, str)
                else "".join(p.text for p in m.content),
            }
            for m in body.messages
        ]
        try:
            prompt = chat_prompt(worker.tokenizer, messages)
        except Exception as exc:  # a template may reject a conversation (e.g. role order)
            return error(400, f"messages: the chat template failed: {exc}", "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await complete(body, prompt, max_tokens, "chat.completion")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, TextRequest)
        if isinstance(body, JSONResponse):
            return body
        return await complete(body, body.prompt, body.max_tokens, "text_completion")

    async def complete(body: CompletionParams, prompt, max_tokens: int | None, kind: str):
        try:
            ids = encode_prompt(worker.tokenizer, prompt)
        except ValueError as exc:
            return error(400, str(exc), "prompt")
        if any(not 0 <= t < worker.vocab_size for t in ids):
            return error(400, "prompt: token ids must be in the vocabulary", "prompt")
        room = worker.max_context - len(ids) if worker.max_context else None
        if room is not None and room < 1:
            return error(
                400, f"the prompt has {len(ids)} tokens; the context holds {worker.max_context}"
            )
        requested = {
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
        }
        kwargs = {**worker.defaults, **{k: v for k, v in requested.items() if v is not None}}
        kwargs["max_tokens"] = min(kwargs["max_tokens"], room or kwargs["max_tokens"])
        stop = threading.Event()
        responses = worker.submit(ids, kwargs, body.seed, stop)
        reply = Reply(kind, model_id, body.stream)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                reply.events(responses, include_usage),
                media_type="text/event-stream",
                background=BackgroundTask(stop.set),
            )
        try:
            async for response in responses:
                reply.stats.add(response)
        except Exception as exc:
            return error(500, f"generation failed: {exc}")
        return reply.whole()

    return app


class Reply:
    """The OpenAI response shapes for one request, plus DFlash stats under `dflash`."""

    def __init__(self, kind: str, model_id: str, stream: bool):
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        self.id, self.kind, self.model_id, self.stream = (
            f"{prefix}-{uuid.uuid4().hex}",
            kind,
            model_id,
            stream,
        )
        self.created = int(time.time())
        self.stats = ReplyStats()

    def choice(self, text: str, finish_reason: str | None) -> dict:
        if self.kind == "text_completion":
            content = {"text": text}
        elif self.stream:
            content = {"delta": {"content": text} if text else {}}
        else:
            content = {"message": {"role": "assistant", "content": text}}
        return {"index": 0, **content, "finish_reason": finish_reason, "logprobs": None}

    def usage(self) -> dict:
        d = self.stats.as_dict()
        prompt, completion = d["prompt_tokens"], d["generation_tokens"]
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def body(self, *choices: dict, **extra: Any) -> dict:
        chunk = self.stream and self.kind == "chat.completion"
        return {
            "id": self.id,
            "object": f"{self.kind}.chunk" if chunk else self.kind,
            "created": self.created,
            "model": self.model_id,
            "choices": list(choices),
            **extra,
        }

    def whole(self) -> dict:
        finish = self.stats.last.finish_reason if self.stats.last else None
        choice = self.choice(self.stats.text, finish)
        return self.body(choice, usage=self.usage(), dflash=self.stats.as_dict())

    async def events(
        self, responses: AsyncIterator[GenerationResponse], include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per verify cycle, stats on the last, then [DONE]."""

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        if self.kind == "chat.completion":
            yield event(self.body({**self.choice("", None), "delta": {"role": "assistant"}}))
        try:
            async for response in responses:
                self.stats.add(response)
                choice = self.choice(response.text, response.finish_reason)
                last = response.finish_reason is not None
                yield event(self.body(choice, **({"dflash": self.stats.as_dict()} if last else {})))
        except Exception as exc:
            yield event({"error": {"message": f"generation failed: {exc}", "type": "server_error"}})
        if include_usage:
            yield event(self.body(usage=self.usage()))
        yield "data: [DONE]\n\n"


def run(args: argparse.Namespace) -> None:
    """Load the models from the flags and serve them until interrupted."""
    model, tokenizer, draft = load_models(args)
    worker = Worker(model, tokenizer, draft, generation_kwargs(args))
    app = create_app(worker, args.model)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
