"""What proposes draft tokens to a step: a drafter, the prompt lookup, or nothing.

A step (`steps.py`) asks its proposer for a chain (`chain`: tokens after the last
committed one, and their log-probabilities for speculative sampling) or a tree
(`tree`), tells it the target's features of every position the target kept
(`observe`, for proposers that tap target layers: `layer_ids`), the tokens
committed (`committed`) and which of a tree's nodes the target accepted
(`verified`). The base class proposes nothing: plain decoding. A new kind of
drafter is one more subclass here; the loop and the steps stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .draft import DFlashDraft
from .lookup import ContextLookup
from .target import TargetAdapter
from .tree import Tree, graft

Choose = Callable[..., tuple[mx.array, mx.array | None]]  # `Verifier.propose`
# `Verifier.tree_scores`: drafter logits (depths 1, 2, ...) and their columns' token ids
# (None: the vocabulary) -> what a tree ranks its candidates by
TreeScores = Callable[[mx.array, list[int] | None], mx.array]


class Proposer:
    """Proposes nothing (plain decoding); the hooks every proposer may use."""

    layer_ids: list[int] | None = None  # the target layers whose features `observe` wants

    def observe(self, features: mx.array) -> None:
        """The target's features (1, n, len(layer_ids) x hidden) of the n positions it kept."""

    def committed(self, tokens: list[int]) -> None:
        """Tokens committed to the reply, in order."""

    def chain(
        self, root: mx.array, length: int, context: list[int] | None
    ) -> tuple[mx.array, mx.array | None]:
        """`length` draft tokens after `root` (1,) and their log-probabilities q (None unless
        sampling); `context` is every token up to the root, for logits processors."""
        raise ValueError("this proposer drafts no chains: use a block size of 1")

    def tree(self, root: int, depth: int, budget: int, scores: TreeScores | None = None) -> Tree:
        """A tree of up to `budget` draft tokens after `root`, at most `depth` deep, ranked
        by `scores` of the drafter's logits (None: the logits themselves)."""
        return Tree([root], [-1], [0])

    @property
    def drafting(self) -> DrafterProposer | None:
        """The drafter proposer whose forwards this one's chains and observations may share
        with other replies' (`propose_chains`, `observe_rows`); None: its own alone."""
        return None

    def verified(self, tree: Tree, path: list[int]) -> None:
        """The target accepted `path` (node indices from the root) of the verified `tree`."""


class DrafterProposer(Proposer):
    """A DFlash drafter: proposes from the target's features through the target's
    embedding and LM head (restricted to its draft vocabulary, if it has one)."""

    def __init__(self, draft: DFlashDraft, target: TargetAdapter, cache: list, choose: Choose):
        check_compatible(target, draft)
        self.draft, self.cache, self.choose = draft, cache, choose
        self.embed = target.embed_tokens
        self.head = target.draft_head(draft.config.draft_vocab)
        self.layer_ids = draft.config.target_layer_ids
        self.mask = draft.config.mask_token_id

    def observe(self, features: mx.array) -> None:
        self.draft.append_context(features, self.cache)

    def chain(
        self, root: mx.array, length: int, context: list[int] | None
    ) -> tuple[mx.array, mx.array | None]:
        block = mx.concatenate([root, mx.full((length,), self.mask)])
        return self.draft.propose(block, self.embed, self.head, self.cache, self.choose, context)

    def tree(self, root: int, depth: int, budget: int, scores: TreeScores | None = None) -> Tree:
        return self.draft.tree(root, depth, self.embed, self.head, self.cache, budget, scores)

    @property
    def drafting(self) -> DrafterProposer:
        return self


def check_compatible(target: TargetAdapter, draft: DFlashDraft) -> None:
    """Fail early, naming the mismatch, when a drafter was not made for this target."""
    cfg = draft.config
    n_layers = len(target.layers)
    out_of_range = [i for i in cfg.target_layer_ids if not 0 <= i < n_layers]
    if out_of_range:
        raise ValueError(
            f"drafter taps target layers {out_of_range}, but the target has {n_layers} layers"
        )
    n_features = len(cfg.target_layer_ids)
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter fc expects {n_features} target layers x hidden size {cfg.hidden_size} "
            f"= {n_features * cfg.hidden_size} features, but the target's hidden size is "
            f"{target.hidden_size} ({n_features * target.hidden_size} features)"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocab size {cfg.vocab_size} != target vocab size {target.vocab_size}"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
            f"(size {target.vocab_size})"
        )


