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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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

    def probabilities(self) -> Probabilities:
        """Each node's path probability, the root's left out, read only when asked for."""
        return Probabilities(self.logprobs[1:])

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


class Probabilities(Sequence[float]):
    """A drafted tree's path probabilities, best first: their count known on the host, their
    values read from the device when first asked for. A policy that fits each tree to its
    drafter's confidence pays that read before the verify; one that verifies it whole, none."""

    def __init__(self, logprobs: mx.array):
        self.logprobs, self.values = logprobs, None

    def __len__(self) -> int:
        return self.logprobs.size

    def __getitem__(self, index):
        if self.values is None:
            self.values = np.exp(np.array(self.logprobs, dtype=np.float64)).tolist()
        return self.values[index]


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
    """
    known, known_logprobs = chain or ([], [])
    deepest = max(0 if candidates is None else candidates.shape[0], len(known))
    pool: list[list[mx.array]] = [[], [], [], [], []]  # score, token, parent, depth, on chain
    # the beam of the depth before: the root's first
    beam_score = mx.zeros((1,), dtype=mx.float32)
    beam_slot = mx.zeros((1,), dtype=mx.int32)
    beam_index = mx.full((1,), -1, dtype=mx.int32)  # entries in the pool (the root: none)
    beam_chain = mx.array([True])  # whether it holds the chain's prefix
    chain_score, chain_scores, size = mx.array(0.0), [], 0
    for t in range(deepest):
        on_chain = None
        if candidates is not None and t < candidates.shape[0]:
            rows = edges[t, :1] if edges.shape[1] == 1 else edges[t][beam_slot]
            width = rows.shape[1]
            flat = (beam_score[:, None] + rows.astype(mx.float32)).reshape(-1)
            kept = min(budget, flat.size)
            top = mx.argpartition(-flat, kept - 1)[:kept] if kept < flat.size else mx.arange(kept)
            parent = top // width
            beam_slot = (top % width).astype(mx.int32)
            beam_score = flat[top]
            token = candidates[t][beam_slot].astype(mx.int32)
            on_chain = beam_chain[parent] & (token == (known[t] if t < len(known) else -1))
            for part, value in zip(
                pool, (beam_score, token, beam_index[parent], mx.full((kept,), t + 1), on_chain)
            ):
                part.append(value)
            beam_index = (size + mx.arange(kept)).astype(mx.int32)
            beam_chain, size = on_chain, size + kept
        if t < len(known):
            step = chain_score + known_logprobs[t]
            if on_chain is not None:
                step = mx.maximum(step, mx.where(on_chain, beam_score, -mx.inf).max())
            chain_score = step
            chain_scores.append(step)
    return _select(root, pool, size, known, chain_scores, budget, deepest)


def _select(
    root: mx.array,
    pool: list[list[mx.array]],
    size: int,
    chain: list[int],
    chain_scores: list[mx.array],
    budget: int,
    deepest: int,
) -> Drafted:
    """The best `budget` of the beams' `size` prefixes and the chain's, best first: a beam's
    prefix the chain met gives way to the chain's node (its children move under it)."""
    n_chain = len(chain)
    nodes = min(budget, max(size, n_chain))
    if nodes == 0:
        return Drafted.alone(root)
    if n_chain:
        at_chain = mx.arange(n_chain, dtype=mx.int32)
        chain_parent = mx.where(at_chain == 0, -1, size + at_chain - 1)
        chained = [mx.stack(chain_scores), mx.array(chain, dtype=mx.int32), chain_parent]
        chained += [at_chain + 1, mx.zeros((n_chain,), dtype=mx.bool_)]
        pool = [[*part, extra] for part, extra in zip(pool, chained)]
    score, token, parent, depth, met = (mx.concatenate(part) for part in pool)
    moved = (parent >= 0) & met[mx.maximum(parent, 0)]
    parent = mx.where(moved, size + depth - 2, parent)
    # order: alive (not met), then by score, then shallower, then earlier: a parent comes first
    index = mx.arange(score.size)
    alive = ~met
    same = alive[None, :] == alive[:, None]
    better = (score[None, :] > score[:, None]) | (score[None, :] == score[:, None]) & (
        (depth[None, :] < depth[:, None])
        | (depth[None, :] == depth[:, None]) & (index[None, :] < index[:, None])
    )
    before = (alive[None, :] & ~alive[:, None]) | same & better
    rank = before.astype(mx.int32).sum(axis=1)
    order = mx.argsort(rank)[:nodes]
    parents = parent[order]
    parents = mx.where(parents < 0, 0, rank[mx.maximum(parents, 0)] + 1)
    chain_rank = rank[size:]
    return Drafted(
        mx.concatenate([root.astype(mx.int32), token[order]]),
        mx.concatenate([mx.array([-1], dtype=mx.int32), parents.astype(mx.int32)]),
        mx.concatenate([mx.zeros((1,), dtype=mx.int32), depth[order].astype(mx.int32)]),
        mx.concatenate([mx.zeros((1,), dtype=mx.float32), score[order]]),
        mx.where(chain_rank < nodes, chain_rank + 1, -1).astype(mx.int32),
        deepest,
    )


def ranked_tree(
    root: mx.array,
    scores: mx.array,
    budget: int,
    token_ids: list[int] | None = None,
    chain: Chain | None = None,
) -> Drafted:
    """The `budget` best prefixes with positions independent given the root: `scores`
    (depth, columns) rank each position's tokens (log-normalised here), column j being token
    `token_ids[j]` (None: token j). Each position's `budget` best columns are its candidates."""
    rows = scores.astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    k = min(budget, rows.shape[-1])
    top = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
    edges = mx.take_along_axis(logprobs, top, axis=-1)[:, None]
    tokens = top if token_ids is None else mx.array(token_ids)[top]
    return search(root, tokens, edges, budget, chain)


def ancestor_mask(parents: mx.array | list[int]) -> mx.array:
    """(n, n) bool: entry (i, j) is True when node j is node i or one of its ancestors, on
    the device: node and parent squared until paths as long as the tree's are covered."""
    parents = mx.array(parents)
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
