"""Draft trees (DDTree): many candidate continuations verified in one target forward.

The drafter's block gives a distribution q_t for every position t after the
last committed token (the root). Treating the positions as independent given
the root, a prefix x_1..x_d scores sum_t log q_t(x_t); the tree is the `budget`
best prefixes. Scores only fall along a path, so those prefixes form a tree,
and a best-first search over sorted candidates finds them in O(budget log
budget): a node's successors in the search are its first child (the top token
at the next position) and its next sibling (the next token at its own
position). A DFlash 2 drafter's selector scores a token given the one before
it: there q_t(x_t | x_{t-1}) over its top-K candidates, and the same search
reads each node's children from its own row (`build_selector_tree`).

The target then runs once over all nodes: each node sees the committed context
and its ancestors (`ancestor_mask`) at the position of its depth. Walking the
target's own choices down from the root gives the longest accepted path.
Past `top_candidates` or `ranked_edges` (one read from the device), everything
here is host-side arithmetic on small lists; the cycle (`decode/cycle.py`) does the forwards.
"""

from __future__ import annotations

import heapq
import itertools
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
    under the drafter (summed along the path; the root's is 0). `build_tree`
    adds nodes best first, so the first b + 1 nodes are the tree of budget b.
    """

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    logprobs: list[float] = field(default_factory=lambda: [0.0])

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
        return Tree(
            self.tokens[:count], self.parents[:count], self.depths[:count], self.logprobs[:count]
        )

    def children(self) -> list[dict[int, int]]:
        """For each node: token -> child node."""
        table: list[dict[int, int]] = [{} for _ in self.tokens]
        for node in range(1, len(self.tokens)):
            table[self.parents[node]][self.tokens[node]] = node
        return table


def top_candidates(
    logits: mx.array, k: int, token_ids: list[int] | None = None
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's k most likely tokens and their log-probabilities, best first.

    On the CPU: one read, then numpy, cheaper than MLX's CPU argpartition and exp
    over a full vocabulary (benchmarks/README.md, "Why the host cannot run ahead on
    MLX's CPU backend"). On a GPU the k best columns and the rows' normalisers are
    found on the device and only they are read: numpy over a large vocabulary's
    full rows cost about what a GPU tree cycle spent beyond its forward
    (benchmarks/README.md, "Verify forward on an H100"). `token_ids[j]` names
    column j when the logits cover a draft vocabulary only (`RestrictedHead.rows`).
    """
    k = min(k, logits.shape[-1])
    if mx.default_device() == mx.cpu:
        rows = np.array(logits.astype(mx.float32), dtype=np.float64)
        top = np.argpartition(-rows, k - 1, axis=-1)[:, :k]
        scores = np.take_along_axis(rows, top, axis=-1)
        peak = rows.max(axis=-1, keepdims=True)
        normalizer = peak + np.log(np.exp(rows - peak).sum(axis=-1, keepdims=True))
    else:
        top, scores, normalizer = _device_top_k(logits, k)
    order = np.argsort(-scores, axis=-1, kind="stable")
    top, scores = (np.take_along_axis(a, order, axis=-1) for a in (top, scores))
    logprobs = scores - normalizer
    tokens = top if token_ids is None else np.asarray(token_ids)[top]
    return tokens.tolist(), logprobs.tolist()


def _device_top_k(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(column indices (rows, k) of each row's k largest logits, unordered; their logits;
    each row's log-normaliser (rows, 1)), computed where the logits are; one small read."""
    rows = logits.astype(mx.float32)
    top = mx.argpartition(-rows, k - 1, axis=-1)[:, :k]
    scores = mx.take_along_axis(rows, top, axis=-1)
    normalizer = mx.logsumexp(rows, axis=-1, keepdims=True)
    top, scores, normalizer = read_together([top, scores, normalizer], mx.float32)
    return top.astype(np.int64), scores.astype(np.float64), normalizer.astype(np.float64)


def read_together(arrays: list[mx.array], dtype: mx.Dtype) -> list[np.ndarray]:
    """`arrays` as numpy arrays of their own shapes, cast to `dtype`, in one read from the
    device. Token ids and ranks stay exact in float32 (below 2^24) and in int32."""
    flat = np.array(mx.concatenate([a.astype(dtype).reshape(-1) for a in arrays]))
    parts = np.split(flat, np.cumsum([a.size for a in arrays])[:-1])
    return [part.reshape(a.shape) for part, a in zip(parts, arrays)]


def ranked_edges(
    candidates: mx.array, edge_logprobs: mx.array
) -> tuple[list[list[int]], list[list[list[int]]], list[list[list[float]]]]:
    """DFlash 2's candidates (T, K) and, after each candidate i at position t - 1, the
    indices of position t's candidates and their log-probabilities, best first (one read).

    `edge_logprobs[t, i, j]`: candidate j at position t after candidate i at t - 1
    (`CandidateSelector.edge_logprobs`; at t = 0 every row is the anchor's).
    """
    order = mx.argsort(-edge_logprobs, axis=-1)
    ranked = mx.take_along_axis(edge_logprobs, order, axis=-1)
    ids, ranks, logprobs = read_together([candidates, order, ranked], mx.float32)
    return ids.astype(np.int64).tolist(), ranks.astype(np.int64).tolist(), logprobs.tolist()


def search_tree(
    root: int,
    tokens: list[list[int]],
    ranked: Callable[[int, int], tuple[Sequence[int], list[float]]],
    budget: int,
) -> Tree:
    """The tree of the `budget` highest-scoring prefixes (plus the root), best first.

    `tokens[t][c]` is candidate c for position t + 1 after the root. `ranked(t, c)`
    gives the candidates for position t + 1 after a node holding candidate c at
    position t (the root: c = 0) and their log-probabilities, best first: a node's
    successors in the search are its best child and its next sibling. Candidates
    of probability 0 (-inf, e.g. outside a draft vocabulary) never enter the tree.
    """
    tree = Tree([root], [-1], [0])
    slots = [0]  # each node's candidate index at its position
    heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, parent, position, rank)
    order = itertools.count()  # ties go to the earlier candidate

    def push(parent: int, position: int, rank: int) -> None:
        if position < len(tokens):
            logprobs = ranked(position, slots[parent])[1]
            score = tree.logprobs[parent] + logprobs[rank] if rank < len(logprobs) else -math.inf
            if score > -math.inf:
                heapq.heappush(heap, (-score, next(order), parent, position, rank))

    push(0, 0, 0)
    while heap and len(tree) <= budget:
        negative, _, parent, position, rank = heapq.heappop(heap)
        slot = ranked(position, slots[parent])[0][rank]
        tree.tokens.append(tokens[position][slot])
        tree.parents.append(parent)
        tree.depths.append(position + 1)
        slots.append(slot)
        tree.logprobs.append(-negative)
        push(parent, position, rank + 1)
        push(len(tree) - 1, position + 1, 0)
    return tree


def build_tree(
    root: int, top_tokens: list[list[int]], top_logprobs: list[list[float]], budget: int
) -> Tree:
    """The `budget` best prefixes with positions independent given the root.

    `top_tokens[t]` / `top_logprobs[t]`: the drafter's candidates for position
    t + 1 after the root, best first (`top_candidates`).
    """
    ranks = [range(len(row)) for row in top_tokens]
    return search_tree(root, top_tokens, lambda t, _: (ranks[t], top_logprobs[t]), budget)


def build_selector_tree(
    root: int,
    candidates: list[list[int]],
    successors: list[list[list[int]]],
    logprobs: list[list[list[float]]],
    budget: int,
) -> Tree:
    """The `budget` best prefixes under DFlash 2's selector (`ranked_edges`' lists): a
    token's log-probability is the selector's given the token before it, as its walk
    would draw it, so the tree branches where the walk is unsure."""
    return search_tree(root, candidates, lambda t, c: (successors[t][c], logprobs[t][c]), budget)


def graft(
    tree: Tree, chain: list[int], logprobs: list[float], budget: int
) -> tuple[Tree, list[int]]:
    """The tree with `chain` added as a path from the root, cut to its `budget` best nodes.

    `chain` holds tokens for positions 1, 2, ... after the root, `logprobs` each one's
    log-probability given the one before (`lookup.ContextLookup.proposal`). Where the chain
    meets a node of the tree, that node keeps the better score and the chain goes on below
    it. Scores still fall along every path, so the best nodes, best first, are a tree again.
    Also returns each chain token's node in the new tree (-1 where the cut dropped it).
    """
    tokens, parents, depths = list(tree.tokens), list(tree.parents), list(tree.depths)
    scores, children = list(tree.logprobs), tree.children()
    nodes, node = [], 0
    for token, logprob in zip(chain, logprobs):
        score, child = scores[node] + logprob, children[node].get(token)
        if child is None:
            child = len(tokens)
            children[node][token] = child
            children.append({})
            tokens.append(token)
            parents.append(node)
            depths.append(depths[node] + 1)
            scores.append(score)
        else:
            scores[child] = max(scores[child], score)
        nodes.append(child)
        node = child
    best = sorted(range(1, len(tokens)), key=lambda n: (-scores[n], depths[n], n))[:budget]
    order = [0, *best]
    new = {old: index for index, old in enumerate(order)}
    grafted = Tree(
        [tokens[n] for n in order],
        [new[parents[n]] if n else -1 for n in order],
        [depths[n] for n in order],
        [scores[n] for n in order],
    )
    return grafted, [new.get(n, -1) for n in nodes]


def ancestor_mask(parents: list[int]) -> mx.array:
    """(n, n) bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    rows: list[list[bool]] = []
    for node, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [False] * len(parents)
        row[node] = True
        rows.append(row)
    return mx.array(rows)


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
