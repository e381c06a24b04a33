"""One verify cycle, two ways: a chain (`ChainStep`) or a tree (`TreeStep`).

A step has two halves. `launch` queues a cycle's work on the last committed
token: the proposer's drafts and the target's verify forward, with the verdict
computed on the device. `settle` reads the verdict (once), commits the accepted
tokens, trims the target's caches back to them and hands the proposer the
target's features of the kept positions. The loop (`loop.py`) yields the last
commit between the two, so a backend that runs ahead computes the cycle while the
host streams the previous one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from .adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree, Cycle
from .prompt_cache import PromptCache
from .proposers import Proposer
from .rollback import keep_path
from .sampling import Verdict, Verifier
from .target import TargetAdapter, TreeShape
from .tree import Tree, ancestor_mask, read_together, walk

PREFILL_STEP = 2048  # prompt tokens per prefill forward by default, as mlx-lm's


@dataclass
class Commit:
    """Tokens a cycle commits, the target's logits at their positions (after the logits
    processors), the drafts accepted and proposed, why the reply ends (None, "stop",
    "length"), the next cycle if it was launched already (`queued`), for the prefill's
    commit the prompt positions it ran (`prefilled`), and whether the cycle verified a
    tree (else a chain, or a plain step where nothing was proposed)."""

    tokens: list[int]
    logits: mx.array
    accepted: int = 0
    proposed: int = 0
    tree: bool = False
    finish: str | None = None
    queued: Any = None
    prefilled: int = 0


class Sequence:
    """One reply's state that its steps share: the target, the prompt cache (its target
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

    def keep(self, features: mx.array | None, rows: int | list[int] | None) -> None:
        """Hand the proposer the `features` (1, n, ...) of a forward's first `rows` positions
        (all: None; a tree's accepted path: its node indices); None: it taps no layers."""
        if features is not None:
            index = mx.array(rows) if isinstance(rows, list) else slice(rows)
            self.proposer.observe(features[:, index])


class Step(Protocol):
    def launch(self, root: int, remaining: int) -> Any:
        """Queue the cycle after `root` (verifying at most `remaining` positions)."""

    def settle(self, pending: Any, remaining: int, started: float) -> Commit:
        """Read the cycle and commit what was accepted; `started`: when the last one ended."""

    def cancel(self, pending: Any) -> None:
        """Drop a launched cycle the reply no longer needs (one `settle` queued,
        `Commit.queued`, or any cycle of a reply that leaves): its positions leave the
        caches."""


@dataclass(eq=False)
class Reply:
    """One reply a batch advances: its sequence and step, its prompt and limits, the
    commits not yet consumed, and the cycle launched for it (`pending`)."""

    seq: Sequence
    step: Step
    prompt: list[int]
    max_tokens: int
    eos: set[int]
    max_drafts: int | None = None  # a cap on the drafts of a shared cycle (None: the drafter's)
    prefill_step_size: int = PREFILL_STEP
    # mlx-lm's prompt_progress_callback(processed, total), called as the prompt is prefilled
    prompt_progress: Callable[[int, int], None] | None = None
    commits: deque[Commit] = field(default_factory=deque)
    generated: int = 0
    pending: Any = None
    started: float = 0.0
    error: Exception | None = None  # what failed its part of a cycle, raised at its next commit

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated


@dataclass
class PendingChain:
    """A chain cycle on the device: `size` positions verified after `root` (None until the
    host has read it, for a cycle queued on a token still on the device)."""

    root: int | None
    size: int
    drafts: mx.array
    verdict: Verdict
    features: mx.array | None  # the target's features at the verified positions
    launching: float = 0.0  # host seconds spent building it while the cycle before ran
    waited: float = 0.0  # seconds its launch waited for the cycle before's token (that cycle's)


