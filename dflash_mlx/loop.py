"""The speculative loop at the level of tokens, as mlx-lm's `generate_step` is for plain
decoding: prefill, then one step per cycle, each cycle's commit handed to its reply.

A `Batch` advances every reply it holds by one cycle per `cycle()`: it settles the
cycles launched before (one device read each), prefills the replies that joined, ends
replies at an EOS token (kept) or at their `max_tokens`, and launches the next cycle
before the commits are consumed, so the consumer's work overlaps the device's. One
reply takes its own step (`steps.py`: chains, trees, the prompt lookup, queued plain
steps); several replies share one verify forward per cycle (`batched.py`) where their
caches can (`rows.batchable`) and their tokens do not depend on the cycle's shape
(`Batch._shares`), and the others take their own steps in turn. A failure in one
reply's part of a cycle ends that reply alone, with its error; a shared cycle that
fails runs again one reply at a time, so that only a reply that fails alone fails.
A single generation is a batch of one (`replies`). The loop knows nothing of text,
time or what proposes the drafts.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn

from .adaptive import BatchedBlock
from .batched import BatchedChain
from .draft import DFlashDraft
from .rows import batchable
from .steps import Commit, Reply
from .target import TargetAdapter

T = TypeVar("T")


def prefill(reply: Reply, start: int) -> Commit:
    """Run the reply's prompt from `start` through the target (the proposer observing every
    position) and commit the target's choice after it, telling `prompt_progress` how much
    of it has run as mlx-lm does: 0 first, after each chunk, all once the token is read."""
    seq, prompt, step = reply.seq, reply.prompt, reply.prefill_step_size
    target, cache, taps = seq.target, seq.cache, seq.proposer.layer_ids
    every_cache = cache + seq.prompt_cache.draft
    progress = reply.prompt_progress or (lambda processed, total: None)
    total = len(prompt) - start
    progress(0, total)
    # All but the last prompt token in chunks whose logits are never computed; then the
    # last one alone, as mlx-lm does: the LM head never sees more than one row.
    for chunk_start in range(start, len(prompt) - 1, step):
        chunk_end = min(chunk_start + step, len(prompt) - 1)
        chunk = mx.array(prompt[chunk_start:chunk_end])[None]
        seq.keep(target.forward(chunk, [cache], taps=taps, prompt=True).features, None)
        mx.eval([c.state for c in every_cache])
        progress(chunk_end - start, total)
    forward = target.forward(mx.array(prompt[-1:])[None], [cache], taps=taps, prompt=True)
    logits = forward.logits
    seq.keep(forward.features, None)
    seq.verifier.at(len(prompt), seq.target.vocab_size)
    first = seq.verifier.verify(mx.array([], dtype=mx.uint32), None, logits[0, -1:], prompt)
    token = first.token.item()
    progress(total, total)
    return Commit([token], first.logits, prefilled=total)


class Batch:
    """Replies to one target decoded together (see the module docstring).

    `chain` runs the cycles that several replies share; without one (or on a target
    whose caches cannot share a forward) each reply takes its own step in turn.
    While the batch holds replies it holds the target (`TargetAdapter.generating`: one
    generation per model, its weights wired as mlx-lm keeps them while generating).
    """

    def __init__(
        self,
        target: TargetAdapter,
        chain: BatchedChain | None = None,
        prompt_concurrency: int | None = None,
    ):
        self.target, self.chain = target, chain
        # how many joining replies a cycle prefills at most (None: all), so that a burst of
        # new prompts delays the replies already decoding by a bounded time
        self.prompt_concurrency = prompt_concurrency
        self.replies: list[Reply] = []
        self.joining: list[Reply] = []
        self.shared: Any = None  # the shared cycle launched, if any
        self.layer_ids: list[int] | None = None  # the layers the replies tap
        self.held: ExitStack | None = None

    def add(self, reply: Reply) -> None:
        """Take `reply`: it is prefilled at the next cycle, and its commits follow."""
        layer_ids, taps = reply.seq.proposer.layer_ids, self.layer_ids or self._joining_taps()
        if layer_ids and taps and layer_ids != taps:
            raise ValueError("replies in one batch must tap the same target layers")
        self.joining.append(reply)

    def _hold(self) -> None:
        """Before a cycle with replies joining: the target held (`TargetAdapter.generating`)
        and the layers the replies tap noted."""
        if self.held is None:
            held = ExitStack()
            held.enter_context(self.target.generating())
            self.held = held
        self.layer_ids = self.layer_ids or self._joining_taps()

    def _joining_taps(self) -> list[int] | None:
        """The target layers the first joining reply that taps any taps."""
        return next(filter(None, (r.seq.proposer.layer_ids for r in self.joining)), None)

    def remove(self, reply: Reply) -> None:
        """Drop `reply` (finished, or its consumer gone): a cycle launched for it is undone
        from its caches, which then hold what `prompt_cache.tokens` lists."""
        if reply in self.joining:
            self.joining.remove(reply)
        if reply in self.replies:
            self.replies.remove(reply)
            if self.shared is not None and reply in self.shared.replies:
                self.chain.drop(self.shared, reply)
            elif reply.pending is not None:
                reply.step.cancel(reply.pending)
            reply.pending = None
        if not self.replies and not self.joining and self.held is not None:
            self.held.close()
            self.held, self.layer_ids = None, None

    def cycle(self) -> None:
        """Advance every reply by one cycle: each gets its next commit (`Reply.commits`), or
        its error where its part of the cycle failed, which ends that reply alone (`_fail`);
        a failed shared cycle runs again one reply at a time (`_settle_shared`, `_launch`),
        so a reply that fails alone fails alone. An error outside every reply's part fails
        them all: the caller gets it raised, the others at their next commit."""
        try:
            self._cycle()
        except Exception as exc:
            for reply in [*self.replies, *self.joining]:
                self._fail(reply, exc)
            self.shared = None
            raise

    def _cycle(self) -> None:
        if self.joining:
            self._hold()
        committed = self._settle_shared() if self.shared is not None else []
        own = [(reply,) for reply in self.replies if reply.pending is not None]
        committed += self._each(self._settle_own, own)
        admitted = self.prompt_concurrency or len(self.joining)
        joining, self.joining = self.joining[:admitted], self.joining[admitted:]
        self.replies += joining
        committed += self._each(self._prefill, [(reply,) for reply in joining])
        now = time.perf_counter()
        going_on = []
        for reply, commit in self._each(self._finish, committed):
            reply.commits.append(commit)
            reply.started = now
            if commit.finish:
                self.remove(reply)
            else:
                going_on.append((reply, commit))
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
        and each launches the cycle again alone, settled in this cycle as its own step's."""
        cycle, self.shared = self.shared, None
        try:
            return self.chain.settle(cycle)
        except Exception:
            roots = [(reply, row.root) for reply, row in zip(cycle.replies, cycle.rows)]
            self._each(self._launch_alone, roots)
            return []

    def _settle_own(self, reply: Reply) -> Commit:
        commit = reply.step.settle(reply.pending, reply.remaining, reply.started)
        reply.pending = None
        return commit

    def _prefill(self, reply: Reply) -> Commit:
        start = reply.seq.prompt_cache.reuse(reply.prompt)
        commit = prefill(reply, start)
        reply.seq.prompt_cache.tokens = list(reply.prompt)
        return commit

    def _finish(self, reply: Reply, commit: Commit) -> Commit:
        """`commit`, ending the reply at an EOS token (kept) or at its token limit."""
        stop = next((i for i, t in enumerate(commit.tokens) if t in reply.eos), None)
        if stop is not None:
            commit.tokens, commit.logits = commit.tokens[: stop + 1], commit.logits[: stop + 1]
        reply.generated += len(commit.tokens)
        if commit.tokens[-1] in reply.eos:
            commit.finish = "stop"
        elif reply.generated >= reply.max_tokens:
            commit.finish = "length"
        if commit.finish and commit.queued:  # queued on the token that ended the reply
            reply.step.cancel(commit.queued)
            commit.queued = None
        elif not commit.finish:
            reply.seq.proposer.committed(commit.tokens)
        return commit

    def _launch(self, going_on: list[tuple[Reply, Commit]]) -> None:
        """The next cycle of every reply going on: one cycle shared by those that may share
        (`_shares`) when there are several, each of the others its own step's. Where the
        shared one fails to launch, its replies are back where they stood and each launches
        alone."""
        sharing = [(r, c) for r, c in going_on if self._shares(r)] if self.chain else []
        alone = []
        if len(sharing) > 1:
            for reply, commit in sharing:
                if commit.queued:
                    reply.step.cancel(commit.queued)
                    commit.queued = None
            roots = [(reply, commit.tokens[-1]) for reply, commit in sharing]
            try:
                self.shared = self.chain.launch(roots)
            except Exception:
                alone = roots
            going_on = [(r, c) for r, c in going_on if (r, c) not in sharing]
        for reply, commit in going_on:
            if commit.queued:  # launched as its step settled
                reply.pending, commit.queued = commit.queued, None
            else:
                alone.append((reply, commit.tokens[-1]))
        self._each(self._launch_alone, alone)

    def _launch_alone(self, reply: Reply, root: int) -> None:
        reply.pending = reply.step.launch(root, reply.remaining)

    @staticmethod
    def _shares(reply: Reply) -> bool:
        """Whether the reply may verify in a shared cycle: its caches can share a forward,
        and its tokens do not depend on the cycle's shape. A greedy reply's never do, nor a
        coupled one's (keyed by position), nor those of one sampling from the global random
        state; a seeded reply under another rule runs the cycles it would run alone, so the
        seed alone decides its reply."""
        verifier = reply.seq.verifier
        greedy = verifier.transform is None and verifier.sampler is None
        free = greedy or verifier.coupled or verifier.key is None
        return batchable(reply.seq.cache) and free


def make_batch(
    model: nn.Module, draft: DFlashDraft | None, prompt_concurrency: int | None = None
) -> Batch:
    """An empty batch for `stream_generate(..., batch=)` with this target and drafter: replies
    of it share their cycles, their drafts per cycle chosen by measured cost; a cycle prefills
    at most `prompt_concurrency` new replies (None: every one waiting)."""
    target = TargetAdapter(model)
    block_size = draft.config.block_size if draft is not None else 1
    return Batch(target, BatchedChain(target, BatchedBlock(block_size)), prompt_concurrency)


def replies(batch: Batch, reply: Reply) -> Iterator[Commit]:
    """`reply`'s commits: the prefill's token first, then one per cycle, the last with its
    `finish` reason. The reply joins the batch now, so replies made before the next cycle
    start it together; whoever finds its reply's commits consumed runs the batch's next
    cycle, which advances every reply in it. Closing the iterator (or dropping it) takes
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
