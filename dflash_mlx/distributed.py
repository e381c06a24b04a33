"""Running under `mlx.launch`: the group, and what rank 0 decides for every rank.

Every rank of a tensor-parallel target runs the same forwards, which are
collective operations, so every rank must run exactly the same cycles on the
same tokens. What only one rank may decide (the prompt it read, the random
seed) goes from rank 0 to all with an `all_sum` to which the others add zeros.
"""

from __future__ import annotations

import secrets

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
    """Stop a subcommand that does not run its ranks in lockstep yet, on every rank alike."""
    if world_group() is not None:
        raise ValueError(
            f"'{command}' does not run under mlx.launch yet; use 'dflash-mlx generate' "
            "for a target sharded over several machines"
        )