class ChainStep:
    """Verify [root] + `block_size` - 1 drafts (or the policy's size) as one chain."""

    def __init__(
        self,
        seq: Sequence,
        block_size: int,
        policy: AdaptiveBlock | AdaptiveStrategy | None = None,
    ):
        self.seq, self.block_size, self.policy = seq, block_size, policy

    def launch(
        self, root: int | mx.array, remaining: int, drafts: int | None = None
    ) -> PendingChain:
        """The chain cycle after `root`: `drafts` draft tokens if given, else the policy's."""
        seq = self.seq
        if drafts is None:
            drafts = self.policy.plan() if self.policy else self.block_size - 1
        n = seq.target.forward_limit(seq.cache, min(drafts + 1, remaining))
        root_id = mx.array([root]) if isinstance(root, int) else root
        context = seq.tokens + [root] if seq.verifier.processors else None
        seq.verifier.at(len(seq.tokens) + 1, seq.target.vocab_size)
        if n > 1:
            drafts, logq = seq.proposer.chain(root_id, n - 1, context)
            n = drafts.size + 1  # a proposer may stop short (a DSpark confidence head)
            verify = mx.concatenate([root_id, drafts.astype(root_id.dtype)])
        else:
            drafts, logq, verify = mx.array([], dtype=mx.uint32), None, root_id
        forward = seq.target.forward(verify[None], [seq.cache], taps=seq.proposer.layer_ids)
        verdict = seq.verifier.verify(drafts, logq, forward.logits[0], context)
        mx.async_eval(drafts, verdict.accepted, verdict.token)
        root = root if isinstance(root, int) else None
        return PendingChain(root, n, drafts, verdict, forward.features)

    def settle(
        self,
        pending: PendingChain,
        remaining: int,
        started: float,
        launch: Callable[[mx.array, int], Any] | None = None,
    ) -> Commit:
        """`Step.settle`; a plain step queues the next cycle by `launch` (a `SwitchStep`'s,
        which may plan a tree there), else its own: handed in, not kept, so that no step
        refers back to the switch that owns it and a finished reply is freed at once."""
        seq, n, verdict = self.seq, pending.size, pending.verdict
        queued = None
        if n == 1 and remaining > 1 and not seq.verifier.processors:
            # A plain step keeps its input position whatever token it computes: book it and
            # queue the next cycle on that token (still on the device) before the host reads
            # it, as mlx-lm's decoding does, so that on a GPU building the next graph
            # overlaps this step's computation.
            seq.target.rollback(seq.cache, 0)
            seq.keep(pending.features, 1)
            seq.tokens.append(pending.root)
            tic = time.perf_counter()
            launch = launch or self.launch
            queued = launch(verdict.token[None].astype(mx.int32), remaining - 1)
            # the next cycle's host work is its own cost, not this step's
            queued.launching = time.perf_counter() - tic - queued.waited
        read = read_together([pending.drafts, verdict.accepted, verdict.token], mx.int32)
        drafts, accepted, token = (part.tolist() for part in read)
        if isinstance(queued, PendingChain):
            queued.root = token
        if self.policy:
            seconds = time.perf_counter() - started - (queued.launching if queued else 0.0)
            self.policy.record(Cycle(n - 1, accepted, seconds + pending.launching))
        if not queued:
            seq.target.rollback(seq.cache, n - accepted - 1)
            seq.keep(pending.features, accepted + 1)
            seq.tokens.extend([pending.root, *drafts[:accepted]])
        logits = verdict.logits[: accepted + 1]
        return Commit(drafts[:accepted] + [token], logits, accepted, n - 1, queued=queued)

    def cancel(self, pending: PendingChain) -> None:
        self.seq.target.rollback(self.seq.cache, pending.size)


@dataclass
class PendingTree:
    """A tree cycle on the device: the tree, the cache offset it starts at, the target's
    logits, its choices (None with logits processors: those are made during the walk) and
    whether the proposer drafted the tree (else it is the root alone)."""

    tree: Tree
    start: int
    logits: mx.array
    choices: mx.array | None
    proposed: bool
    features: mx.array | None  # as `PendingChain`'s, at every node
    launching: float = 0.0  # as `PendingChain`'s
    waited: float = 0.0  # as `PendingChain`'s


