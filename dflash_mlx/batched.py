"""One verify cycle shared by several replies (`BatchedChain`): each reply's drafter
proposes its chain, the target verifies every reply's [last token] + drafts in one
forward (`TargetAdapter.forward` over the rows: each attends to its own caches), and each
reply accepts its own prefix.

Rows verify as many positions as the longest chain; a shorter row's extra positions
(padding) are computed and trimmed with its rejected drafts, so the rows stay ragged:
each cache keeps its own length. Each row is verified by its own reply's verifier
(its sampling settings, logits processors and random draws), so a reply's tokens are
what they would be alone. How many drafts a shared cycle proposes is the batch's
width policy's choice (`adaptive.BatchedBlock`): verify positions cost more as rows x
positions grow, down to one position per row (plain batched decoding).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx

from .adaptive import BatchedBlock
from .proposers import observe_rows, propose_chains
from .sampling import Verdict
from .steps import Commit, Reply, Sequence
from .target import TargetAdapter
from .tree import read_together


@dataclass
class Row:
    """One reply's part of a shared cycle: its root, positions, drafts and verdict."""

    root: int
    size: int
    drafts: mx.array
    verdict: Verdict


@dataclass
class Mark:
    """Where a reply stood before a shared cycle: the offsets of its caches (the target's,
    then the drafter's) and how many tokens they hold. A cycle that fails puts every reply
    back there (`put_back`): which row broke a forward they share cannot be told."""

    offsets: list[int]
    tokens: int

    @classmethod
    def of(cls, seq: Sequence) -> Mark:
        return cls([c.offset for c in cycle_caches(seq)], len(seq.tokens))

    def put_back(self, seq: Sequence) -> None:
        for cache, offset in zip(cycle_caches(seq), self.offsets):
            cache.trim(cache.offset - offset)
        del seq.tokens[self.tokens :]


@contextmanager
def put_back_on_failure(replies: list[Reply], marks: list[Mark]) -> Iterator[None]:
    """Re-raise a failure with every reply back where its mark says it stood."""
    try:
        yield
    except Exception:
        for reply, mark in zip(replies, marks):
            mark.put_back(reply.seq)
        raise


def cycle_caches(seq: Sequence) -> list:
    """Every cache a shared cycle writes to: the target's and the drafter's."""
    return seq.cache + seq.prompt_cache.draft


@dataclass
class SharedCycle:
    """A shared cycle on the device: its replies, their rows, the positions every row
    verified, the target's features of all of them and where each reply stood before."""

    replies: list[Reply]
    rows: list[Row]
    positions: int
    features: mx.array | None
    started: float
    marks: list[Mark]