class LookupProposer(Proposer):
    """The prompt lookup (`lookup.py`): what followed the last token where it occurred
    before, grafted onto the trees of `base` (a drafter) or, without one, alone."""

    def __init__(self, prompt: list[int], base: Proposer | None = None):
        self.lookup, self.base = ContextLookup(prompt), base or Proposer()
        self.layer_ids = self.base.layer_ids
        self.nodes: list[int] = []  # the last tree's chain tokens' nodes

    def observe(self, features: mx.array) -> None:
        self.base.observe(features)

    def committed(self, tokens: list[int]) -> None:
        self.lookup.extend(tokens)

    def chain(
        self, root: mx.array, length: int, context: list[int] | None
    ) -> tuple[mx.array, mx.array | None]:
        return self.base.chain(root, length, context)

    def tree(self, root: int, depth: int, budget: int, scores: TreeScores | None = None) -> Tree:
        base = self.base.tree(root, depth, budget, scores)
        tree, self.nodes = graft(base, *self.lookup.proposal(depth), budget)
        return tree

    @property
    def drafting(self) -> DrafterProposer | None:
        return self.base.drafting

    def verified(self, tree: Tree, path: list[int]) -> None:
        # a policy may have verified the tree's first nodes only
        self.lookup.record([n if n < len(tree) else -1 for n in self.nodes], path)
        self.base.verified(tree, path)


def by_drafter(proposers: list[Proposer]) -> tuple[dict[int, list[int]], list[int]]:
    """The indices of `proposers` grouped by the drafter module they draft with, and those
    that draft alone."""
    groups: dict[int, list[int]] = {}
    alone = []
    for i, proposer in enumerate(proposers):
        drafting = proposer.drafting
        if drafting is None:
            alone.append(i)
        else:
            groups.setdefault(id(drafting.draft), []).append(i)
    return groups, alone


def propose_chains(
    proposers: list[Proposer],
    roots: list[int],
    lengths: list[int],
    contexts: list[list[int] | None],
) -> list[tuple[mx.array, mx.array | None]]:
    """Each proposer's chain of `lengths[i]` drafts after `roots[i]` (`Proposer.chain`);
    those drafting with one drafter module share one drafter forward
    (`DFlashDraft.propose_rows`)."""
    out: list = [None] * len(proposers)
    groups, alone = by_drafter(proposers)
    for i in alone + [g[0] for g in groups.values() if len(g) == 1]:
        out[i] = proposers[i].chain(mx.array([roots[i]]), lengths[i], contexts[i])
    for members in (g for g in groups.values() if len(g) > 1):
        drafters = [proposers[i].drafting for i in members]
        first, longest = drafters[0], max(lengths[i] for i in members)
        blocks = mx.array([[roots[i]] + [first.mask] * longest for i in members])
        proposed = first.draft.propose_rows(
            blocks,
            first.embed,
            first.head,
            [d.cache for d in drafters],
            [d.choose for d in drafters],
            [contexts[i] for i in members],
            [lengths[i] for i in members],
        )
        for i, chain in zip(members, proposed):
            out[i] = chain
    return out


def observe_rows(proposers: list[Proposer], features: mx.array, counts: list[int]) -> None:
    """Hand each proposer the target's features (rows, n, ...) of its row's first `counts[i]`
    positions (`Proposer.observe`); those drafting with one drafter module take them in one
    drafter pass (`DFlashDraft.append_context_rows`)."""
    groups, alone = by_drafter(proposers)
    for i in alone:
        proposers[i].observe(features[i : i + 1, : counts[i]])
    for members in groups.values():
        drafters = [proposers[i].drafting for i in members]
        rows = features[mx.array(members)] if len(members) < len(proposers) else features
        rows = rows[:, : max(counts[i] for i in members)]
        caches = [d.cache for d in drafters]
        drafters[0].draft.append_context_rows(rows, caches, [counts[i] for i in members])
