"""The speculative loop at the level of tokens, as mlx-lm's `generate_step` is for plain
decoding: prefill, then one cycle (`cycle.py`) after another, each cycle's commit handed to
its reply.

A `Batch` advances every reply it holds by one cycle per `cycle()`: it settles the cycles
launched before (one device read each), prefills the replies that joined, ends replies at
an EOS token (kept) or at their `max_tokens`, and launches the next cycles before the
commits are consumed, so the consumer's work overlaps the device's. Replies whose caches
can share a forward (`rows.batchable`) and whose tokens do not depend on the cycle's shape
(`Batch._shares`) share one cycle, each row planned by the batch's policy for that many
rows (`ByWidth`); the others take their own cycles in turn. A failure in one reply's
part of a cycle ends that reply alone, with its error; a shared cycle that fails runs again
one reply at a time, so that only a reply that fails alone fails (and where each then ran,
sharing is tried again after a doubling number of cycles). A single generation is a
batch of one (`replies`). The loop knows nothing of text, time or what proposes the drafts.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TypeVar

import mlx.core as mx
import mlx.nn as nn

from ..models.draft import DFlashDraft
from ..models.rows import batchable
from ..models.target import TargetAdapter
from . import cycle, proposers
from .cycle import Commit, Pending, Reply, Root, RowRequest
from .plan import FIRST, FixedPlan, Policy, resolve_width

T = TypeVar("T")
MAX_SHARE_GAP = 256  # the most cycles between tries of a shared launch that keeps failing


def prefill(reply: Reply, start: int) -> None:
    """Run the reply's prompt from `start` through the target but for its last token (the
    proposer observing every position), in chunks whose logits are never computed, telling
    `prompt_progress` how much of it has run as mlx-lm does: 0 first, then after each
    chunk. As in mlx-lm's batched decoding, the last token is the root of the reply's first
    cycle (`FIRST`), which may be shared, so a reply joining a batch costs its rows a
    position, not a forward of its own; its commit is the target's token after the prompt."""
    state, prompt, step = reply.state, reply.prompt, reply.prefill_step_size
    every_cache = state.cache + state.prompt_cache.draft
    progress = reply.prompt_progress or (lambda processed, total: None)
    reply.prefilled = len(prompt) - start
    progress(0, reply.prefilled)
    taps, rows = state.proposer.layer_ids, reply.embeddings
    for chunk_start in range(start, len(prompt) - 1, step):
        end = min(chunk_start + step, len(prompt) - 1)
        chunk, embeddings = prompt[chunk_start:end], None
        if rows is not None:
            embeddings = rows[chunk_start:end][None]
        forward = state.target.forward(
            mx.array(chunk)[None], [state.cache], taps=taps, prompt=True, embeddings=embeddings
        )
        if taps:
            proposers.observe([state.proposer], forward.features, [len(chunk)])
        mx.eval([c.state for c in every_cache])
        progress(chunk_start + len(chunk) - start, reply.prefilled)
    state.prompt_cache.tokens = prompt[:-1]


@dataclass
class ByWidth:
    """The policies of a batch's shared cycles, by number of rows and what they were made
    for. A cycle of several rows costs more per position than a reply's own, so its shape
    is chosen by measured cost for that many rows even where a reply's own is fixed: an
    adaptive reply's width starts from its policy (what it learned alone, or at the nearest
    width measured), a fixed chain or tree from an `AdaptiveStrategy` up to it (chains and
    trees of at most as many drafts); each keeps what was learned of acceptance and measures
    the costs of its own cycles (`plan.resolve_width`). A reply that drafts nothing, or has
    no drafter to draft chains with, keeps its own plan."""

    policies: dict[tuple[int, tuple], Policy] = field(default_factory=dict)

    def policy(self, reply: Reply, rows: int) -> Policy:
        """The policy that plans `reply`'s row in a cycle of `rows` rows."""
        own = reply.policy
        if rows == 1:
            return own
        fixed = own.fixed if isinstance(own, FixedPlan) else None
        if fixed is not None and (not fixed.drafts or reply.state.proposer.drafting is None):
            return own
        setting = own.setting if fixed is None else ("fixed", fixed, reply.plan.depth)
        if (rows, setting) not in self.policies:
            widths = [width for width, known in self.policies if known == setting]
            nearest = min(widths, key=lambda width: abs(width - rows), default=None)
            start = None if nearest is None else self.policies[nearest, setting]
            depth = 0 if fixed is None else reply.plan.depth  # a fixed tree's, for its width's
            self.policies[rows, setting] = resolve_width(own, depth, rows, start)
        return self.policies[rows, setting]


