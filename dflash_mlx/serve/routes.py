"""The API's routes: `/health`, `/v1/models`, `/v1/chat/completions` and `/v1/completions`
(each also without `/v1`, as `mlx_lm.server` and OpenAI-style clients use).

A request names the model `/v1/models` lists, `mlx_lm.server`'s alias for it, or none; another
model is not loaded in its place (404 `model_not_found`).
Its prompt is bounded before it is tokenized (characters, by the model's context) and
after (tokens in the vocabulary, the context's room, `max_tokens` by the context).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from ..chat_format import chat_prompt, encode_chat
from ..options import PROCESSOR_SETTINGS
from .guards import Policy, parse
from .schemas import PROMPT_CHARS_PER_TOKEN, ChatRequest, CompletionParams, TextRequest
from .shapes import OpenAIResponse, error
from .validation import Prepared, Validator
from .worker import Job, QueueFull, Worker

RETRY_AFTER_S = 5  # what a 503 for a full queue tells the client to wait
DEFAULT_MODEL = "default_model"  # mlx_lm.server's name for the model it was started with


class Api:
    """The routes' handlers: `worker`'s model served under the name `model_id`, to what
    `policy` lets in."""

    def __init__(self, worker: Worker, model_id: str, policy: Policy):
        self.worker, self.model_id, self.policy = worker, model_id, policy
        self.validate = Validator()
        context = worker.max_context
        self.max_chars = PROMPT_CHARS_PER_TOKEN * context if context else policy.max_body_bytes
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """Once the server stops: the other ranks told the end, the worker's threads let go
        (and the processes that validate large bodies)."""
        self.validate.start()
        try:
            yield
        finally:
            self.validate.close()
        worker = self.worker
        if worker.lockstep.group is not None:  # shutting down: after the last job, the end
            done = worker.executor.submit(worker.lockstep.send, None)
            await asyncio.wrap_future(done)
        await asyncio.get_running_loop().run_in_executor(None, worker.close)

    async def health(self) -> dict:
        return {"status": "ok"}

    async def models(self) -> dict:
        entry = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "dflash-mlx",
        }
        return {"object": "list", "data": [entry]}

    async def chat_completions(self, request: Request):
        ready = await self.accept(request, ChatRequest)
        if isinstance(ready, JSONResponse):
            return ready
        body, messages = ready.request, ready.messages
        if too_long := self.over(ready.size, "messages"):
            return too_long
        worker = self.worker
        template_kwargs = {**worker.template_kwargs, **(body.chat_template_kwargs or {})}
        try:
            ids = await worker.prepare(
                lambda: encode_chat(
                    worker.tokenizer,
                    chat_prompt(worker.tokenizer, messages, body.tools, **template_kwargs),
                )
            )
        except Exception as exc:  # a template may reject a conversation (e.g. role order)
            return error(400, f"messages: the chat template failed: {exc}", "messages")
        return await self.complete(request, body, ids, "chat.completion")

    async def completions(self, request: Request):
        ready = await self.accept(request, TextRequest)
        if isinstance(ready, JSONResponse):
            return ready
        body = ready.request
        if too_long := self.over(ready.size, "prompt"):
            return too_long
        try:
            ids = await self.worker.prepare(lambda: body.prompt)
        except ValueError as exc:
            return error(400, str(exc), "prompt")
        return await self.complete(request, body, ids, "text_completion")

    async def accept(
        self, request: Request, schema: type[CompletionParams]
    ) -> Prepared | JSONResponse:
        """The request's validated body, prepared, or the error answering it (a body this
        server does not take, or a model it does not serve)."""
        ready = await parse(request, schema, self.policy.max_body_bytes, self.validate)
        if isinstance(ready, JSONResponse):
            return ready
        return self.unknown_model(ready.request.model) or ready

    def unknown_model(self, name: str | None) -> JSONResponse | None:
        """404 for a model this server does not serve, as OpenAI answers: a client asking
        for another model must not be answered by this one."""
        if name in (None, self.model_id, DEFAULT_MODEL):
            return None
        message = (
            f"the model {name!r} is not served here: this server serves {self.model_id!r} "
            f"(or {DEFAULT_MODEL!r}) and loads no other"
        )
        return error(404, message, "model", "model_not_found")

    def over(self, chars: int, name: str) -> JSONResponse | None:
        if chars <= self.max_chars:
            return None
        return error(400, f"{name}: {chars} characters, over the {self.max_chars} taken", name)

    async def complete(self, request: Request, body: CompletionParams, ids: list[int], kind: str):
        """The reply to a request whose prompt is `ids`: streamed, or whole once generated."""
        job = self.job(body, ids)
        if isinstance(job, JSONResponse):
            return job
        stop = threading.Event()
        try:
            responses = self.worker.submit(job, stop)
        except QueueFull:
            return self.busy()
        tools = getattr(body, "tools", None)
        with_logprobs = job.top_logprobs is not None
        tokenizer = self.worker.tokenizer
        reply = OpenAIResponse(
            kind, self.model_id, body.stream, tokenizer, ids, tools, with_logprobs
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                reply.events(responses, include_usage),
                media_type="text/event-stream",
                background=BackgroundTask(stop.set),
            )
        return await whole(request, reply, responses, stop)

    def job(self, body: CompletionParams, ids: list[int]) -> Job | JSONResponse:
        """The request's generation, or a 400 naming what of it the model cannot take."""
        worker = self.worker
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
            "xtc_probability": body.xtc_probability,
            "xtc_threshold": body.xtc_threshold,
        }
        kwargs = {k: v for k, v in requested.items() if v is not None}
        if body.dflash and not body.dflash.draft:  # plain steps, whatever the flags ask
            kwargs.update(block_size=1, tree_budget=None, adaptive=None)
        max_tokens = kwargs.get("max_tokens", worker.defaults.max_tokens)
        kwargs["max_tokens"] = min(max_tokens, room or max_tokens)
        settings = {k: getattr(body, k) for k in PROCESSOR_SETTINGS if getattr(body, k) is not None}
        if any(not 0 <= t < worker.vocab_size for t in settings.get("logit_bias", {})):
            return error(400, "logit_bias: token ids must be in the vocabulary", "logit_bias")
        return Job(ids, kwargs, settings, body.seed, body.stops, body.alternatives)

    def busy(self) -> JSONResponse:
        """503 for a request the queue has no room for, with when to try again."""
        message = f"the server is busy ({self.worker.max_queue} requests waiting); retry later"
        response = error(503, message)
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


async def whole(
    request: Request, reply: OpenAIResponse, responses: AsyncIterator, stop: threading.Event
) -> dict | JSONResponse:
    """A non-streaming reply once its generation ends (stopped if its client leaves first)."""
    watcher = asyncio.create_task(stop_on_disconnect(request, stop))
    try:
        async for response, logprobs in responses:
            reply.add(response, logprobs)
    except Exception as exc:
        return error(500, f"generation failed: {exc}")
    finally:
        watcher.cancel()
    return reply.whole()


async def stop_on_disconnect(request: Request, stop: threading.Event) -> None:
    """Set `stop` when the client of a non-streaming request goes away.

    The body has been read, so the next ASGI message is the disconnect.
    """
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stop.set()