class BatchedChain:
    """Launches and settles the cycles several replies share (see the module docstring)."""

    def __init__(self, target: TargetAdapter, policy: BatchedBlock):
        self.target, self.policy = target, policy

    def launch(self, roots: list[tuple[Reply, int]]) -> SharedCycle:
        """The cycle after each reply's `root`: drafts as the policy plans for this many
        rows (fewer for a reply near its end or capped lower), one verify forward. A failure
        is raised with every reply back where it stood (`Mark`)."""
        marks = [Mark.of(reply.seq) for reply, _ in roots]
        with put_back_on_failure([reply for reply, _ in roots], marks):
            return self._launch(roots, marks)

    def _launch(self, roots: list[tuple[Reply, int]], marks: list[Mark]) -> SharedCycle:
        started = time.perf_counter()
        drafts = self.policy.plan(len(roots))
        wanted, contexts = [], []
        for reply, root in roots:
            seq = reply.seq
            cap = drafts if reply.max_drafts is None else min(drafts, reply.max_drafts)
            wanted.append(min(cap, reply.remaining - 1) if seq.proposer.layer_ids else 0)
            contexts.append(seq.tokens + [root] if seq.verifier.processors else None)
            seq.verifier.at(len(seq.tokens) + 1, seq.target.vocab_size)
        drafting = [i for i, n in enumerate(wanted) if n > 0]
        chains = propose_chains(
            [roots[i][0].seq.proposer for i in drafting],
            [roots[i][1] for i in drafting],
            [wanted[i] for i in drafting],
            [contexts[i] for i in drafting],
        )
        proposed = dict(zip(drafting, chains))
        rows, blocks = [], []
        for i, (reply, root) in enumerate(roots):
            root_id = mx.array([root], dtype=mx.uint32)
            chain, logq = proposed.get(i, (mx.array([], dtype=mx.uint32), None))
            chain = chain.astype(mx.uint32)
            rows.append((reply, root, chain, logq, contexts[i]))
            blocks.append((root, mx.concatenate([root_id, chain])))
        positions = max(block.size for _, block in blocks)
        tokens = mx.stack(
            [
                mx.pad(block, (0, positions - block.size), constant_values=root)
                for root, block in blocks
            ]
        )
        taps = next(filter(None, (r.seq.proposer.layer_ids for r, *_ in rows)), None)
        forward = self.target.forward(tokens, [r.seq.cache for r, *_ in rows], taps=taps)
        logits = forward.logits
        out = []
        for i, (reply, root, chain, logq, context) in enumerate(rows):
            size = chain.size + 1
            verdict = reply.seq.verifier.verify(chain, logq, logits[i, :size], context)
            out.append(Row(root, size, chain, verdict))
        mx.async_eval(
            [p for row in out for p in (row.drafts, row.verdict.accepted, row.verdict.token)]
        )
        replies = [reply for reply, *_ in rows]
        return SharedCycle(replies, out, positions, forward.features, started, marks)

    def settle(self, cycle: SharedCycle) -> list[tuple[Reply, Commit]]:
        """Read every row's verdict at once and commit each reply's accepted prefix. A
        failure is raised with every reply back where it stood before the cycle (`Mark`)."""
        with put_back_on_failure(cycle.replies, cycle.marks):
            return self._settle(cycle)

    def _settle(self, cycle: SharedCycle) -> list[tuple[Reply, Commit]]:
        parts = [
            p for row in cycle.rows for p in (row.drafts, row.verdict.accepted, row.verdict.token)
        ]
        read = [part.tolist() for part in read_together(parts, mx.int32)]
        commits, tried = [], []
        for i, (reply, row) in enumerate(zip(cycle.replies, cycle.rows)):
            drafts, accepted, token = read[3 * i : 3 * i + 3]
            seq = reply.seq
            seq.target.rollback(seq.cache, cycle.positions - accepted - 1)
            seq.tokens.extend([row.root, *drafts[:accepted]])
            logits = row.verdict.logits[: accepted + 1]
            commits.append(
                (reply, Commit(drafts[:accepted] + [token], logits, accepted, row.size - 1))
            )
            tried.append((row.size - 1, accepted))
        observing = [i for i, r in enumerate(cycle.replies) if r.seq.proposer.layer_ids]
        if observing:
            features = cycle.features
            if len(observing) < len(cycle.replies):
                features = features[mx.array(observing)]
            proposers = [cycle.replies[i].seq.proposer for i in observing]
            observe_rows(proposers, features, [tried[i][1] + 1 for i in observing])
        seconds = time.perf_counter() - cycle.started
        self.policy.record(len(cycle.rows), cycle.positions, tried, seconds)
        return commits

    def drop(self, cycle: SharedCycle, reply: Reply) -> None:
        """Take `reply` out of a launched cycle: its verified positions leave its caches."""
        i = cycle.replies.index(reply)
        reply.seq.target.rollback(reply.seq.cache, cycle.positions)
        del cycle.replies[i], cycle.rows[i], cycle.marks[i]
        if cycle.features is not None:
            cycle.features = mx.concatenate([cycle.features[:i], cycle.features[i + 1 :]])
