"""One speculative cycle for R >= 1 replies: draft, verify, accept, commit.

A cycle has two halves. `launch` queues it on each row's last committed token (one
`RowRequest` per reply): the proposers' drafts (a `ChainRow` or a `TreeRow` per row, as the
row's plan says; a tree built on the device, its size fixed by the plan), one target forward
over every row ([root] + drafts, each row through its own caches, padded to the longest row),
and each row's verdict, computed on the device. `settle` reads every row's verdict (a tree's
nodes with it) in one read and asks each row to commit its accepted
tokens: the target's caches are trimmed back to them (a chain's rejected tail, or everything
off a tree's accepted path), the tokens are booked, the row's policy records the cycle, and
the proposers get the target's features of the kept positions. A single
generation is R = 1 of the same code; the loop (`scheduler.py`) hands the last commit to its
consumer between the two halves, so the device computes the cycle meanwhile.

Rows with different shapes share the forward: a chain row is padded with repeats of its
root after its drafts (its causal mask keeps them out of its real positions), a tree row
with lone leaves under its root; either padding is trimmed with the rejected drafts. Each
row is verified by its own reply's verifier (its sampling settings, logits processors and
random draws), so a reply's tokens are what they would be alone.

A cycle that fails to launch or settle puts every row back where it stood (`Mark`): which
row broke a forward they share cannot be told, so the loop runs each again alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from ..models.rollback import keep_path
from ..models.target import TargetAdapter, TreeShape
from ..models.tree import Drafted, Tree, ancestor_mask, read_together, walk
from . import proposers
from .adaptive import Cycle, Plan
from .plan import DecodingPlan, Policy
from .prompt_cache import PromptCache
from .proposers import Proposer
from .sampling import Verdict, Verifier
from .settings import PREFILL_STEP


@dataclass
class Commit:
    """Tokens a cycle commits, the target's logits at their positions (after the logits
    processors), the drafts accepted and proposed, why the reply ends (None, "stop",
    "length"), the next cycle if it was launched already (`queued`), for a reply's first
    commit the prompt positions its prefill and first cycle ran (`prefilled`), whether the
    cycle verified a tree (else a chain, or a plain step where nothing was proposed) and how
    many replies' rows it verified."""

    tokens: list[int]
    logits: mx.array
    accepted: int = 0
    proposed: int = 0
    tree: bool = False
    finish: str | None = None
    queued: Any = None
    prefilled: int = 0
    rows: int = 1


class ReplyState:
    """One reply's state that its cycles share: the target, the prompt cache (its target
    caches, `cache`, and the tokens they hold, `tokens`), the proposer and the verifier."""

    def __init__(
        self,
        target: TargetAdapter,
        prompt_cache: PromptCache,
        proposer: Proposer,
        verifier: Verifier,
    ):
        self.target, self.prompt_cache, self.cache = target, prompt_cache, prompt_cache.target
        self.proposer, self.verifier = proposer, verifier

    @property
    def tokens(self) -> list[int]:
        return self.prompt_cache.tokens


@dataclass(eq=False)
class Reply:
    """One reply a batch advances: its sequence and plan (what each cycle verifies), its
    prompt and limits, the commits not yet consumed, and the cycle launched for it."""

    state: ReplyState
    plan: DecodingPlan
    prompt: list[int]
    max_tokens: int
    eos: set[int]
    prefill_step_size: int = PREFILL_STEP
    prefilled: int = 0  # prompt positions its prefill and first cycle run
    # mlx-lm's prompt_progress_callback(processed, total), called as the prompt is prefilled
    prompt_progress: Callable[[int, int], None] | None = None
    # the prompt's input rows (mlx-lm's input_embeddings: image rows), run by the prefill
    embeddings: mx.array | None = None
    commits: deque[Commit] = field(default_factory=deque)
    generated: int = 0
    pending: Pending | None = None  # the cycle launched for it alone, if any
    started: float = 0.0  # when its last commit was handed on
    error: Exception | None = None  # what failed its part of a cycle, raised at its next commit

    @property
    def policy(self) -> Policy:
        """What plans its own cycles."""
        return self.plan.policy

    @property
    def remaining(self) -> int:
        """Tokens it may still commit after its root: its caches hold its prompt and every
        token of its reply but the root, also while the root's own step is on the device."""
        return self.max_tokens - (len(self.state.tokens) + 1 - len(self.prompt))

    @property
    def prompt_pending(self) -> bool:
        """Whether its prompt's last token is still to run (by its first cycle)."""
        return len(self.state.tokens) < len(self.prompt)


