"""Prompt lookup for draft trees: what followed the last tokens where they occurred before.

Text repeats itself: code reuses its identifiers, answers quote the question,
lists repeat their shape. The continuation of the latest earlier occurrence of
the last two tokens (else of the last one) is a chain of candidates that costs no
forward to propose; grafted onto the drafter's tree (`tree.search`), the target
verifies it with the tree's other nodes, so the output never changes. What it buys
is measured in benchmarks/README.md ("Prompt lookup in trees").

Each chain token needs a probability for the tree's best-first order: the share
of such tokens the target accepted so far, counted apart for a chain's first
token and the later ones (accepted only after their predecessor was), from priors
measured with the shipped drafter (`PRIORS`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

PRIORS = (0.42, 0.65)  # a chain's first token accepted, a later one after its predecessor was
PRIOR_WEIGHT = 8.0  # the priors count as this many chain tokens each


class ContextLookup:
    """The tokens so far, indexed so that the latest earlier occurrence of the last one
    (or two) is found in O(1) per token, and the chain tokens' acceptance counts."""

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self._last: dict[int, int] = {}  # token -> its latest position
        self._last_pair: dict[tuple[int, int], int] = {}  # (a, b) -> latest position of b
        self._match = -1  # where the last token stood before, after the same token(s)
        self.accepted = [p * PRIOR_WEIGHT for p in PRIORS]
        self.tried = [PRIOR_WEIGHT, PRIOR_WEIGHT]
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens."""
        for token in tokens:
            position = len(self.tokens)
            pair = (self.tokens[-1], token) if self.tokens else None
            match = self._last_pair.get(pair, -1) if pair else -1
            self._match = match if match >= 0 else self._last.get(token, -1)
            self._last[token] = position
            if pair:
                self._last_pair[pair] = position
            self.tokens.append(token)

    def proposal(self, length: int) -> tuple[list[int], list[float]]:
        """Up to `length` tokens that followed the last token's previous occurrence, and the
        log-probability of each given the one before (its share accepted so far)."""
        if self._match < 0 or length < 1:
            return [], []
        chain = self.tokens[self._match + 1 : self._match + 1 + length]
        first, later = (math.log(a / t) for a, t in zip(self.accepted, self.tried))
        return chain, [first] + [later] * (len(chain) - 1)

    def record(self, nodes: list[int], path: list[int]) -> None:
        """One verified tree: `nodes` are the chain tokens' nodes in it (-1 where its budget
        left them out), `path` the accepted path's nodes."""
        accepted = set(path)
        for index, node in enumerate(nodes):
            if node < 0:
                return
            kind = min(index, 1)
            self.tried[kind] += 1
            if node not in accepted:
                return
            self.accepted[kind] += 1
