"""Running under `mlx.launch`: the group, and what rank 0 decides for every rank.

Every rank of a tensor-parallel target runs the same forwards, which are
collective operations, so every rank must run exactly the same cycles on the
same tokens. What only one rank may decide (the prompt it read, the random
seed, whether a client is still there) goes from rank 0 to all with an
`all_sum` to which the others add zeros.

`Lockstep` runs rank 0's units of work (a chat turn, an HTTP request) on every
rank: rank 0 sends each as JSON, the others run it and discard the output, and
a watchdog ends a rank whose unit makes no progress (a peer that hangs).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any, TypeVar

import mlx.core as mx

BACKEND_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")


def world_group() -> mx.distributed.Group | None:
    """The group this process was launched in (`mlx.launch`), or None when it runs alone."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def is_rank0(group: mx.distributed.Group | None) -> bool:
    return group is None or group.rank() == 0


def _from_rank0(values: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's `values` on every rank (the same shape and dtype on every rank)."""
    mine = values if group.rank() == 0 else mx.zeros_like(values)
    return mx.distributed.all_sum(mine, group=group, stream=mx.cpu)


def broadcast_text(text: str | None, group: mx.distributed.Group | None) -> str:
    """Rank 0's `text` on every rank (the others pass anything, e.g. None)."""
    if group is None:
        return text or ""
    data = (text or "").encode() if group.rank() == 0 else b""
    size = _from_rank0(mx.array([len(data)], dtype=mx.int32), group).item()
    if size == 0:
        return ""
    padded = mx.array(list(data.ljust(size, b"\0")), dtype=mx.int32)
    return bytes(_from_rank0(padded, group).tolist()).decode()


def shared_seed(seed: int | None, group: mx.distributed.Group) -> int:
    """Rank 0's seed (a fresh one when none is given), so every rank draws the same numbers."""
    mine = seed if seed is not None else secrets.randbelow(2**31)
    return _from_rank0(mx.array([mine], dtype=mx.int64), group).item()


def is_backend_error(exc: BaseException) -> bool:
    """Whether `exc` is a distributed backend's failure, e.g. a peer that died."""
    return isinstance(exc, RuntimeError) and str(exc).startswith(BACKEND_ERRORS)


def refuse_distributed(command: str) -> None:
    """Stop a subcommand that does not run its ranks in lockstep, on every rank alike."""
    if world_group() is not None:
        raise ValueError(
            f"'{command}' does not run under mlx.launch; generate, chat, serve and bench do"
        )


DEFAULT_RANK_TIMEOUT = 300.0  # seconds a unit of work may go without progress (a long prefill)
Response = TypeVar("Response")


class Watchdog:
    """Ends this process when, while armed, `timeout` seconds pass without a beat.

    A rank blocked in a collective on a peer that stopped responding (but kept
    its sockets open) waits forever inside MLX, where Python cannot interrupt
    it; a thread of its own can still print and exit.
    """

    def __init__(self, timeout: float, message: str):
        self.timeout, self.message = timeout, message
        self.deadline: float | None = None
        threading.Thread(target=self._watch, daemon=True, name="dflash-watchdog").start()

    def beat(self) -> None:
        self.deadline = time.monotonic() + self.timeout

    def disarm(self) -> None:
        self.deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                abort(self.message)


def abort(message: str) -> None:
    """Print `message` and end this process at once, from any thread, even while another
    is blocked inside a collective (the peers then see their connection lost)."""
    print(message, file=sys.stderr, flush=True)
    end_child_processes()
    os._exit(1)


def end_child_processes() -> None:
    """Kill this process's multiprocessing children (e.g. the server's body validators), which
    would outlive it holding its stdout and stderr open, and their resource tracker, which
    would print warnings about their semaphores after `abort`'s message."""
    for child in multiprocessing.active_children():
        child.kill()
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class Lockstep:
    """Rank 0's units of work, run on every rank of `group` (alone: just run).

    Rank 0 `send`s each unit (JSON) and runs it; the other ranks take them from
    `units()` and run them too. A unit's responses pass through `steps`, which
    ends them on every rank where rank 0 ends them and keeps the watchdog fed;
    waiting for the next unit (rank 0 for its user, the others for rank 0) is
    not watched. `rank_timeout` 0 turns the watchdog off.
    """

    def __init__(self, group: mx.distributed.Group | None, rank_timeout: float, command: str):
        self.group = group
        self.watchdog = None
        if group is not None and rank_timeout > 0:
            self.watchdog = Watchdog(
                rank_timeout,
                f"{command}: error: rank {group.rank()}: no progress for {rank_timeout:g} s: "
                "a peer stopped responding (--rank-timeout)",
            )

    @property
    def leader(self) -> bool:
        return is_rank0(self.group)

    def agree(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank."""
        if self.group is None:
            return flag
        return bool(_from_rank0(mx.array([int(flag)], dtype=mx.int32), self.group).item())

    def send(self, unit: dict[str, Any] | None) -> None:
        """Rank 0: the next unit to every rank; None releases them (the end)."""
        if self.group is not None:
            with self.watched():
                broadcast_text(json.dumps(unit), self.group)

    def units(self) -> Iterator[dict[str, Any]]:
        """Ranks but 0: rank 0's units until it sends None."""
        while (unit := json.loads(broadcast_text(None, self.group))) is not None:
            yield unit

    @contextmanager
    def watched(self) -> Iterator[None]:
        """Arm the watchdog for the block (it must make progress, `beat`, in time)."""
        if self.watchdog is None:
            yield
            return
        self.watchdog.beat()
        try:
            yield
        finally:
            self.watchdog.disarm()

    def beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    def steps(
        self,
        responses: Generator[Response, None, None],
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[Response]:
        """`responses` until they end, or until rank 0's `stop()` says so after one that is
        not the last (a client gone, Ctrl-C): every rank stops at the same cycle. Every
        rank passes a `stop` or none (then nothing is asked: one collective less a cycle)."""
        with self.watched():
            try:
                for response in responses:
                    self.beat()
                    yield response
                    if stop and response.finish_reason is None and self.agree(stop()):
                        return
            finally:
                responses.close()


def share(make: Callable[[], Any], group: mx.distributed.Group | None) -> Any:
    """Rank 0's `make()` (JSON-able) on every rank; its error, if any, raised on every rank."""
    if group is None:
        return make()
    message = None
    if group.rank() == 0:
        try:
            message = json.dumps({"value": make()})
        except (ValueError, FileNotFoundError, PermissionError) as exc:
            message = json.dumps({"error": str(exc)})
    shared = json.loads(broadcast_text(message, group))
    if "error" in shared:
        raise ValueError(shared["error"])
    return shared["value"]
