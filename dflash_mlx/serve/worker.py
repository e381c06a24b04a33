"""The generation worker: one thread that owns the model and its caches and runs the
requests' generations, up to `--max-batch` of them in shared decoding cycles.

More requests wait their turn in arrival order, at most `--max-queue` of them (more:
`QueueFull`, a 503). The worker shares one prompt cache across requests (a follow-up turn
of a chat prefills only its new part). A client that disconnects, streaming or not, sets
its job's stop flag, which the worker checks after every verify cycle; on shutdown
`stop_all` stops every job so. A request's failure ends its own reply only, and only its
message crosses to the event loop: the error's frames hold the generation's caches. Chat
templates are rendered and prompts tokenized on a thread of their own, so a long prompt
does not stall the event loop (and every open stream with it).

Under `mlx.launch` rank 0's worker sends each job (prompt ids and settings) to the other
ranks, which run it in lockstep (`follow`) and discard the output, so requests are
generated one at a time there.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..chat_format import encode_prompt
from ..decode.prompt_cache import PromptCache, PromptCacheStore, make_prompt_cache
from ..decode.scheduler import make_batch
from ..decode.settings import GenerationSettings
from ..decode.stops import stop_at_strings
from ..generate import stream_generate
from ..models.distributed import Lockstep, abort, is_backend_error
from ..models.target import TargetAdapter
from ..options import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_PROMPT_CACHE_SIZE,
)
from ..response import GenerationResponse
from .record import Recorder
from .shapes import logprob_entries

log = logging.getLogger(__name__)


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
    `max_batch` requests decoded together (`scheduler.Batch`: one verify forward per cycle for
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
        prompt_concurrency: int | None = None,
        recorder: Recorder | None = None,
    ):
        """`defaults`: the flags' generation settings, which requests override;
        `processor_settings` the flags' penalties, the base of a request's own;
        `lockstep` the ranks that run every job under `mlx.launch` (one job at a time
        there: every rank must run the same forwards, and ranks do not agree on when a
        request joins a batch); `prompt_caches` how many conversations' caches to keep,
        and in how many bytes at most; `max_batch` how many requests decode together,
        `prompt_concurrency` how many new ones a cycle prefills at most; `recorder` keeps
        every finished reply (`serve --record`)."""
        self.model, self.tokenizer, self.draft, self.defaults = model, tokenizer, draft, defaults
        self.template_kwargs = template_kwargs or {}
        self.processor_settings = processor_settings or {}
        target = TargetAdapter(model)
        self.max_context, self.vocab_size = target.max_context, target.vocab_size
        options = defaults.cache_options  # the flags'; a request cannot change them
        self.caches = PromptCacheStore(
            lambda: make_prompt_cache(model, draft, **options), *prompt_caches
        )
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-tokenize")
        self.max_queue = max_queue
        self.lockstep = lockstep or Lockstep(None, 0, "serve")
        self.max_batch = max_batch if self.lockstep.group is None else 1
        self.batch = make_batch(model, draft, prompt_concurrency)
        self.recorder = recorder
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
        if self.recorder is not None:  # a reply's tokens are kept only to be recorded
            running.reply += response.tokens
            if response.finish_reason is not None:
                self.recorder.add(job.prompt, running.reply, response.finish_reason)
        if running.stop.is_set() and response.finish_reason is None:
            log.info("client gone: stopped after %d tokens", response.generation_tokens)
        if response.finish_reason is not None:
            # ended now, not at the next turn (maybe a cycle later): its client's next
            # request can join the batch's next cycle
            self._end(running)
            return False
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
    reply: list[int] = field(default_factory=list)  # its token ids so far, when recording


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
