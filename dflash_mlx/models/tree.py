"""Draft trees (DDTree): many candidate continuations verified in one target forward.

The drafter's block gives a distribution q_t for every position t after the
last committed token (the root). Treating the positions as independent given
the root, a prefix x_1..x_d scores sum_t log q_t(x_t); the tree is the `budget`
best prefixes (`ranked_tree`). Scores only fall along a path, so those prefixes
form a tree, and the best `budget` prefixes of each depth, each extending one of
the depth before's, hold all of them (`search`). A DFlash 2 drafter's selector
scores a token given the one before it: there q_t(x_t | x_{t-1}) over its top-K
candidates, and the same search reads each prefix's extensions from its last
token's row. The prompt lookup's chain is grafted in the same search.

The tree is built on the device (`Drafted`): its size follows from the shapes,
so the verify forward is queued without reading it, and the cycle reads the tree
with the target's choices, once. The target runs once over all nodes: each node
sees the committed context and its ancestors (`ancestor_mask`) at the position of
its depth. Walking the target's own choices down from the root (`walk`, on the
host's `Tree`) gives the longest accepted path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import numpy as np


@dataclass
class Tree:
    """Nodes in an order where every parent comes before its children; node 0 is the root.

    `tokens[i]` is node i's token, `parents[i]` its parent (-1 for the root),
    `depths[i]` its distance from the root (the position after the last
    committed token it stands for), `logprobs[i]` its path's log-probability
    under the drafter (summed along the path; the root's is 0), `chain[k]` the node
    of a grafted chain's k-th token (-1 where the budget cut it). Drafted trees come
    best first, so the first b + 1 nodes are the tree of budget b.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    logprobs: list[float] = field(default_factory=lambda: [0.0])
    chain: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to `node`."""
        nodes = [node]
        while self.parents[nodes[-1]] >= 0:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def probabilities(self) -> list[float]:
        """Each node's path probability under the drafter, the root's left out."""
        return [math.exp(logprob) for logprob in self.logprobs[1:]]

    def first(self, count: int) -> Tree:
        """The tree of its first `count` nodes (parents come first: a tree again)."""
        if count >= len(self):
            return self
        chain = [node if node < count else -1 for node in self.chain]
        cut = (self.tokens, self.parents, self.depths, self.logprobs)
        return Tree(*(values[:count] for values in cut), chain)

    def children(self) -> list[dict[int, int]]:
        """For each node: token -> child node."""
        table: list[dict[int, int]] = [{} for _ in self.tokens]
        for node in range(1, len(self.tokens)):
            table[self.parents[node]][self.tokens[node]] = node
        return table


@dataclass
class Drafted:
    """A tree drafted on the device, best first (node i's parent comes before it; the first
    b + 1 nodes are the tree of budget b): node tokens, parents (-1 for the root), depths and
    path log-probabilities, and the nodes of a grafted chain's tokens (-1 where the budget cut
    them). Its size is known on the host, so the verify forward is built without reading it;
    `settle` reads it with the verdict (`parts`, then `of`)."""

    tokens: mx.array  # (n,) int32
    parents: mx.array  # (n,) int32
    depths: mx.array  # (n,) int32
    logprobs: mx.array  # (n,) float32
    chain: mx.array  # (L,) int32
    deepest: int  # no node is deeper

    @classmethod
    def alone(cls, root: mx.array) -> Drafted:
        """The root alone (shape (1,))."""
        zero = mx.zeros((1,), dtype=mx.int32)
        return cls(root.astype(mx.int32), zero - 1, zero, zero.astype(mx.float32), zero[:0], 0)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def first(self, count: int) -> Drafted:
        """The tree of its first `count` nodes (parents come first: a tree again)."""
        if count >= len(self):
            return self
        kept = mx.where(self.chain < count, self.chain, -1)
        return Drafted(
            self.tokens[:count],
            self.parents[:count],
            self.depths[:count],
            self.logprobs[:count],
            kept,
            self.deepest,
        )

    def parts(self) -> list[mx.array]:
        """What reading it takes, as int32 (the log-probabilities' bits)."""
        bits = mx.view(self.logprobs, mx.int32)
        return [self.tokens, self.parents, self.depths, bits, self.chain]

    @staticmethod
    def of(values: list[np.ndarray]) -> Tree:
        """The host's tree from its `parts`, read."""
        tokens, parents, depths, bits, chain = values
        logprobs = bits.view(np.float32).tolist()
        return Tree(tokens.tolist(), parents.tolist(), depths.tolist(), logprobs, chain.tolist())

    def read(self) -> Tree:
        """The host's tree, in one read."""
        return self.of(read_together(self.parts(), mx.int32))


def read_together(arrays: list[mx.array], dtype: mx.Dtype) -> list[np.ndarray]:
    """`arrays` as numpy arrays of their own shapes, cast to `dtype`, in one read from the
    device. Token ids and ranks stay exact in float32 (below 2^24) and in int32."""
    flat = np.array(mx.concatenate([a.astype(dtype).reshape(-1) for a in arrays]))
    parts = np.split(flat, np.cumsum([a.size for a in arrays])[:-1])
    return [part.reshape(a.shape) for part, a in zip(parts, arrays)]


Chain = tuple[list[int], list[float]]  # host-known tokens after the root, each one's log q


def search(
    root: mx.array,
    candidates: mx.array | None,
    edges: mx.array | None,
    budget: int,
    chain: Chain | None = None,
) -> Drafted:
    """The tree of the `budget` highest-scoring prefixes (plus the root), best first, built
    on the device: nothing is read, and its size depends on the shapes alone.

    `candidates[t]` (D, K) are the tokens for position t + 1 after the root; `edges[t, p, j]`
    (D, P, K) the log-probability of candidate j there after candidate p at position t (P = 1:
    the positions independent given the root; at t = 0 row 0 is the root's). A prefix scores
    its summed log-probabilities; scores only fall along a path, so the best prefixes form a
    tree, and the best `budget` of each depth (a beam) hold every one of them. `chain` is
    grafted as a path from the root (the prompt lookup's): where it meets a prefix of the
    beams, that node keeps the better score and the chain goes on below it. Ties go to the
    shallower node, then the one found first. Where fewer prefixes of probability above 0
    exist than the budget (a tiny vocabulary, a draft vocabulary's -inf columns), prefixes of
    probability 0 fill the rest, after all others: verified like any node, never accepted
    unless they are the target's own choice.

    Its graph is built each cycle, so only the beams' choices are made depth by depth; the
    prefixes' tokens, parents and the chain's meetings are found for all depths at once, and
    the whole graph is compiled (`_searched`): one call replays its ~150 primitives, whose
    layout depends on the shapes alone.
    """
    known, known_logprobs = chain or ([], [])
    deepest = max(0 if candidates is None else candidates.shape[0], len(known))
    sizes = () if candidates is None else _beam_sizes(*candidates.shape, budget)
    nodes = min(budget, max(sum(sizes), len(known)))
    if nodes == 0:
        return Drafted.alone(root)
    grafted = None
    if known:
        grafted = (mx.array(known, dtype=mx.int32), mx.array(known_logprobs, dtype=mx.float32))
    return Drafted(*_searched(root, candidates, edges, grafted, sizes, nodes), deepest)


@mx.compile
def _searched(
    root: mx.array,
    candidates: mx.array | None,
    edges: mx.array | None,
    chain: tuple[mx.array, mx.array] | None,
    sizes: tuple[int, ...],
    nodes: int,
) -> list[mx.array]:
    """`search`'s tree arrays: the beams of `sizes` (none without candidates), the chain's
    tokens and log q (or None) grafted, the best `nodes` kept."""
    if sizes:
        score, token, parent = _beams(candidates, edges, sizes)
    else:
        score, token, parent = mx.zeros((0,)), mx.zeros((0,), mx.int32), mx.zeros((0,), mx.int32)
    length = 0 if chain is None else chain[0].size
    met, chain_scores = _chain(score, token, parent, sizes, chain)
    if chain is not None:
        score = mx.concatenate([score, *chain_scores])
        token = mx.concatenate([token, chain[0]])
        met = mx.concatenate([met, mx.zeros((length,), dtype=mx.bool_)])
    return _select(root, score, token, parent, met, _order(sizes, length), nodes)


def _beam_sizes(depth: int, width: int, budget: int) -> tuple[int, ...]:
    """The prefixes each depth's beam keeps: up to `budget` of the `width` extensions of each
    of the beam before's (the root's first)."""
    sizes, beam = [], 1
    for _ in range(depth):
        beam = min(budget, beam * width)
        sizes.append(beam)
    return tuple(sizes)


def _depths(sizes: tuple[int, ...]) -> np.ndarray:
    """Each of the beams' prefixes' depth, flat over depths (1 for the root's children)."""
    return np.repeat(np.arange(1, len(sizes) + 1), sizes)


@lru_cache(maxsize=64)
def _layout(sizes: tuple[int, ...], width: int) -> tuple[mx.array, mx.array]:
    """For the beams' prefixes, flat over depths: the pool index of the beam before's first
    prefix (-1 at depth 1: the root), and its depth's first candidate index in the flattened
    candidates (its row times `width`)."""
    depth = _depths(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    before = np.where(depth > 1, starts[np.maximum(depth - 2, 0)], -1)
    return mx.array(before, mx.int32), mx.array((depth - 1) * width, mx.int32)


def _beams(
    candidates: mx.array, edges: mx.array, sizes: tuple[int, ...]
) -> tuple[mx.array, mx.array, mx.array]:
    """Each depth's beam, flat over depths: the prefixes' scores, tokens and parents (pool
    indices, -1 for the root)."""
    width = candidates.shape[1]
    spreads, tiles, ends = _extensions(sizes, width)
    independent = edges.shape[1] == 1
    if independent:  # each depth's log q, once per prefix of the beam before
        tiled = mx.take(edges.reshape(-1).astype(mx.float32), tiles)
        rows = mx.split(tiled, ends) if ends else [tiled]
    else:
        rows = mx.split(edges, len(sizes)) if len(sizes) > 1 else [edges]
    beam_score = mx.zeros((1,), dtype=mx.float32)
    beam_slot = mx.zeros((1,), dtype=mx.int32)
    scores, tops = [], []
    for t, kept in enumerate(sizes):
        row = rows[t] if independent else rows[t][0][beam_slot].reshape(-1).astype(mx.float32)
        flat = mx.take_along_axis(beam_score, spreads[t], axis=0) + row
        if kept < flat.size:
            top = mx.argpartition(-flat, kept - 1)[:kept]
        else:  # all of them, indexed as argpartition indexes them
            top = mx.arange(kept, dtype=mx.uint32)
        beam_score = mx.take_along_axis(flat, top, axis=0)
        if not independent:
            beam_slot = top % width
        scores.append(beam_score)
        tops.append(top)
    before, first = _layout(sizes, width)
    top = mx.concatenate(tops) if len(tops) > 1 else tops[0]
    token = mx.take(candidates.reshape(-1), first + top % width).astype(mx.int32)
    parent = before + top // width
    return mx.concatenate(scores) if len(scores) > 1 else scores[0], token, parent


@lru_cache(maxsize=64)
def _extensions(sizes: tuple[int, ...], width: int) -> tuple[list[mx.array], mx.array, list[int]]:
    """How each depth extends the beam before (the root's first), flat over its prefixes
    times the `width` candidates: which prefix each extension extends (`spreads`, per depth),
    which of the flattened (depth, candidate) log q it adds (`tiles`, all depths), and where
    each depth's extensions end there but the last (`ends`)."""
    before = (1, *sizes[:-1])
    spreads = [mx.array(np.arange(n * width) // width, mx.int32) for n in before]
    tiles = np.concatenate([t * width + np.arange(n * width) % width for t, n in enumerate(before)])
    ends = np.cumsum([n * width for n in before])[:-1].tolist()
    return spreads, mx.array(tiles, mx.int32), ends


def _chain(
    score: mx.array,
    token: mx.array,
    parent: mx.array,
    sizes: tuple[int, ...],
    chain: tuple[mx.array, mx.array] | None,
) -> tuple[mx.array, list[mx.array]]:
    """Which beams' prefixes the chain (its tokens and their log q) met (its tokens all the
    way from the root), and the chain's scores: each of its tokens' log q after the score
    before, or the score of the prefix it met there if better."""
    if chain is None:
        return mx.zeros(score.shape, dtype=mx.bool_), []
    known, known_logprobs = chain
    met_depths = min(known.size, len(sizes))
    if not met_depths:
        return mx.zeros(score.shape, dtype=mx.bool_), _chain_scores(known_logprobs, [])
    depth, own, in_depth = _chain_layout(sizes, met_depths)
    unmet = mx.full((len(sizes) - met_depths,), -1, dtype=mx.int32)
    met = token == mx.concatenate([known[:met_depths], unmet])[depth]
    up = parent + own  # a prefix of depth 1 stands for the root: its own parent
    for _ in range((met_depths - 1).bit_length()):  # each pass doubles the ancestors checked
        met = met & mx.take_along_axis(met, up, axis=0)
        up = mx.take_along_axis(up, up, axis=0)
    best = mx.where(in_depth & met, score, -mx.inf).max(axis=1)
    return met, _chain_scores(known_logprobs, mx.split(best, met_depths))


@lru_cache(maxsize=64)
def _chain_layout(sizes: tuple[int, ...], met_depths: int) -> tuple[mx.array, mx.array, mx.array]:
    """For a chain meeting the beams of `sizes` in their first `met_depths` depths: each
    prefix's depth - 1, each one's index + 1 at depth 1 (0 deeper: added to its parent, -1
    there, it makes it its own), and which prefixes each of those depths holds."""
    depth = _depths(sizes) - 1
    own = np.where(depth == 0, np.arange(depth.size) + 1, 0)
    in_depth = depth[None] == np.arange(met_depths)[:, None]
    return mx.array(depth, mx.int32), mx.array(own, mx.int32), mx.array(in_depth)


def _chain_scores(logprobs: mx.array, met: list[mx.array]) -> list[mx.array]:
    """The chain's scores: summed log q along it, or the score of the prefix met, if better."""
    score, scores = mx.zeros((1,), dtype=mx.float32), []
    for t, step in enumerate(mx.split(logprobs, logprobs.size)):
        score = score + step
        if t < len(met):
            score = mx.maximum(score, met[t])
        scores.append(score)
    return scores


@dataclass(frozen=True)
class _Order:
    """What orders a pool of the beams' prefixes and a chain's nodes, known from the shapes:
    each node's depth; the parent a node the chain met hands its children to (the chain's
    node a depth up); which node comes first among equal scores (`earlier[i, j]`: j before i,
    as the shallower, then the one found first); the chain's nodes' parents (the one before,
    the first's the root: -1); and where the chain's nodes start."""

    depth: mx.array
    handed: mx.array
    earlier: mx.array
    chain_parents: mx.array
    size: int


@lru_cache(maxsize=64)
def _order(sizes: tuple[int, ...], chain: int) -> _Order:
    """The `_Order` of the beams of `sizes` and a chain of `chain` nodes."""
    size = sum(sizes)
    depth = np.concatenate([_depths(sizes), np.arange(1, chain + 1)])
    index = np.arange(depth.size)
    earlier = (depth[None] < depth[:, None]) | (depth[None] == depth[:, None]) & (
        index[None] < index[:, None]
    )
    on_chain = np.arange(chain)
    return _Order(
        mx.array(depth, mx.int32),
        mx.array(size + depth - 2, mx.int32),
        mx.array(earlier),
        mx.array(np.where(on_chain == 0, -1, size + on_chain - 1), mx.int32),
        size,
    )


def _select(
    root: mx.array,
    score: mx.array,
    token: mx.array,
    parent: mx.array,
    met: mx.array,
    order: _Order,
    nodes: int,
) -> list[mx.array]:
    """The best `nodes` of the beams' prefixes and the chain's nodes after them (`score`,
    `token`; the beams' `parent`s; `met`: the prefixes the chain met), best first, as the
    tree's arrays: a prefix the chain met gives way to the chain's node (its children move
    under it)."""
    if order.chain_parents.size:
        parent = mx.concatenate([parent, order.chain_parents])
    moved = (parent >= 0) & mx.take_along_axis(met, mx.maximum(parent, 0), axis=0)
    parent = mx.where(moved, order.handed, parent)
    # alive (not met) first, then by score, then shallower, then earlier: a parent comes first
    alive = ~met
    better = (score[None, :] > score[:, None]) | (score[None, :] == score[:, None]) & order.earlier
    before = (alive[None, :] & met[:, None]) | (alive[None, :] == alive[:, None]) & better
    rank = before.astype(mx.int32).sum(axis=1)
    kept = mx.argsort(rank)[:nodes]
    parents = mx.take_along_axis(parent, kept, axis=0)
    parents = mx.where(parents < 0, 0, mx.take_along_axis(rank, mx.maximum(parents, 0), axis=0) + 1)
    chain_rank = rank[order.size :]
    return [
        mx.concatenate([root.astype(mx.int32), mx.take_along_axis(token, kept, axis=0)]),
        mx.concatenate([mx.array([-1], dtype=mx.int32), parents.astype(mx.int32)]),
        mx.concatenate([mx.zeros((1,), mx.int32), mx.take_along_axis(order.depth, kept, axis=0)]),
        mx.concatenate([mx.zeros((1,), mx.float32), mx.take_along_axis(score, kept, axis=0)]),
        mx.where(chain_rank < nodes, chain_rank + 1, -1).astype(mx.int32),
    ]


def ranked_tree(
    root: mx.array,
    scores: mx.array,
    budget: int,
    ids: mx.array | None = None,
    chain: Chain | None = None,
) -> Drafted:
    """The `budget` best prefixes with positions independent given the root: `scores`
    (depth, columns) rank each position's tokens (log-normalised here), column j being token
    `ids[j]` (None: token j). Each position's `budget` best columns are its candidates."""
    tokens, edges = _ranked(scores, ids, min(budget, scores.shape[-1]))
    return search(root, tokens, edges, budget, chain)


@mx.compile
def _ranked(scores: mx.array, ids: mx.array | None, k: int) -> tuple[mx.array, mx.array]:
    """Each row's `k` best columns of `scores`, log-normalised: their tokens (`ids` of the
    columns, or the columns) and log-probabilities (depth, 1, k), one compiled call."""
    rows = scores.astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    top = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    edges = mx.take_along_axis(logprobs, top, axis=-1)[:, None]
    return (top if ids is None else ids[top]), edges


def ancestor_mask(parents: mx.array | list[int]) -> mx.array:
    """(n, n) bool: entry (i, j) is True when node j is node i or one of its ancestors, on
    the device: node and parent squared until paths as long as the tree's are covered."""
    return _ancestors(mx.array(parents))


@mx.compile
def _ancestors(parents: mx.array) -> mx.array:
    """`ancestor_mask`'s graph, one compiled call per tree size."""
    nodes = mx.arange(parents.size)
    reach = (nodes[:, None] == nodes[None, :]) | (parents[:, None] == nodes[None, :])
    for _ in range((parents.size - 1).bit_length()):
        reach = reach.astype(mx.float32)
        reach = (reach @ reach) > 0
    return reach


def walk(tree: Tree, choose: Callable[[int], int]) -> tuple[list[int], int]:
    """(the accepted path's nodes from the root, the target's token after its last node).

    `choose(node)` is the target's token after node's prefix; the walk follows
    the child holding it until there is none.
    """
    children = tree.children()
    path = [0]
    while True:
        token = choose(path[-1])
        child = children[path[-1]].get(token)
        if child is None:
            return path, token
        path.append(child)