@dataclass
class Mark:
    """Where a reply stood before a cycle: the offsets of its caches (the target's, then the
    drafter's) and how many tokens they hold."""

    offsets: list[int]
    tokens: int

    @classmethod
    def of(cls, state: ReplyState) -> Mark:
        return cls([c.offset for c in cycle_caches(state)], len(state.tokens))

    def put_back(self, state: ReplyState) -> None:
        for cache, offset in zip(cycle_caches(state), self.offsets):
            cache.trim(cache.offset - offset)
        del state.tokens[self.tokens :]


def cycle_caches(state: ReplyState) -> list:
    """Every cache a cycle writes to: the target's and the drafter's."""
    return state.cache + state.prompt_cache.draft


@contextmanager
def put_back_on_failure(replies: list[Reply], marks: list[Mark]) -> Iterator[None]:
    """Re-raise a failure with every reply back where its mark says it stood."""
    try:
        yield
    except Exception:
        for reply, mark in zip(replies, marks):
            mark.put_back(reply.state)
        raise


@dataclass(eq=False)
class Root:
    """A row's root, the last token its reply committed: on the device (`array`, shape (1,)),
    and its value once the host has read it (`value`; a lone plain step's token is queued
    on before it is read)."""

    array: mx.array
    value: int | None = None

    @classmethod
    def known(cls, token: int) -> Root:
        return cls(mx.array([token]), token)

    def item(self) -> int:
        """Its value, read from the device where the host does not know it yet."""
        if self.value is None:
            self.value = self.array.item()
        return self.value

    def padded(self, tokens: mx.array, positions: int) -> mx.array:
        """`tokens` padded to `positions` with repeats of it, read or not."""
        extra = positions - tokens.size
        if not extra:
            return tokens
        return mx.concatenate([tokens, mx.broadcast_to(self.array, (extra,))])


@dataclass(frozen=True)
class RowRequest:
    """One reply's part in a cycle to launch: the reply, its root and the policy that plans
    its row."""

    reply: Reply
    root: Root
    policy: Policy


Cost = Callable[[], float | None]  # a cycle's seconds so far (None: counted by another row)


