"""Choosing each cycle's block size by measured cost.

A cycle of block size n (the last token plus n - 1 drafts) commits on average
E(n) = 1 + Σ_{j<n} a_1 ⋯ a_j tokens, where a_k is the rate at which draft k is
accepted once the drafts before it were, and costs c(n) seconds. The policy
picks the n that maximises E(n) / c(n); n = 1 is plain decoding. Both sides are
measured as the loop runs:

- a_k from counts of tried and accepted drafts at each position, decayed so the
  estimate follows the text (code drafts well, prose badly). A position with
  few observations leans on the rate of the position before it: acceptance
  rarely rises along a block.
- c(n) as a running average of the wall time of cycles of size n. A size not
  tried yet is costed by interpolating between the nearest measured sizes
  (proportionally below the smallest), which is optimistic enough that a size
  that could win gets tried once; after that its own measurements decide.
  Now and then a neighbour of the best size is re-measured, so the costs follow
  the context (attention grows with it) and the machine's load; the gap between
  such probes doubles (up to `max_probe_gap` cycles) while the best size holds.
  While plain decoding is best the gap stays short (`plain_probe_gap`): plain
  steps say nothing about the drafter, so only probes notice that the text
  turned to something it drafts well.

A policy is worth keeping across generations of the same target and drafter
(`stream_generate(block_policy=...)`, or a `PromptCache`, carries it): the
costs and acceptance it learned hold for the next reply too, so it does not
spend each reply's first cycles relearning them.

On a CPU, where verifying 16 positions costs twice a decoding step, this settles
on 2–4; on a GPU with a strong drafter it keeps the full block. The block size
never changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def block_ladder(max_block: int) -> list[int]:
    """Candidate block sizes: every size up to 6, then coarser steps, and `max_block`."""
    steps = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64]
    return sorted({n for n in steps if n < max_block} | {max_block})


@dataclass
class AdaptiveBlock:
    block_size: int  # the largest block the drafter proposes
    decay: float = 0.95  # weight kept by older acceptance counts at each cycle
    smoothing: float = 0.3  # weight of the newest cycle in the running cost averages
    prior_weight: float = 2.0  # pseudo-observations pulling a_k towards a_{k-1}
    first_rate: float = 0.5  # prior acceptance of the first draft
    min_probe_gap: int = 8
    max_probe_gap: int = 64
    plain_probe_gap: int = 16  # the longest gap between probes while block 1 is best
    sizes: list[int] = field(init=False)
    tried: list[float] = field(init=False)
    accepted: list[float] = field(init=False)
    seconds: dict[int, float] = field(default_factory=dict)
    cycles: int = 0
    probes: int = 0
    probe_gap: int = 0
    next_probe: int = 0
    last_best: int = 0

    def __post_init__(self) -> None:
        self.sizes = block_ladder(self.block_size)
        self.tried = [0.0] * (self.block_size - 1)
        self.accepted = [0.0] * (self.block_size - 1)
        self.probe_gap = self.next_probe = self.min_probe_gap

    def acceptance_rates(self) -> list[float]:
        """a_1 .. a_{block_size - 1}: estimated acceptance of each draft given the ones before."""
        rates, previous = [], self.first_rate
        for tried, accepted in zip(self.tried, self.accepted):
            previous = (accepted + self.prior_weight * previous) / (tried + self.prior_weight)
            rates.append(previous)
        return rates

    def expected_tokens(self, n: int, rates: list[float] | None = None) -> float:
        """E(n): tokens a cycle of block size n commits on average (the bonus token included)."""
        total, run = 1.0, 1.0
        for rate in (rates or self.acceptance_rates())[: n - 1]:
            run *= rate
            total += run
        return total

    def cost(self, n: int) -> float | None:
        """c(n) in seconds: measured, or interpolated from the nearest measured sizes."""
        if n in self.seconds:
            return self.seconds[n]
        below = max((m for m in self.seconds if m < n), default=None)
        above = min((m for m in self.seconds if m > n), default=None)
        if below is None and above is None:
            return None
        if above is None:
            return self.seconds[below]
        if below is None:
            return self.seconds[above] * n / above
        share = (n - below) / (above - below)
        return (1 - share) * self.seconds[below] + share * self.seconds[above]

    def best(self) -> int:
        rates = self.acceptance_rates()
        return max(self.sizes, key=lambda n: self.expected_tokens(n, rates) / self.cost(n))

    def next_block_size(self) -> int:
        if not self.seconds:
            return self.block_size  # nothing measured yet: draft as configured
        best = self.best()
        if best != self.last_best:
            self.last_best, self.probe_gap = best, self.min_probe_gap
        if self.cycles < self.next_probe:
            return best
        self.next_probe = self.cycles + self.probe_gap
        longest = self.max_probe_gap if best > 1 else self.plain_probe_gap
        self.probe_gap = min(2 * self.probe_gap, longest)
        self.probes += 1
        i = self.sizes.index(best)  # alternately the next larger and the next smaller size
        up = (self.probes % 2 or i == 0) and i < len(self.sizes) - 1
        return self.sizes[i + 1 if up else max(i - 1, 0)]

    def record(self, block_size: int, committed: int, seconds: float) -> None:
        """One finished cycle: its block size, the tokens it committed and its wall time."""
        self.cycles += 1
        if block_size > 1:  # plain steps say nothing about the drafter: keep its counts
            self.tried = [t * self.decay for t in self.tried]
            self.accepted = [a * self.decay for a in self.accepted]
        for k in range(min(committed, block_size - 1)):  # drafts reached: accepted ones + 1
            self.tried[k] += 1
            self.accepted[k] += k < committed - 1
        old = self.seconds.get(block_size)
        self.seconds[block_size] = (
            seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds
        )
