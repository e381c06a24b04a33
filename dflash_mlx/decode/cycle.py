"""One speculative cycle for R >= 1 replies: draft, verify, accept, commit.

A cycle has two halves. `launch` queues it on each row's last committed token: the
proposers' drafts (a chain or a tree per row, as the row's plan says), one target forward
over every row ([root] + drafts, each row through its own caches, padded to the longest
row), and each row's verdict, computed on the device. `settle` reads every row's verdict
at once and commits each row's accepted tokens: the target's caches are trimmed back to
them (a chain's rejected tail, or everything off a tree's accepted path), the tokens are
booked, and the proposers get the target's features of the kept positions. A single
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
from typing import Any

import mlx.core as mx

from ..models.rollback import keep_path
from ..models.target import TargetAdapter, TreeShape
from ..models.tree import Tree, ancestor_mask, read_together, walk
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


@dataclass
class Row:
    """One reply's part of a launched cycle: its root (None while it is still on the device),
    the policy that planned it and its plan, the cache offset it starts at, its drafts (a
    chain's) or tree, its verified positions, and its verdict (a chain's) or the target's
    logits and choices at its nodes (a tree's; no choices where they are made during the
    walk)."""

    reply: Reply
    root: int | None
    policy: Policy
    plan: Plan
    start: int
    size: int
    drafts: mx.array
    tree: Tree | None = None
    drafted: bool = False  # whether the proposer drafted its tree (else the root alone)
    verdict: Verdict | None = None
    logits: mx.array | None = None
    choices: mx.array | None = None


@dataclass
class Pending:
    """A cycle on the device: its rows, the positions every row verified, the target's
    features of all of them and where each reply stood before."""

    rows: list[Row]
    positions: int
    features: mx.array | None
    marks: list[Mark]
    launching: float = 0.0  # host seconds spent building it while the cycle before ran
    waited: float = 0.0  # seconds its launch waited for the cycle before's token

    @property
    def replies(self) -> list[Reply]:
        return [row.reply for row in self.rows]


def launch(rows: list[tuple[Reply, int | mx.array, Policy]]) -> Pending:
    """The cycle after each reply's root, as its policy plans it: drafts, one verify forward
    for every row (each through its own caches), verdicts. A failure is raised with every
    reply back where it stood (`Mark`). A lone reply whose target refuses its first tree
    forward (`TargetAdapter.check_tree` could not tell) runs a chain instead where its policy
    may fall back to chains (`drop_trees`)."""
    plans = _plans(rows)
    try:
        return _launch_marked(rows, plans)
    except ValueError:
        policy = rows[0][2]
        if not (len(rows) == 1 and plans[0].tree and policy.drop_trees()):
            raise
    return _launch_marked(rows, _plans(rows))


def _plans(rows: list[tuple[Reply, int | mx.array, Policy]]) -> list[Plan]:
    """Each row's plan: the rows one policy plans share its one plan."""
    planned: dict[int, Plan] = {}
    for _, _, policy in rows:
        if id(policy) not in planned:
            planned[id(policy)] = policy.plan()
    return [planned[id(policy)] for _, _, policy in rows]


def _launch_marked(rows: list[tuple[Reply, int | mx.array, Policy]], plans: list[Plan]) -> Pending:
    marks = [Mark.of(reply.state) for reply, _, _ in rows]
    with put_back_on_failure([reply for reply, _, _ in rows], marks):
        return _launch(rows, plans, marks)


def _launch(
    rows: list[tuple[Reply, int | mx.array, Policy]], plans: list[Plan], marks: list[Mark]
) -> Pending:
    tic = time.perf_counter()
    roots = [root for _, root, _ in rows]
    for i, plan in enumerate(plans):  # a tree is drafted from its root's value
        if plan.tree and not isinstance(roots[i], int):
            roots[i] = roots[i].item()
    waited = time.perf_counter() - tic
    contexts = []
    for (reply, _, _), root in zip(rows, roots):
        state = reply.state
        state.verifier.at(len(state.tokens) + 1, state.target.vocab_size)
        contexts.append(state.tokens + [root] if state.verifier.processors else None)
    chains = _chains(rows, plans, roots, contexts)
    trees = _trees(rows, plans, roots)
    built, logqs, tokens = [], [], []
    for i, ((reply, _, policy), plan, root) in enumerate(zip(rows, plans, roots)):
        start = reply.state.cache[0].offset
        root_id = mx.array([root]) if isinstance(root, int) else root
        if plan.tree:
            tree, drafted = trees[i]
            built.append(Row(reply, root, policy, plan, start, len(tree), NONE, tree, drafted))
            tokens.append(mx.array(tree.tokens))
            logqs.append(None)
        else:
            drafts, logq = chains.get(i, (NONE, None))
            known = root if isinstance(root, int) else None
            built.append(Row(reply, known, policy, plan, start, drafts.size + 1, drafts))
            tokens.append(mx.concatenate([root_id, drafts.astype(root_id.dtype)]))
            logqs.append(logq)
    positions = max(row.size for row in built)
    if len(built) == 1:
        batch = tokens[0][None]
    else:  # a shared cycle's roots are known: only a lone reply's may be on the device
        batch = mx.stack([_padded(t, row.root, positions) for t, row in zip(tokens, built)])
    shapes = [_shape(row, positions) if row.tree else None for row in built]
    taps = next(filter(None, (reply.state.proposer.layer_ids for reply, _, _ in rows)), None)
    target = rows[0][0].state.target
    forward = target.forward(
        batch, [reply.state.cache for reply, _, _ in rows], shapes if any(shapes) else None, taps
    )
    for i, row in enumerate(built):
        _verdict(row, forward.logits[i, : row.size], logqs[i], contexts[i])
    mx.async_eval([part for row in built for part in _computed(row)])
    pending = Pending(built, positions, forward.features, marks)
    pending.waited = waited
    return pending


