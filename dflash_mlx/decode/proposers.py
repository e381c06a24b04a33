"""What proposes draft tokens to a cycle: a drafter, the prompt lookup, or nothing.

A cycle asks the rows' proposers for chains (`chains`: tokens after each row's last
committed one, and their log-probabilities for speculative sampling) or trees (`trees`), one
request per row (`ChainRequest`, `TreeRequest`),
hands them the target's features of the positions each row kept (`observe`, for proposers
that tap target layers: `layer_ids`), and tells each the tokens committed (`committed`)
and which of a tree's nodes the target accepted (`verified`). The rows that draft with one
drafter module share its forwards; the base class proposes nothing: plain decoding. A new
kind of drafter is one more subclass here; the cycle stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..models.draft import (
    Choose,
    DFlashDraft,
    DraftChain,
    DraftTree,
    TreeScores,
    block_rows,
)
from ..models.target import TargetAdapter
from ..models.tree import Chain, Drafted, Tree, search
from .lookup import ContextLookup

__all__ = ["Choose", "TreeScores"]


class Proposer:
    """Proposes nothing (plain decoding); the hooks every proposer may use."""

    layer_ids: list[int] | None = None  # the target layers whose features `observe` wants

    def committed(self, tokens: list[int]) -> None:
        """Tokens committed to the reply, in order."""

    def chain(self, depth: int) -> Chain | None:
        """Known tokens to graft onto this row's tree, up to `depth` (None: nothing)."""
        return None

    @property
    def drafting(self) -> DrafterProposer | None:
        """The drafter proposer whose forwards this row's chains, trees and observations share
        with other rows'; None: it has no drafter."""
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

    @property
    def drafting(self) -> DrafterProposer:
        return self


def check_compatible(target: TargetAdapter, draft: DFlashDraft) -> None:
    """Fail early when a drafter was not made for this target, in the sizes a user knows
    the models by (hidden size, layer count, vocabulary), not as a weight's shape."""
    cfg = draft.config
    n_layers = len(target.layers)
    differences = []
    if cfg.hidden_size != target.hidden_size:
        differences.append(f"hidden size {cfg.hidden_size} (the target's: {target.hidden_size})")
    deepest = max(cfg.target_layer_ids)
    if cfg.num_target_layers not in (None, n_layers):
        differences.append(f"{cfg.num_target_layers} layers (the target's: {n_layers})")
    elif deepest >= n_layers:
        differences.append(f"it reads layer {deepest} (the target has {n_layers})")
    if cfg.vocab_size != target.vocab_size:
        differences.append(f"vocabulary {cfg.vocab_size} (the target's: {target.vocab_size})")
    if differences:
        raise ValueError("the drafter was made for another model: " + "; ".join(differences))
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

    def committed(self, tokens: list[int]) -> None:
        self.lookup.extend(tokens)

    def chain(self, depth: int) -> Chain | None:
        tokens, logprobs = self.lookup.proposal(depth)
        return (tokens, logprobs) if tokens else None

    @property
    def drafting(self) -> DrafterProposer | None:
        return self.base.drafting

    def verified(self, tree: Tree, path: list[int]) -> None:
        self.lookup.record(tree.chain, path)
        self.base.verified(tree, path)


def by_drafter(proposers: list[Proposer], *keys: list[int]) -> dict[tuple, list[int]]:
    """The indices of the proposers that draft, grouped by the drafter module they draft
    with (and by `keys[k][i]`, where rows must agree on more to share a forward)."""
    groups: dict[tuple, list[int]] = {}
    for i, proposer in enumerate(proposers):
        drafting = proposer.drafting
        if drafting is not None:
            key = (id(drafting.draft), *[k[i] for k in keys])
            groups.setdefault(key, []).append(i)
    return groups


@dataclass(frozen=True)
class ChainRequest:
    """A row's request for a chain: up to `length` drafts after `root` (a token (1,), maybe
    still on the device) from its `proposer`; `context` is every token up to the root, for
    logits processors (None without them)."""

    proposer: Proposer
    root: mx.array
    length: int
    context: list[int] | None = None