@dataclass(eq=False)
class ChainRow:
    """A reply's chain in a launched cycle: its root, its drafts (none: a plain step) and
    their log q, and its verdict. It commits the accepted drafts and the target's token
    after them, and keeps as many positions (`kept`)."""

    reply: Reply
    root: Root
    policy: Policy
    plan: Plan
    drafts: mx.array
    logq: mx.array | None = None
    verdict: Verdict | None = None
    kept: int = 0

    @classmethod
    def draft(
        cls, launching: list[tuple[RowRequest, Plan, list[int] | None]], shared: bool
    ) -> list[ChainRow]:
        """The rows of a cycle's chains (request, plan, context for logits processors): as
        many drafts as each plan asks, capped by its reply's remaining tokens, its caches and
        (in a `shared` cycle) its reply's cap, those drafting with one drafter in one drafter
        forward (`proposers.chains`); a proposer may stop short."""
        wanted = {}
        for i, (request, plan, context) in enumerate(launching):
            reply, drafts = request.reply, plan.drafts
            if not drafts:
                continue
            if shared and reply.plan.max_drafts is not None:
                drafts = min(drafts, reply.plan.max_drafts)
            state = reply.state
            n = state.target.forward_limit(state.cache, min(drafts + 1, reply.remaining))
            if n > 1:
                wanted[i] = proposers.ChainRequest(
                    state.proposer, request.root.array, n - 1, context
                )
        chains = dict(zip(wanted, proposers.chains(list(wanted.values()))))
        return [
            cls(request.reply, request.root, request.policy, plan, *chains.get(i, (NONE, None)))
            for i, (request, plan, _) in enumerate(launching)
        ]

    @property
    def size(self) -> int:
        """Positions it verifies: the root and its drafts."""
        return self.drafts.size + 1

    @property
    def plain(self) -> bool:
        return self.drafts.size == 0

    def tokens(self, positions: int) -> mx.array:
        """Its root and drafts, padded to `positions` with repeats of its root (its causal
        mask keeps them out of its real positions)."""
        tokens = mx.concatenate([self.root.array, self.drafts.astype(self.root.array.dtype)])
        return self.root.padded(tokens, positions)

    def shape(self, positions: int) -> None:
        """A chain needs no tree shape."""
        return None

    def verify(self, logits: mx.array, context: list[int] | None) -> None:
        """Its verdict on the device: the accepted drafts and the target's token after them."""
        verifier = self.reply.state.verifier
        self.verdict = verifier.verify(self.drafts, self.logq, logits, context)

    def reads(self) -> list[mx.array]:
        """What committing it reads from the device."""
        return [self.drafts, self.verdict.accepted, self.verdict.token]

    def computed(self) -> list[mx.array]:
        """What the device computes for it ahead of `settle`."""
        return self.reads()

    def commit(self, values: list[np.ndarray], positions: int, cost: Cost) -> Commit:
        """Book its accepted tokens: the rejected drafts and padding leave the target's
        caches, the root and accepted drafts join the reply's tokens, and its policy records
        what it verified, accepted and cost (`cost()`, once it is booked)."""
        drafts, accepted, token = (v.tolist() for v in values)
        state = self.reply.state
        state.target.rollback(state.cache, positions - accepted - 1)
        state.tokens.extend([self.root.item(), *drafts[:accepted]])
        self.kept = accepted + 1
        self.policy.record(Cycle(self.size - 1, accepted, cost()))
        logits = self.verdict.logits[: accepted + 1]
        return Commit(drafts[:accepted] + [token], logits, accepted, self.size - 1)

    def commit_queued(self, values: list[np.ndarray], queued: Pending, seconds: float) -> Commit:
        """A lone plain step's commit, its position booked when its next cycle was queued on
        its token (`_queue_next`): the token is that cycle's root."""
        token = int(values[2])
        queued.rows[0].root.value = token
        self.policy.record(Cycle(0, 0, seconds))
        return Commit([token], self.verdict.logits[:1], queued=queued)