NONE = mx.array([], dtype=mx.uint32)  # no drafts


def _chains(
    rows: list[tuple[Reply, int | mx.array, Policy]],
    plans: list[Plan],
    roots: list[int | mx.array],
    contexts: list[list[int] | None],
) -> dict[int, tuple[mx.array, mx.array | None]]:
    """Each drafting chain row's drafts and log q, by row: as many as its plan asks (capped
    by its reply's remaining tokens, its caches and a shared cycle's cap), those drafting
    with one drafter in one drafter forward (`proposers.chains`); a proposer may stop
    short."""
    wanted = {}
    for i, ((reply, _, _), plan) in enumerate(zip(rows, plans)):
        drafts = plan.drafts
        if plan.tree or not drafts:
            continue
        if len(rows) > 1 and reply.plan.max_drafts is not None:
            drafts = min(drafts, reply.plan.max_drafts)
        state = reply.state
        n = state.target.forward_limit(state.cache, min(drafts + 1, reply.remaining))
        if n > 1:
            wanted[i] = n - 1
    chains = proposers.chains(
        [rows[i][0].state.proposer for i in wanted],
        [roots[i] for i in wanted],
        list(wanted.values()),
        [contexts[i] for i in wanted],
    )
    return dict(zip(wanted, chains))


def _trees(
    rows: list[tuple[Reply, int | mx.array, Policy]], plans: list[Plan], roots: list
) -> dict[int, tuple[Tree, bool]]:
    """Each tree row's tree and whether it was drafted, by row: up to its plan's budget of
    nodes, at most its reply's depth deep (and no deeper than it has tokens left), fitted by
    its policy; those drafting with one drafter in one drafter forward (`proposers.trees`).
    A tree of depth 0 is the root alone, not drafted."""
    out, drafting, depths = {}, [], []
    for i, plan in enumerate(plans):
        if not plan.tree:
            continue
        state = rows[i][0].state
        limit = state.target.forward_limit(state.cache, rows[i][0].remaining) - 1
        depth = min(rows[i][0].plan.depth, limit, plan.drafts)
        out[i] = Tree([roots[i]], [-1], [0]), False
        if depth > 0:
            drafting.append(i)
            depths.append(depth)
    verifiers = [rows[i][0].state.verifier for i in drafting]
    drafted = proposers.trees(
        [rows[i][0].state.proposer for i in drafting],
        [roots[i] for i in drafting],
        depths,
        [plans[i].drafts for i in drafting],
        [v.tree_scores if v.coupled else None for v in verifiers],
    )
    for i, tree in zip(drafting, drafted):
        out[i] = tree.first(rows[i][2].fit(tree.probabilities()) + 1), True
    return out


def _padded(tokens: mx.array, root: int, positions: int) -> mx.array:
    """A row's tokens padded to `positions` with repeats of its root."""
    return mx.pad(tokens, (0, positions - tokens.size), constant_values=root)


def _shape(row: Row, positions: int) -> TreeShape:
    """A tree row's nodes padded to `positions` with lone leaves under its root."""
    tree, extra = row.tree, positions - row.size
    return TreeShape(tree.depths + [1] * extra, ancestor_mask(tree.parents + [0] * extra))


def _verdict(row: Row, logits: mx.array, logq: mx.array | None, context: list[int] | None) -> None:
    """The row's verdict on the device: a chain's accepted drafts and the target's token
    after them; a tree's target choices at its nodes (its own choice, its coupled choice at
    the node's position, or its sample: a node is then accepted when the target's sample at
    its parent is the node's token, so every committed token is the target's own sample).
    Logits processors see each node's own path, and a verifier that chooses per row pays for
    the path's nodes alone: those choices are made during the walk (`_walk`)."""
    verifier = row.reply.state.verifier
    if row.tree is None:
        row.verdict = verifier.verify(row.drafts, logq, logits, context)
        return
    row.logits = logits
    if not (verifier.processors or verifier.chooses_per_row):
        first = len(row.reply.state.tokens) + 1
        row.choices = verifier.choices(logits, [first + depth for depth in row.tree.depths])