class Batch:
    """Replies to one target decoded together (see the module docstring).

    While the batch holds replies the target is claimed for it (`TargetAdapter.generating`:
    one generation per model at a time, its weights kept wired as mlx-lm does while
    generating).
    """

    def __init__(
        self,
        target: TargetAdapter,
        draft: DFlashDraft | None = None,
        prompt_concurrency: int | None = None,
    ):
        self.target, self.draft = target, draft
        # how many joining replies a cycle prefills at most (None: all), so that a burst of
        # new prompts delays the replies already decoding by a bounded time
        self.prompt_concurrency = prompt_concurrency
        self.replies: list[Reply] = []
        self.joining: list[Reply] = []
        self.shared: Pending | None = None  # the cycle several replies share, if launched
        self.widths = ByWidth()
        # a shared launch that failed where each of its replies then launched alone failed for
        # sharing itself (a target whose attention applies the mask itself, as MLA's does, gets
        # no per-row masks): the next is tried after `share_gap` cycles, doubling while it fails
        self.unshared, self.share_gap = 0, 1
        self.held: ExitStack | None = None

    def add(self, reply: Reply) -> None:
        """Take `reply`: it is prefilled at the next cycle, and its commits follow."""
        taps = self.draft.config.target_layer_ids if self.draft is not None else None
        taps = taps or next(filter(None, (r.state.proposer.layer_ids for r in self.every)), None)
        layer_ids = reply.state.proposer.layer_ids
        if layer_ids and taps and layer_ids != taps:
            raise ValueError("replies in one batch must tap the same target layers")
        self.joining.append(reply)

    @property
    def every(self) -> list[Reply]:
        return [*self.replies, *self.joining]

    def remove(self, reply: Reply) -> None:
        """Drop `reply` (finished, or its consumer gone): a cycle launched for it is undone
        from its caches, which then hold what `prompt_cache.tokens` lists."""
        if reply in self.joining:
            self.joining.remove(reply)
        if reply in self.replies:
            self.replies.remove(reply)
            if self.shared is not None and reply in self.shared.replies:
                cycle.drop(self.shared, reply)
            elif reply.pending is not None:
                cycle.drop(reply.pending, reply)
            reply.pending = None
        if not self.every and self.held is not None:
            self.held.close()
            self.held = None

    def cycle(self) -> None:
        """Advance every reply by one cycle: each gets its next commit (`Reply.commits`), or
        its error where its part of the cycle failed, which ends that reply alone (`_fail`);
        a failed shared cycle runs again one reply at a time (`_settle_shared`, `_launch`),
        so a reply that fails alone fails alone. An error outside every reply's part fails
        them all: the caller gets it raised, the others at their next commit."""
        try:
            self._cycle()
        except Exception as exc:
            for reply in self.every:
                self._fail(reply, exc)
            self.shared = None
            raise

    def _cycle(self) -> None:
        if self.joining and self.held is None:
            self.held = ExitStack()
            self.held.enter_context(self.target.generating())
        committed = self._settle_shared() if self.shared is not None else []
        own = [(reply,) for reply in self.replies if reply.pending is not None]
        committed += self._each(self._settle_own, own)
        admitted = self.prompt_concurrency or len(self.joining)
        joining, self.joining = self.joining[:admitted], self.joining[admitted:]
        self.replies += joining
        prefilled = self._each(self._prefill, [(reply,) for reply in joining])
        now = time.perf_counter()
        going_on = []  # (reply, root, its next cycle if launched already)
        for reply, commit in self._each(self._finish, committed):
            reply.commits.append(commit)
            reply.started = now
            if commit.finish:
                self.remove(reply)
            else:
                going_on.append((reply, Root.known(commit.tokens[-1]), commit.queued))
                commit.queued = None
        for reply, _ in prefilled:
            reply.started = now
            going_on.append((reply, Root.known(reply.prompt[-1]), None))
        self._launch(going_on)

    def _each(self, work: Callable[..., T], calls: list[tuple]) -> list[tuple[Reply, T]]:
        """`work(reply, *args)` for each (reply, *args) of `calls`, as (reply, result) pairs:
        a reply whose work raises ends with its error (`_fail`) and is left out."""
        done = []
        for reply, *args in calls:
            try:
                done.append((reply, work(reply, *args)))
            except Exception as exc:
                self._fail(reply, exc)
        return done

    def _fail(self, reply: Reply, error: Exception) -> None:
        """End `reply` with `error`, raised at its next commit; what failed may have left
        its caches between two states."""
        reply.error, reply.pending = error, None
        self.remove(reply)

    def _settle_shared(self) -> list[tuple[Reply, Commit]]:
        """The shared cycle's commits. Where it fails, its replies are back where they stood
        and each launches the cycle again alone, settled in this cycle as its own."""
        shared, self.shared = self.shared, None
        started = min((reply.started for reply in shared.replies), default=0.0)
        try:
            return cycle.settle(shared, started)
        except Exception:
            roots = [(row.reply, row.root) for row in shared.rows]
            self._each(self._launch_alone, roots)
            return []

    def _settle_own(self, reply: Reply) -> Commit:
        pending, reply.pending = reply.pending, None
        [(_, commit)] = cycle.settle(pending, reply.started, self._launch_next)
        return commit

    def _launch_next(self, reply: Reply, root: Root) -> Pending:
        """The reply's next cycle alone, after `root` (a token maybe still on the device)."""
        return cycle.launch([RowRequest(reply, root, self._policy(reply, 1))])

    def _policy(self, reply: Reply, rows: int) -> Policy:
        """What plans the reply's row in a cycle of `rows` rows: `FIRST` while its prompt's
        last token is still to run, else its own policy alone or the batch's for that width."""
        if reply.prompt_pending:
            return FIRST
        return reply.policy if rows == 1 else self.widths.policy(reply, rows)

    def _prefill(self, reply: Reply) -> None:
        prefill(reply, reply.state.prompt_cache.reuse(reply.prompt))

    def _finish(self, reply: Reply, commit: Commit) -> Commit:
        """`commit`, ending the reply at an EOS token (kept) or at its token limit; the first
        says how much of the prompt its reply's prefill ran, as `prompt_progress` does."""
        if not reply.generated:
            commit.prefilled = reply.prefilled
            if reply.prompt_progress:
                reply.prompt_progress(reply.prefilled, reply.prefilled)
        stop = next((i for i, t in enumerate(commit.tokens) if t in reply.eos), None)
        if stop is not None:
            commit.tokens, commit.logits = commit.tokens[: stop + 1], commit.logits[: stop + 1]
        reply.generated += len(commit.tokens)
        if commit.tokens[-1] in reply.eos:
            commit.finish = "stop"
        elif reply.generated >= reply.max_tokens:
            commit.finish = "length"
        if commit.finish and commit.queued:  # queued on the token that ended the reply
            cycle.drop(commit.queued, reply)
            commit.queued = None
        elif not commit.finish:
            reply.state.proposer.committed(commit.tokens)
        return commit

    def _launch(self, going_on: list[tuple[Reply, Root, Pending | None]]) -> None:
        """The next cycle of every reply going on, after its root: one cycle shared by those
        that may share (`_shares`) when there are several, each of the others its own (a
        queued one launched already). Where the shared one fails to launch, its replies are
        back where they stood and each launches alone."""
        sharing = [row for row in going_on if self._shares(row[0])]
        alone, failed = [], []
        if len(sharing) > 1 and self.unshared:
            self.unshared -= 1
        elif len(sharing) > 1:
            rows = []
            for reply, root, queued in sharing:
                if queued:
                    cycle.drop(queued, reply)
                rows.append(RowRequest(reply, root, self._policy(reply, len(sharing))))
            try:
                self.shared = cycle.launch(rows)
                self.share_gap = 1
            except Exception:
                failed = [(row.reply, row.root) for row in rows]
                alone = list(failed)
            going_on = [row for row in going_on if row not in sharing]
        for reply, root, queued in going_on:
            if queued:  # launched as its cycle settled
                reply.pending = queued
            else:
                alone.append((reply, root))
        launched = {reply for reply, _ in self._each(self._launch_alone, alone)}
        if failed and all(reply in launched for reply, _ in failed):
            self.unshared, self.share_gap = self.share_gap, min(2 * self.share_gap, MAX_SHARE_GAP)

    def _launch_alone(self, reply: Reply, root: Root) -> None:
        reply.pending = self._launch_next(reply, root)

    @staticmethod
    def _shares(reply: Reply) -> bool:
        """Whether the reply may verify in a shared cycle: its caches can share a forward,
        and its tokens do not depend on the cycle's shape. A greedy reply's never do, nor a
        coupled one's (keyed by position), nor those of one sampling from the global random
        state; a seeded reply under another rule runs the cycles it would run alone, so the
        seed alone decides its reply."""
        verifier = reply.state.verifier
        greedy = verifier.transform is None and verifier.sampler is None
        free = greedy or verifier.coupled or verifier.key is None
        return batchable(reply.state.cache) and free