@dataclass(eq=False)
class TreeRow:
    """A reply's tree in a launched cycle: its root, the cache offset it starts at, the tree
    it verifies on the device (drafted, or the root alone) and, once read, on the host
    (`read`), the tree searched (the verified one is its first nodes), and the target's
    logits and choices at its nodes (no choices where they are made during the walk). It
    commits the accepted path and the target's token after it, and keeps the path's
    positions (`kept`)."""

    reply: Reply
    root: Root
    policy: Policy
    plan: Plan
    tree: Drafted
    searched: Drafted
    start: int
    drafted: bool = False  # whether the proposer drafted it (else the root alone)
    logits: mx.array | None = None
    choices: mx.array | None = None
    read: Tree | None = None
    kept: list[int] = field(default_factory=list)

    plain = False

    @classmethod
    def draft(
        cls, launching: list[tuple[RowRequest, Plan, list[int] | None]], shared: bool
    ) -> list[TreeRow]:
        """The rows of a cycle's trees (request, plan, context): each searched to its plan's
        nodes (`Plan.searched` where more than its drafts), at most its reply's depth deep (and
        no deeper than it has tokens left), and the first drafts + 1 of them verified; those
        drafting with one drafter in one drafter forward (`proposers.trees`). Nothing is read
        here: the sizes are the plans', and the whole tree searched is read with the verdict
        (its probabilities size an adaptive policy's next tree). A tree of depth 0 is the root
        alone, not drafted."""
        starts, drafting = [], {}
        for i, (request, plan, _) in enumerate(launching):
            state = request.reply.state
            limit = state.target.forward_limit(state.cache, request.reply.remaining) - 1
            nodes = max(plan.drafts, plan.searched)
            depth = min(request.reply.plan.depth, limit, nodes)
            starts.append(state.cache[0].offset)
            if depth > 0:
                scores = state.verifier.tree_scores if state.verifier.coupled else None
                root = request.root
                drafting[i] = proposers.TreeRequest(
                    state.proposer, root.array, depth, nodes, scores, root.value is not None
                )
        drafted = dict(zip(drafting, proposers.trees(list(drafting.values()))))
        rows = []
        for i, (request, plan, _) in enumerate(launching):
            searched = drafted.get(i)
            if searched is None:
                searched = Drafted.alone(request.root.array)
            tree = searched.first(plan.drafts + 1)
            reply, root, policy = request.reply, request.root, request.policy
            rows.append(cls(reply, root, policy, plan, tree, searched, starts[i], i in drafted))
        return rows

    @property
    def size(self) -> int:
        return len(self.tree)

    def tokens(self, positions: int) -> mx.array:
        """Its nodes' tokens, padded to `positions` with lone leaves holding its root."""
        return self.root.padded(self.tree.tokens, positions)

    def shape(self, positions: int) -> TreeShape:
        """Its nodes (padded to `positions` with lone leaves under its root) in the forward."""
        tree, extra = self.tree, positions - self.size
        if not extra:
            return TreeShape(tree.depths, ancestor_mask(tree.parents))
        depths = mx.pad(tree.depths, (0, extra), constant_values=1)
        return TreeShape(depths, ancestor_mask(mx.pad(tree.parents, (0, extra))))

    def verify(self, logits: mx.array, context: list[int] | None) -> None:
        """The target's choices at its nodes, on the device: its own choice, its coupled
        choice at the node's position, or its sample (a node is then accepted when the
        target's sample at its parent is the node's token, so every committed token is the
        target's own sample). Logits processors see each node's own path, and a verifier that
        chooses per row pays for the path's nodes alone: those choices are made during the
        walk (`_walk`)."""
        self.logits = logits
        verifier = self.reply.state.verifier
        if not (verifier.processors or verifier.chooses_per_row):
            first = len(self.reply.state.tokens) + 1
            positions = list(range(first, first + self.tree.deepest + 1))
            self.choices = verifier.choices(logits, positions, self.tree.depths)

    def reads(self) -> list[mx.array]:
        """What committing it reads from the device: the tree searched (the verified one is its
        first nodes) and the target's choices."""
        return self.searched.parts() + ([] if self.choices is None else [self.choices])

    def computed(self) -> list[mx.array]:
        """What the device computes for it ahead of `settle`: its tree and choices, or its
        logits where the choices are made during the walk."""
        return self.reads() + ([self.logits] if self.choices is None else [])

    def commit(self, values: list[np.ndarray], positions: int, cost: Cost) -> Commit:
        """Book its accepted path: everything off it leaves the target's caches, its tokens
        join the reply's, and its policy records what it verified, accepted and cost (`cost()`,
        once it is booked: the walk included) and the path probabilities of every node
        searched."""
        tree, choices = (values, None) if self.choices is None else (values[:-1], values[-1])
        searched = Drafted.of(tree)
        self.read = searched.first(self.size)
        commit, path = self._walk(None if choices is None else choices.tolist())
        state = self.reply.state
        keep_path(state.cache, self.start, path)
        state.tokens.extend([self.read.tokens[node] for node in path])
        self.kept = path
        probabilities = searched.probabilities()
        self.policy.record(Cycle(self.size - 1, len(path) - 1, cost(), probabilities, path))
        return commit

    def _walk(self, choices: list[int] | None) -> tuple[Commit, list[int]]:
        """Its commit and accepted path: the walk down the target's choices (made here, node
        by node, for a verifier with logits processors or one that chooses per row)."""
        state, tree, logits = self.reply.state, self.read, self.logits
        processed: dict[int, mx.array] = {}

        def choose_processed(node: int) -> int:
            context = state.tokens + [tree.tokens[n] for n in tree.path(node)]
            one = state.verifier.process(logits[node : node + 1], context, NONE)
            processed[node] = one
            position = len(state.tokens) + 1 + tree.depths[node]
            return state.verifier.choices(one, [position]).item()

        path, after = walk(tree, choose_processed if choices is None else choices.__getitem__)
        if processed:
            path_logits = mx.concatenate([processed[node] for node in path])
        else:
            path_logits = logits[mx.array(path)]
        if self.drafted:
            state.proposer.verified(tree, path)
        tokens = [tree.tokens[node] for node in path]
        accepted = len(path) - 1
        commit = Commit(tokens[1:] + [after], path_logits, accepted, len(tree) - 1, tree=True)
        return commit, path


