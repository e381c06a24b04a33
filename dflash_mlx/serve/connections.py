"""Connection-level guards for `dflash-mlx serve` under uvicorn: a deadline for each whole
request, room made at the connection limit, and floods logged once with a count.

They hold the server up against clients rather than requests: a connection that never
finishes its request, many idle ones, or the process running out of file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .shapes import error_body

log = logging.getLogger(__name__)


def power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


class Repeats(logging.Filter):
    """Lets through the 1st, 10th, 100th... record starting with one of `messages`, as
    one line with its count and no traceback.

    A flood of bad clients (or the file-descriptor limit reached) would otherwise log
    a line or a traceback per connection, each second, for as long as it lasts.
    """

    def __init__(self, messages: tuple[str, ...]):
        super().__init__()
        self.messages = messages
        self.counts: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = next((m for m in self.messages if record.getMessage().startswith(m)), None)
        if message is None:
            return True
        self.counts[message] += 1
        count = self.counts[message]
        if not power_of_ten(count):
            return False
        cause = f": {record.exc_info[1]}" if record.exc_info else ""
        record.msg = f"{message}{cause} (#{count}; repeats are logged at #10, #100, ...)"
        record.args = ()
        record.exc_info = record.exc_text = None
        return True


class GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 connection, given `request_timeout` seconds to send each whole
    request (head and body), and closing the longest idle connection to make room
    for itself at `limit_concurrency` connections.

    uvicorn times only the wait between a connection's requests: one that sends
    nothing, a head byte by byte, or less body than its Content-Length would be held
    open for good, and at the limit every other client would get 503.
    """

    def __init__(self, *args: Any, request_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.request_timeout = request_timeout
        self.deadline: asyncio.TimerHandle | None = None
        self.idle_since = time.monotonic()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.await_request()
        self.make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_clock()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (a Content-Length not a number, a
        second Host header, TLS bytes), in OpenAI's JSON error shape instead of plain text."""
        body = json.dumps(error_body(400, msg)).encode()
        head = [(b"content-type", b"application/json"), (b"connection", b"close")]
        head.append((b"content-length", str(len(body)).encode()))
        for event in (
            h11.Response(status_code=400, headers=head, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def on_response_complete(self) -> None:
        self.await_request()  # first: the call takes any pipelined request at once
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if not self.idle() and not self.cycle.more_body:  # a whole request is in
            self.stop_clock()

    def idle(self) -> bool:
        """Between requests (or before the first)."""
        return self.cycle is None or self.cycle.response_complete

    def await_request(self) -> None:
        self.stop_clock()
        self.idle_since = time.monotonic()
        self.deadline = self.loop.call_later(self.request_timeout, self.drop)

    def stop_clock(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def drop(self) -> None:
        log.debug("closing a connection: no whole request in %g s", self.request_timeout)
        self.transport.close()

    def make_room(self) -> None:
        """At the limit, close the connection idle the longest (not this new one)."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if self.limit_concurrency is None or len(open_) < self.limit_concurrency:
            return
        idle = [c for c in open_ if c is not self and isinstance(c, GuardedH11) and c.idle()]
        if idle:
            min(idle, key=lambda c: c.idle_since).transport.close()