def make_batch(
    model: nn.Module, draft: DFlashDraft | None, prompt_concurrency: int | None = None
) -> Batch:
    """An empty batch for `stream_generate(..., batch=)` with this target and drafter: replies
    of it share their cycles, each planned by measured cost for that many rows; a cycle
    prefills at most `prompt_concurrency` new replies (None: every one waiting)."""
    return Batch(TargetAdapter(model), draft, prompt_concurrency)


def replies(batch: Batch, reply: Reply) -> Iterator[Commit]:
    """`reply`'s commits: the target's token after the prompt first, then one per cycle, the
    last with its `finish` reason. The reply joins the batch now, so replies made before the
    next cycle start it together; whoever finds its reply's commits consumed runs the batch's
    next cycle, which advances every reply in it. Closing the iterator (or dropping it) takes
    the reply out; its caches then hold the prompt and the reply after, but for its last
    token (`prompt_cache.tokens` lists what they hold)."""
    batch.add(reply)
    commits = _commits(batch, reply)
    # dropped unread (never started, so no `finally` runs): out of the batch at once; only
    # the caller's code drops it, never a cycle, which holds no reference to it
    weakref.finalize(commits, _leave, batch, reply)
    return commits


def _commits(batch: Batch, reply: Reply) -> Iterator[Commit]:
    try:
        while True:
            while not reply.commits:
                if reply.error is not None:
                    raise reply.error
                batch.cycle()
            commit = reply.commits.popleft()
            yield commit
            if commit.finish:
                return
    finally:
        _leave(batch, reply)


def _leave(batch: Batch, reply: Reply) -> None:
    """Take `reply` out of `batch`, and its error: the error's traceback holds the reply,
    which would otherwise stay, with its caches, until Python's cyclic collector runs."""
    reply.error = None
    batch.remove(reply)