Row = ChainRow | TreeRow


@dataclass
class Pending:
    """A cycle on the device: its rows, the positions every row verified, the target's
    features of all of them and where each reply stood before."""

    rows: list[Row]
    positions: int
    features: mx.array | None
    marks: list[Mark]
    launching: float = 0.0  # host seconds spent building it while the cycle before ran

    @property
    def replies(self) -> list[Reply]:
        return [row.reply for row in self.rows]


def launch(requests: list[RowRequest]) -> Pending:
    """The cycle after each reply's root, as its policy plans it: drafts, one verify forward
    for every row (each through its own caches), verdicts. A failure is raised with every
    reply back where it stood (`Mark`). A lone reply whose target refuses its first tree
    forward (`TargetAdapter.check_tree` could not tell) runs a chain instead where its policy
    may fall back to chains (`drop_trees`)."""
    plans = _plans(requests)
    try:
        return _launch_marked(requests, plans)
    except ValueError:
        policy = requests[0].policy
        if not (len(requests) == 1 and plans[0].tree and policy.drop_trees()):
            raise
    return _launch_marked(requests, _plans(requests))


def _plans(requests: list[RowRequest]) -> list[Plan]:
    """Each row's plan: the rows one policy plans share its one plan."""
    planned: dict[int, Plan] = {}
    for request in requests:
        if id(request.policy) not in planned:
            planned[id(request.policy)] = request.policy.plan()
    return [planned[id(request.policy)] for request in requests]


def _launch_marked(requests: list[RowRequest], plans: list[Plan]) -> Pending:
    marks = [Mark.of(request.reply.state) for request in requests]
    with put_back_on_failure([request.reply for request in requests], marks):
        return _launch(requests, plans, marks)


def _launch(requests: list[RowRequest], plans: list[Plan], marks: list[Mark]) -> Pending:
    kinds = [TreeRow if plan.tree else ChainRow for plan in plans]
    contexts = []
    for request in requests:
        state = request.reply.state
        state.verifier.at(len(state.tokens) + 1, state.target.vocab_size)
        processing = state.verifier.processors
        contexts.append(state.tokens + [request.root.item()] if processing else None)
    rows: list[Row] = [None] * len(requests)
    for kind in (ChainRow, TreeRow):
        members = [i for i, k in enumerate(kinds) if k is kind]
        if members:
            picked = [(requests[i], plans[i], contexts[i]) for i in members]
            for i, row in zip(members, kind.draft(picked, shared=len(requests) > 1)):
                rows[i] = row
    positions = max(row.size for row in rows)
    batch = mx.stack([row.tokens(positions) for row in rows])
    shapes = [row.shape(positions) for row in rows]
    taps = next(filter(None, (r.reply.state.proposer.layer_ids for r in requests)), None)
    target = requests[0].reply.state.target
    forward = target.forward(
        batch, [row.reply.state.cache for row in rows], shapes if any(shapes) else None, taps
    )
    for i, (row, context) in enumerate(zip(rows, contexts)):
        row.verify(forward.logits[i, : row.size], context)
    mx.async_eval([part for row in rows for part in row.computed()])
    return Pending(rows, positions, forward.features, marks)


NONE = mx.array([], dtype=mx.uint32)  # no drafts