@dataclass(frozen=True)
class TreeRequest:
    """A row's request for a tree: up to `budget` draft tokens after `root` (a token (1,),
    maybe still on the device), at most `depth` deep, from its `proposer`, ranked by `scores`
    of the drafter's logits (None: the logits themselves), with the proposer's chain grafted
    if `graft` (not where the root is still on the device: the proposer has not been given
    it, so its chain would follow the token before)."""

    proposer: Proposer
    root: mx.array
    depth: int
    budget: int
    scores: TreeScores | None = None
    graft: bool = True


def chains(requests: list[ChainRequest]) -> list[tuple[mx.array, mx.array | None]]:
    """Each row's chain of up to `length` drafts after its root and their log-probabilities
    q (None unless sampling; a drafter may stop short: a DSpark confidence head). The rows
    drafting with one drafter module share one drafter forward (`DFlashDraft.propose`)."""
    out: list = [None] * len(requests)
    groups = by_drafter([r.proposer for r in requests])
    if sum(map(len, groups.values())) < len(requests):
        raise ValueError("this proposer drafts no chains: use a block size of 1")
    for members in groups.values():
        rows = [requests[i] for i in members]
        drafters = [r.proposer.drafting for r in rows]
        first = drafters[0]
        blocks = block_rows([r.root for r in rows], max(r.length for r in rows), first.mask)
        drafting = [
            DraftChain(d.cache, d.choose, r.length, r.context) for d, r in zip(drafters, rows)
        ]
        proposed = first.draft.propose(blocks, first.embed, first.head, drafting)
        for i, chain in zip(members, proposed):
            out[i] = chain
    return out


def trees(requests: list[TreeRequest]) -> list[Drafted]:
    """Each row's tree as it requests, built on the device with its proposer's chain grafted
    (`Proposer.chain`: the prompt lookup's). The rows drafting with one drafter module to one
    depth share one drafter forward (`DFlashDraft.trees`); a row without a drafter grows
    from its root alone."""
    chains = [r.proposer.chain(r.depth) if r.graft else None for r in requests]
    out: list[Drafted | None] = [None] * len(requests)
    groups = by_drafter([r.proposer for r in requests], [r.depth for r in requests])
    for (_, depth), members in groups.items():
        rows = [requests[i] for i in members]
        drafters = [r.proposer.drafting for r in rows]
        first = drafters[0]
        drafting = [
            DraftTree(r.root, d.cache, r.budget, r.scores, chains[i])
            for i, d, r in zip(members, drafters, rows)
        ]
        drafted = first.draft.trees(depth, first.embed, first.head, drafting)
        for i, tree in zip(members, drafted):
            out[i] = tree
    return [
        search(r.root, None, None, r.budget, chain) if tree is None else tree
        for r, chain, tree in zip(requests, chains, out)
    ]


def observe(proposers: list[Proposer], features: mx.array, kept: list[int | list[int]]) -> None:
    """Hand each row's drafter the target's features (rows, n, len(layer_ids) x hidden) of
    one forward's positions its row kept: the first `kept[i]` (an int) or those listed (a
    tree's accepted path). The rows drafting with one drafter module take them in one
    drafter pass (`DFlashDraft.append_context`); the others observe nothing."""
    for members in by_drafter(proposers).values():
        drafters = [proposers[i].drafting for i in members]
        if len(members) == 1:
            i = members[0]
            index = mx.array(kept[i]) if isinstance(kept[i], list) else slice(kept[i])
            rows = features if len(proposers) == 1 else features[i : i + 1]
            drafters[0].draft.append_context(rows[:, index], [drafters[0].cache])
            continue
        rows = features[mx.array(members)] if len(members) < len(proposers) else features
        counts = [len(kept[i]) if isinstance(kept[i], list) else kept[i] for i in members]
        if any(isinstance(kept[i], list) for i in members):
            longest = max(counts)
            paths = [
                kept[i] + [0] * (longest - len(kept[i]))
                if isinstance(kept[i], list)
                else list(range(kept[i])) + [0] * (longest - kept[i])
                for i in members
            ]
            rows = mx.take_along_axis(rows, mx.array(paths)[:, :, None], axis=1)
        else:
            rows = rows[:, : max(counts)]
        drafters[0].draft.append_context(rows, [d.cache for d in drafters], counts)