def _read(row: Row) -> list[mx.array]:
    """What settling the row reads from the device."""
    if row.tree is None:
        return [row.drafts, row.verdict.accepted, row.verdict.token]
    return [] if row.choices is None else [row.choices]


def _computed(row: Row) -> list[mx.array]:
    """What the device computes for the row ahead of `settle`: what settling reads, or a
    tree's logits where its choices are made during the walk."""
    return _read(row) or [row.logits]


def settle(
    pending: Pending,
    started: float,
    launch_next: Callable[[Reply, mx.array], Pending] | None = None,
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
    pending: Pending, started: float, launch_next: Callable[[Reply, mx.array], Pending] | None
) -> list[tuple[Reply, Commit]]:
    queued = _queue_next(pending, launch_next) if launch_next else None
    reads = _read_rows(pending.rows)
    if queued is not None:  # a lone plain step, booked already (`_queue_next`)
        row, (_, _, token) = pending.rows[0], reads[0]
        if not queued.rows[0].plan.tree:
            queued.rows[0].root = token
        _record(row, pending, started, 0, queued)
        return [(row.reply, Commit([token], row.verdict.logits[:1], queued=queued))]
    commits, kept = [], []
    for row, read in zip(pending.rows, reads):
        state = row.reply.state
        if row.tree is None:
            drafts, accepted, token = read
            state.target.rollback(state.cache, pending.positions - accepted - 1)
            state.tokens.extend([row.root, *drafts[:accepted]])
            kept.append(accepted + 1)
            logits = row.verdict.logits[: accepted + 1]
            commit = Commit(drafts[:accepted] + [token], logits, accepted, row.size - 1)
            _record(row, pending, started, accepted)
        else:
            commit, path = _walk(row, read[0] if read else None)
            keep_path(state.cache, row.start, path)
            state.tokens.extend([row.tree.tokens[node] for node in path])
            kept.append(path)
            _record(row, pending, started, len(path) - 1, path=path)
        commit.rows = len(pending.rows)
        commits.append((row.reply, commit))
    _observe(pending, kept)
    return commits


def _read_rows(rows: list[Row]) -> list[list]:
    """What each row's settling reads (`_read`), as Python values, in one read of the device."""
    parts = [_read(row) for row in rows]
    flat = [p for row_parts in parts for p in row_parts]
    values = iter(read_together(flat, mx.int32) if flat else [])
    return [[next(values).tolist() for _ in row_parts] for row_parts in parts]


def _queue_next(
    pending: Pending, launch_next: Callable[[Reply, mx.array], Pending]
) -> Pending | None:
    """For a lone plain step with tokens to go and no logits processors: its position booked
    (its features handed on, its root appended) and the reply's next cycle launched on its
    token, still on the device."""
    row = pending.rows[0]
    reply, state = row.reply, row.reply.state
    plain = row.tree is None and row.size == 1 and len(pending.rows) == 1
    if not plain or reply.remaining <= 1 or state.verifier.processors:
        return None
    state.target.rollback(state.cache, 0)
    _observe(pending, [1])
    state.tokens.append(row.root)
    tic = time.perf_counter()
    queued = launch_next(reply, row.verdict.token[None].astype(mx.int32))
    # the next cycle's host work is its own cost, not this one's
    queued.launching = time.perf_counter() - tic - queued.waited
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


def _walk(row: Row, choices: list[int] | None) -> tuple[Commit, list[int]]:
    """A tree row's commit and accepted path: the walk down the target's choices (made here,
    node by node, for a verifier with logits processors or one that chooses per row)."""
    state, tree, logits = row.reply.state, row.tree, row.logits
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
    if row.drafted:
        state.proposer.verified(tree, path)
    tokens = [tree.tokens[node] for node in path]
    accepted = len(path) - 1
    return Commit(tokens[1:] + [after], path_logits, accepted, len(tree) - 1, tree=True), path


def _record(
    row: Row,
    pending: Pending,
    started: float,
    accepted: int,
    queued: Pending | None = None,
    path: list[int] | None = None,
) -> None:
    """Tell the policy that planned the row what it verified, accepted and cost (the cost
    once per cycle: a policy that planned rows before this one in it gets None)."""
    seconds = time.perf_counter() - started + pending.launching
    if queued is not None:
        seconds -= queued.launching
    if any(other.policy is row.policy for other in pending.rows[: pending.rows.index(row)]):
        seconds = None
    if row.tree is None:
        row.policy.record(Cycle(row.size - 1, accepted, seconds))
    else:
        probabilities = row.tree.probabilities()
        row.policy.record(Cycle(len(row.tree) - 1, accepted, seconds, probabilities, path))


def drop(pending: Pending, reply: Reply) -> None:
    """Take `reply` out of a launched cycle: its verified positions leave its caches."""
    i = pending.replies.index(reply)
    reply.state.target.rollback(reply.state.cache, pending.positions)
    del pending.rows[i], pending.marks[i]
    if pending.features is not None:
        pending.features = mx.concatenate([pending.features[:i], pending.features[i + 1 :]])