def settle(
    pending: Pending,
    started: float,
    launch_next: Callable[[Reply, Root], Pending] | None = None,
) -> list[tuple[Reply, Commit]]:
    """Read every row's verdict at once and commit each reply's accepted tokens; `started`:
    when the replies' last commits were handed on. A lone plain step keeps its input
    position whatever token it computes: its next cycle is queued by `launch_next` on that
    token, still on the device, before the host reads it (`Commit.queued`), as mlx-lm's
    decoding does, so that on a GPU building the next graph overlaps this step's
    computation. A failure is raised with every reply back where it stood before the
    cycle (`Mark`)."""
    if not pending.rows:  # every reply left it
        return []
    with put_back_on_failure(pending.replies, pending.marks):
        return _settle(pending, started, launch_next)


def _settle(
    pending: Pending, started: float, launch_next: Callable[[Reply, Root], Pending] | None
) -> list[tuple[Reply, Commit]]:
    queued = _queue_next(pending, launch_next) if launch_next else None
    reads = _read_rows(pending.rows)
    if queued is not None:  # a lone plain step, booked already (`_queue_next`)
        row, seconds = pending.rows[0], _seconds(pending, started) - queued.launching
        return [(row.reply, row.commit_queued(reads[0], queued, seconds))]
    commits = []
    for i, (row, values) in enumerate(zip(pending.rows, reads)):
        # a cycle's cost is recorded once per policy: rows it planned after its first get None
        first = all(other.policy is not row.policy for other in pending.rows[:i])
        cost = partial(_seconds, pending, started) if first else lambda: None
        commit = row.commit(values, pending.positions, cost)
        commit.rows = len(pending.rows)
        commits.append((row.reply, commit))
    _observe(pending, [row.kept for row in pending.rows])
    return commits


def _seconds(pending: Pending, started: float) -> float:
    """The cycle's wall time: since its replies' last commits were handed on, and its
    launch's host work while the cycle before ran."""
    return time.perf_counter() - started + pending.launching


def _read_rows(rows: list[Row]) -> list[list[np.ndarray]]:
    """What each row's commit reads (`reads`), in one read of the device."""
    parts = [row.reads() for row in rows]
    flat = [p for row_parts in parts for p in row_parts]
    values = iter(read_together(flat, mx.int32) if flat else [])
    return [[next(values) for _ in row_parts] for row_parts in parts]


def _queue_next(pending: Pending, launch_next: Callable[[Reply, Root], Pending]) -> Pending | None:
    """For a lone plain step with tokens to go and no logits processors: its position booked
    (its features handed on, its root appended) and the reply's next cycle launched on its
    token, still on the device."""
    row = pending.rows[0]
    reply, state = row.reply, row.reply.state
    if not (row.plain and len(pending.rows) == 1):
        return None
    if reply.remaining <= 1 or state.verifier.processors:
        return None
    state.target.rollback(state.cache, 0)
    _observe(pending, [1])
    state.tokens.append(row.root.item())
    tic = time.perf_counter()
    queued = launch_next(reply, Root(row.verdict.token[None].astype(mx.int32)))
    # the next cycle's host work is its own cost, not this one's
    queued.launching = time.perf_counter() - tic
    return queued


def _observe(pending: Pending, kept: list[int | list[int]]) -> None:
    """Hand each row's proposer the target's features of the positions it kept."""
    observing = [i for i, row in enumerate(pending.rows) if row.reply.state.proposer.layer_ids]
    if not observing:
        return
    features = pending.features
    if len(observing) < len(pending.rows):
        features = features[mx.array(observing)]
    proposers.observe(
        [pending.rows[i].reply.state.proposer for i in observing],
        features,
        [kept[i] for i in observing],
    )


def drop(pending: Pending, reply: Reply) -> None:
    """Take `reply` out of a launched cycle: its verified positions leave its caches."""
    i = pending.replies.index(reply)
    reply.state.target.rollback(reply.state.cache, pending.positions)
    del pending.rows[i], pending.marks[i]
    if pending.features is not None:
        pending.features = mx.concatenate([pending.features[:i], pending.features[i + 1 :]])