class TreeStep:
    """Verify a tree of up to `budget` draft tokens, at most `max_depth` deep, in one
    forward; commit the path the target's own choices walk down (`tree.py`)."""

    def __init__(
        self,
        seq: Sequence,
        budget: int,
        max_depth: int,
        policy: AdaptiveTree | AdaptiveStrategy | None = None,
    ):
        self.seq, self.budget, self.max_depth, self.policy = seq, budget, max_depth, policy

    def launch(self, root: int, remaining: int, budget: int | None = None) -> PendingTree:
        """The tree cycle after `root`: up to `budget` nodes if given, else the policy's."""
        seq, policy = self.seq, self.policy
        if budget is None:
            budget = self.budget if not policy or policy.plan() > 0 else 0
        depth = min(self.max_depth, seq.target.forward_limit(seq.cache, remaining) - 1, budget)
        tree = Tree([root], [-1], [0])
        verifier, position = seq.verifier, len(seq.tokens) + 1
        verifier.at(position, seq.target.vocab_size)
        if depth > 0:
            scores = verifier.tree_scores if verifier.coupled else None
            tree = seq.proposer.tree(root, depth, budget, scores)
            if policy:
                tree = tree.first(policy.fit(tree.probabilities()) + 1)
        start = seq.cache[0].offset
        shape = TreeShape(tree.depths, ancestor_mask(tree.parents))
        forward = seq.target.forward(
            mx.array(tree.tokens)[None], [seq.cache], [shape], seq.proposer.layer_ids
        )
        logits = forward.logits[0]
        # The target's own choice at every node: its argmax, its coupled choice at the node's
        # position, or its sample (a node is then accepted when the target's sample at its
        # parent is the node's token: every committed token is the target's own sample, so
        # the output is exact in distribution). Logits processors see each node's own path,
        # and a verifier that chooses per row pays for the path's nodes alone: their choices
        # are made during the walk.
        positions = [position + depth for depth in tree.depths]
        during_walk = verifier.processors or verifier.chooses_per_row
        choices = None if during_walk else verifier.choices(logits, positions)
        mx.async_eval(logits if choices is None else choices)
        return PendingTree(tree, start, logits, choices, depth > 0, forward.features)

    def settle(self, pending: PendingTree, remaining: int, started: float) -> Commit:
        seq, tree, logits = self.seq, pending.tree, pending.logits
        processed: dict[int, mx.array] = {}

        def choose_processed(node: int) -> int:
            context = seq.tokens + [tree.tokens[n] for n in tree.path(node)]
            row = seq.verifier.process(logits[node : node + 1], context, mx.array([], mx.uint32))
            processed[node] = row
            position = len(seq.tokens) + 1 + tree.depths[node]
            return seq.verifier.choices(row, [position]).item()

        choices = pending.choices
        path, after = walk(
            tree, choose_processed if choices is None else choices.tolist().__getitem__
        )
        if processed:
            logits = mx.concatenate([processed[node] for node in path])
        else:
            logits = logits[mx.array(path)]
        if pending.proposed:
            seq.proposer.verified(tree, path)
        keep_path(seq.cache, pending.start, path)
        seq.keep(pending.features, path)
        tokens = [tree.tokens[node] for node in path]
        seq.tokens.extend(tokens)
        accepted = len(path) - 1
        if self.policy:
            probabilities = tree.probabilities()
            seconds = time.perf_counter() - started + pending.launching
            self.policy.record(Cycle(len(tree) - 1, accepted, seconds, probabilities, path))
        return Commit(tokens[1:] + [after], logits, accepted, len(tree) - 1, tree=True)

    def cancel(self, pending: PendingTree) -> None:
        self.seq.target.rollback(self.seq.cache, len(pending.tree))


class SwitchStep:
    """Each cycle a chain or a tree, as the policy plans it (`AdaptiveStrategy`).

    A plain step queues the next cycle on its token while still on the device; a tree
    planned there waits for that token. A target whose attention refuses its first tree
    forward (`hooks.hooked`) gets that forward undone and chains from then on.
    """

    def __init__(self, chain: ChainStep, tree: TreeStep, policy: AdaptiveStrategy):
        self.chain, self.tree, self.policy = chain, tree, policy

    def launch(self, root: int | mx.array, remaining: int) -> PendingChain | PendingTree:
        plan = self.policy.plan()
        if not plan.tree:
            return self.chain.launch(root, remaining, plan.drafts)
        tic = time.perf_counter()
        root = root if isinstance(root, int) else root.item()
        waited = time.perf_counter() - tic  # for a token on the device: the cycle before's
        cache = self.chain.seq.cache
        start = cache[0].offset
        try:
            pending = self.tree.launch(root, remaining, plan.drafts)
            pending.waited = waited
            return pending
        except ValueError:
            if self.policy.trees_measured:
                raise  # it verified trees before: not the target's refusal
            self.chain.seq.target.rollback(cache, cache[0].offset - start)
            self.policy.drop_trees()
            return self.chain.launch(root, remaining, self.policy.plan().drafts)

    def settle(self, pending: PendingChain | PendingTree, remaining: int, started: float) -> Commit:
        if isinstance(pending, PendingTree):
            return self.tree.settle(pending, remaining, started)
        return self.chain.settle(pending, remaining, started, self.launch)

    def cancel(self, pending: PendingChain | PendingTree) -> None:
        step = self.tree if isinstance(pending, PendingTree) else self.chain
        step.cancel(pending)
