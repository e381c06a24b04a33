"""Request bodies validated, and what the chat template renders counted, where they cannot
stall the event loop.

pydantic validates a JSON body in one call that holds the GIL throughout: a 3.9 MiB body of
120,000 one-character messages took 1.5 s on a loaded machine, and a thread running it kept
the event loop (`/health`, every stream) from running for 1.3 s of them. So a body over
`SMALL_BODY_BYTES` is prepared in a worker process: validated, its messages turned into the
plain dicts a chat template reads and its text counted. What comes back is plain data (a
pydantic model of 120,000 messages took 17 s to unpickle; their dicts take milliseconds).
The pool's processes bound how many such bodies are prepared at once; the others wait their
turn without holding the loop. A small body costs less in-process than the trip
(benchmarks/README.md, "Large request bodies").
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NamedTuple

from pydantic import ValidationError

from .schemas import ChatRequest, Strict, text_size

SMALL_BODY_BYTES = 64 * 2**10  # validated in-process up to this size
PROCESSES = 2  # bodies validated at once, each in a process of its own


class Invalid(ValueError):
    """A body its schema refuses: `where` (the field, "" for the body) and why, in words."""

    def __init__(self, where: str, message: str):
        super().__init__(where, message)  # both: rebuilt from its args after a process
        self.where, self.message = where, message


class Prepared(NamedTuple):
    """A validated request, its messages (if any) apart as a chat template reads them, and the
    characters a template may render of it (messages and tools) or its prompt's."""

    request: Any
    messages: list[dict[str, Any]] | None
    size: int


def prepared(schema: type[Strict], body: bytes) -> Prepared:
    """`body` as a `schema`, prepared, or `Invalid` naming the first problem."""
    try:
        request = schema.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        found = first.get("ctx", {}).get("error")
        where = ".".join(str(p) for p in first["loc"]) or getattr(found, "field", "")
        raise Invalid(where, first["msg"].removeprefix("Value error, ")) from None
    if not isinstance(request, ChatRequest):
        return Prepared(request, None, text_size(getattr(request, "prompt", None)))
    messages = [m.for_template() for m in request.messages]
    size = text_size(messages) + text_size(request.tools)
    return Prepared(request.model_copy(update={"messages": []}), messages, size)


class Validator:
    """Prepares request bodies: small ones at once, larger ones in worker processes."""

    def __init__(self, processes: int = PROCESSES):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the worker processes now, so that the first large body does not wait for
        them (each imports the schemas)."""
        context = multiprocessing.get_context("spawn")  # no copy of the server's threads
        self._pool = ProcessPoolExecutor(self.processes, mp_context=context)
        for _ in range(self.processes):
            self._pool.submit(int)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    async def __call__(self, schema: type[Strict], body: bytes) -> Prepared:
        """`body` as a `schema`, prepared (`Invalid` if it is none), the loop free meanwhile."""
        if len(body) <= SMALL_BODY_BYTES or self._pool is None:
            return prepared(schema, body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, prepared, schema, body)
