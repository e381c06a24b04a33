"""Choosing each cycle's block size (`AdaptiveBlock`), tree size (`AdaptiveTree`), or
either, chain or tree (`AdaptiveStrategy`, the library's default), by measured cost.

Each is a policy (`plan.py`): `plan()` before a cycle says what it verifies (a `Plan`:
so many draft tokens, as a chain or a tree; 0: a plain step), `record(Cycle)` after it says what
it verified, accepted and cost. `AdaptiveTree` sizes each tree from the drafter's confidence
in the tree before, whose probabilities come back with that cycle's verdict.

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
  The load moves every size's cost, and a size is timed only when it is played:
  a time above `SPIKE` times the average counts as that much; a plain step's
  average fades with the cycles since plain steps were last timed (`AGING`), so
  a probe down to them counts mostly in full; and a plain step is not costed
  above a drafted cycle. Else one busy moment during plain steps leaves them
  costed dear while drafting, measured later, looks cheap, and the policy drafts
  at a loss.

When sampling, which random draws a cycle consumes depends on its size, so a
seeded run is reproducible only if the sizes do not depend on timing. There the
policy costs the sizes from a fixed table for the backend (`models/cycle_costs.py`,
measured once and written down) instead of the clock: its choices follow the
acceptance alone, and the same seed gives the same reply.

A policy is worth keeping across generations of the same target and drafter
(`stream_generate(block_policy=...)`, or a `PromptCache`, carries it): the
costs and acceptance it learned hold for the next reply too, so it does not
spend each reply's first cycles relearning them.

Where it settles on each machine is measured in benchmarks/README.md ("Block size chosen
by measured cost"). The block size never changes the output.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TypeVar

from ..models.cycle_costs import interpolated_cost


@dataclass(frozen=True)
class Plan:
    """The next cycle: `drafts` draft tokens (0: a plain step), as a chain or as a tree of up
    to that many nodes. A tree may be searched larger (`searched` nodes) than it is verified
    (its first `drafts`): the probabilities of all its nodes come back with the verdict, for
    the policy to size the next tree from, in the cycle's one read of the device."""

    drafts: int
    tree: bool = False
    searched: int = 0  # a tree's nodes searched, where more than `drafts`


@dataclass
class Cycle:
    """A finished cycle, as a size policy learns from it: draft tokens verified, accepted
    (the leading ones of a chain; a tree's accepted path), wall time, and for a tree the
    drafter's path probabilities of the nodes it searched, best first (the first `proposed`
    of them verified), and the accepted path's nodes. A cycle several replies shared is
    recorded once per row it planned: the first row with the cycle's time, the others with
    None (their acceptance alone, the cycle counted and costed once)."""

    proposed: int
    accepted: int
    seconds: float | None
    probabilities: list[float] | None = None
    path: list[int] | None = None  # a tree's accepted path: node indices from the root


# What one more verified position of one row adds to a shared cycle's cost, as a share of
# the cost of the smallest size measured there: the prior of a size not measured yet in cycles
# of several rows (a reply's own cycles interpolate between measured sizes instead). This CPU:
# 0.04-0.06 (benchmarks/README.md, "What a shared forward costs"); where positions are nearly
# free (a GPU), measuring a larger size replaces the prior.
SHARED_POSITION_SHARE = 0.05


def block_ladder(max_block: int) -> list[int]:
    """Candidate block sizes: every size up to 6, then coarser steps, and `max_block`."""
    steps = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64]
    return sorted({n for n in steps if n < max_block} | {max_block})


def shared_cost(seconds: dict[int, float], n: int, rows: int) -> float | None:
    """The cost of size n in cycles of `rows` rows, from the sizes measured there: as
    `interpolated_cost`, but with several rows a size above the largest measured is not
    taken for as cheap as it (each position is verified for every row): the costs are
    extended along the slope between the two largest drafted sizes measured, or, before
    there are two, `SHARED_POSITION_SHARE` of the smallest's cost per position."""
    cost = interpolated_cost(seconds, n)
    if n == 1:  # a plain step never costs more than a cycle that drafted, whatever busier
        cost = min([cost, *(c for m, c in seconds.items() if m > 1)])  # moment it was timed in
    if rows == 1 or not seconds or n <= max(seconds):
        return cost
    largest = max(seconds)
    drafted = sorted(m for m in seconds if m > 1)
    if len(drafted) >= 2:
        a, b = drafted[-2:]
        slope = max((seconds[b] - seconds[a]) / (b - a), 0.0)
    else:
        slope = SHARED_POSITION_SHARE * rows * seconds[min(seconds)]
    return seconds[largest] + slope * (n - largest)


P = TypeVar("P", "AdaptiveBlock", "AdaptiveTree", "AdaptiveStrategy")


def for_rows(policy: P, rows: int) -> P:
    """A copy of `policy` for cycles of `rows` rows (a batch's shared cycles): what it learned
    of acceptance holds there. What a reply's own cycles cost does not (each position costs
    more the more rows share it), so a timed policy copied from one measures the costs anew,
    from its smallest plan up; a nearby width's costs are a fair start, measured again as
    cycles come."""
    copied = copy.deepcopy(policy)
    if copied.rows == 1 and rows > 1 and copied.timed:
        copied.seconds = {False: {}, True: {}} if isinstance(copied, AdaptiveStrategy) else {}
    copied.rows = rows
    return copied


# A cycle timed above this many times its size's running average counts as this many: a moment
# of contention (another process, a busy core) is not the size's cost, and a plain step costed
# dear after one keeps the policy drafting at a loss until plain steps are measured again.
SPIKE = 2.0
# What a plain step's running average keeps of its weight per cycle between plain steps: the
# load moves every size's cost, so plain steps timed again after many cycles take mostly their
# new time. (Drafted sizes age by being played: one costed too cheap is played and re-timed.)
AGING = 0.9


def running_average(
    seconds: dict[int, float],
    n: int,
    value: float,
    smoothing: float,
    idle: int = 0,
) -> None:
    """Fold one cycle's wall time into size n's running average, `idle` cycles after it was
    last timed (it fades by `AGING` per idle cycle); a time is capped at `SPIKE` times the
    average."""
    old = seconds.get(n)
    if old is None:
        seconds[n] = value
        return
    keep = (1 - smoothing) * AGING**idle
    seconds[n] = keep * old + (1 - keep) * min(value, SPIKE * old)


def plain_idle(policy: AdaptiveBlock | AdaptiveStrategy, plain: bool) -> int:
    """Cycles since `policy` last timed a plain step, for one just timed (`plain`; 0 for any
    other, and in shared cycles, whose costs move with the batch's width as well)."""
    if not plain or policy.rows > 1:
        return 0
    idle = policy.cycles - policy.plain_timed - 1
    policy.plain_timed = policy.cycles
    return max(idle, 0)


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
    fixed_costs: dict[int, float] | None = None  # costs by size instead of timings (sampling)
    rows: int = 1  # the rows of the cycles it plans (several: a batch's shared cycles)
    sizes: list[int] = field(init=False)
    tried: list[float] = field(init=False)
    accepted: list[float] = field(init=False)
    seconds: dict[int, float] = field(default_factory=dict)
    plain_timed: int = 0  # the cycle a plain step was last timed
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
        if self.fixed_costs is not None:
            self.seconds = {n: interpolated_cost(self.fixed_costs, n) for n in self.sizes}

    @property
    def timed(self) -> bool:
        """Whether the sizes are costed by the clock (greedy) or by a fixed table (sampling)."""
        return self.fixed_costs is None

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
        return shared_cost(self.seconds, n, self.rows)

    def best(self) -> int:
        rates = self.acceptance_rates()
        return max(self.sizes, key=lambda n: self.expected_tokens(n, rates) / self.cost(n))

    @property
    def setting(self) -> tuple[str, int]:
        """What it was made for: ("block size", n)."""
        return "block size", self.block_size

    def plan(self) -> Plan:
        """The next cycle's chain: its draft tokens (0: a plain step)."""
        return Plan(self.next_block_size() - 1)

    def next_block_size(self) -> int:
        if not self.seconds:  # nothing measured yet: draft as configured, or plainly first
            return self.block_size if self.rows == 1 else 1  # when each position costs more
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

    def drop_trees(self) -> bool:
        """It plans chains alone: nothing to drop."""
        return False

    def record(self, cycle: Cycle) -> None:
        """One finished chain cycle."""
        block_size, committed = cycle.proposed + 1, cycle.accepted + 1
        if cycle.seconds is not None:
            self.cycles += 1
            if self.timed:
                idle = plain_idle(self, block_size == 1)
                running_average(self.seconds, block_size, cycle.seconds, self.smoothing, idle)
        if block_size > 1:  # plain steps say nothing about the drafter: keep its counts
            self.tried = [t * self.decay for t in self.tried]
            self.accepted = [a * self.decay for a in self.accepted]
        for k in range(min(committed, block_size - 1)):  # drafts reached: accepted ones + 1
            self.tried[k] += 1
            self.accepted[k] += k < committed - 1


@dataclass
class AdaptiveTree:
    """Each tree cycle's size from the drafter's confidence in the tree before it.

    Best-first (`tree.search`), a tree's nodes come in non-increasing path
    probability p_1 ≥ p_2 ≥ … under the drafter, and a node is accepted iff its
    whole path is the target's own choice, so a calibrated drafter's tree of the
    first b nodes would commit E(b) = 1 + s Σ_{i≤b} p_i tokens with s = 1. A
    drafter need not be calibrated: s is the decayed ratio of the drafts accepted
    to those predicted (the verified nodes' p_i) over past trees.
    With c(b) the running average wall time of cycles verifying b + 1 positions
    (interpolated as `AdaptiveBlock` does while unmeasured), the cycle verifies
    the b ≤ `max_budget` on `block_ladder` that maximises E(b) / c(b); b = 0
    verifies the root alone, a plain step.

    The p_i are the last drafted tree's. A graph's shapes must be known on the host
    when it is built, so a tree sized from its own probabilities would read them
    before its verify: a second read of the device per cycle. Instead each drafted
    cycle searches the largest tree, verifies its first b nodes, b chosen before the
    cycle from the tree before it (the drafter's confidence runs in stretches of the
    text), and the whole tree's probabilities come back with the verdict, in the
    cycle's one read. With no tree seen yet a cycle verifies the largest tree (in
    cycles of several rows, where each position costs more, one node); rows that
    share a cycle and this policy share its b, from their trees' mean p_i.

    A plain step after the drafter's forward has paid for a forward it did not
    use, so once the root alone is best the next cycles skip the drafter: plain
    steps for `probe_gap` cycles, doubling (up to `max_probe_gap`) while it stays
    best. The drafted cycle after them is a probe: it verifies the best tree of
    at least one node, whatever E(b) says, so that s follows a drafter that
    starts to help. The size never changes the output.
    """

    max_budget: int  # the largest tree (draft tokens)
    decay: float = 0.9  # weight kept by older calibration counts at each tree
    smoothing: float = 0.3  # weight of the newest cycle in the running cost averages
    min_probe_gap: int = 2
    max_probe_gap: int = 8
    accepted: float = 1.0  # decayed drafts accepted and predicted: a prior s = 1
    predicted: float = 1.0
    seconds: dict[int, float] = field(default_factory=dict)  # by verified positions, b + 1
    rows: int = 1  # the rows of the cycles it plans (several: a batch's shared cycles)
    timed = True  # costed by the clock
    sizes: list[int] = field(init=False)
    seen: list[list[float]] = field(default_factory=list)  # the last drafted trees' p_i, by row
    probe_gap: int = 0
    skipping: int = 0  # plain steps left before the next drafted cycle
    drafting: bool = True  # whether the current cycle drafts
    probing: bool = False  # whether it is the drafted cycle after plain steps

    def __post_init__(self) -> None:
        self.sizes = block_ladder(self.max_budget + 1)
        self.probe_gap = self.min_probe_gap

    @property
    def setting(self) -> tuple[str, int]:
        """What it was made for: ("tree budget", n)."""
        return "tree budget", self.max_budget

    def plan(self) -> Plan:
        """The next cycle's tree: the largest searched and its first b nodes verified (none:
        the root alone), or a plain step."""
        if not self.draft_next():
            return Plan(0, True)
        return Plan(self.budget(mean_probabilities(self.seen)), True, self.max_budget)

    def draft_next(self) -> bool:
        """Whether the next cycle drafts (else it is a plain step)."""
        self.probing = self.skipping == 0 and not self.drafting
        self.drafting = self.skipping == 0
        self.skipping = max(self.skipping - 1, 0)
        return self.drafting

    def expected_tokens(self, probabilities: list[float]) -> list[float]:
        """E(b) for b = 0 .. len(probabilities): tokens the first b nodes commit on average."""
        scale, total, out = self.accepted / self.predicted, 1.0, [1.0]
        for p in probabilities:
            total += scale * p
            out.append(total)
        return out

    def budget(self, probabilities: list[float]) -> int:
        """The drafted cycle's tree size, after a tree of nodes of these path probabilities,
        best first."""
        if not (self.seconds and probabilities):  # nothing measured or seen yet: the largest
            return self.max_budget if self.rows == 1 else min(self.max_budget, 1)  # or smallest
        expected = self.expected_tokens(probabilities)
        sizes = [n for n in self.sizes if n <= len(expected)]
        rate = {n: expected[n - 1] / shared_cost(self.seconds, n, self.rows) for n in sizes}
        best = max(sizes, key=rate.__getitem__)
        if best > 1:
            self.probe_gap = self.min_probe_gap
        else:
            self.skipping = self.probe_gap
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
            if self.probing and len(sizes) > 1:
                best = max(sizes[1:], key=rate.__getitem__)
        return best - 1

    def drop_trees(self) -> bool:
        """It plans trees alone: a refused tree is the settings' error."""
        return False

    def record(self, cycle: Cycle) -> None:
        """One finished tree cycle: its verified nodes calibrate s, all it searched size the
        next tree."""
        if not self.drafting:
            return  # a plain step: the drafted cycles' costs are what the choice compares
        probabilities = cycle.probabilities or []
        if probabilities:  # a cycle's first row (timed) replaces the trees seen; others add
            self.seen = [*(self.seen if cycle.seconds is None else []), probabilities]
        if probabilities and cycle.proposed:  # only a verified tree tells the calibration
            self.accepted = self.decay * self.accepted + cycle.accepted
            self.predicted = self.decay * self.predicted + sum(probabilities[: cycle.proposed])
        if cycle.seconds is not None:
            running_average(self.seconds, cycle.proposed + 1, cycle.seconds, self.smoothing)


def mean_probabilities(trees: list[list[float]]) -> list[float]:
    """Node by node, the mean path probability of several rows' trees (0 past a tree's end)."""
    nodes = max(map(len, trees), default=0)
    return [sum(tree[i] for tree in trees if i < len(tree)) / len(trees) for i in range(nodes)]


@dataclass
class AdaptiveStrategy:
    """Each cycle a chain or a tree, whichever is expected to commit the most tokens per second.

    The arms are chains of every block size on `block_ladder(block_size)` (1: a plain step)
    and trees of every budget on `block_ladder(tree_budget)` from 2 up; the next cycle plays
    the one with the largest E / c. E is the decayed mean of the tokens the arm committed,
    and one cycle measures every smaller arm of its kind too: a chain's first n - 1 drafts
    are the chain of block n, and a tree is built best first, so its first b nodes are the
    tree of budget b and the path the target accepted tells what that tree would have
    committed. c is the running average wall time of the kind's cycles of as many positions
    (interpolated as `AdaptiveBlock`'s); a tree costs at least the chain of as many positions
    (the same forward, and its top-k and build on the host besides). The first cycles
    alternate the largest tree and the full chain, `explore` of each, or `explore_blind` where
    those accepted no draft (a drafter the text defeats costs little to give up); then
    probes come as `AdaptiveBlock`'s do, every other one the largest arm of the other kind
    (so its acceptance follows the text), between them the next larger or smaller arm of
    the best's. While a plain step is best, the probes are the cheapest drafting arm of each
    kind in turn, and one that accepts a draft is followed by its kind's largest arm (which
    measures all of the kind's arms at once): a drafter that does not pay costs a small share
    of the plain steps, one that starts to help is drafted with again within a few probes.

    Where it settles is measured in benchmarks/README.md ("Chains or trees chosen per
    cycle"). When sampling (`fixed_costs`: chain costs by block size, tree costs
    by positions) the choice follows the acceptance alone, so a seeded run is reproducible.
    Neither kind changes the output.
    """

    block_size: int  # the longest chain
    tree_budget: int = 16  # the largest tree (0: chains only)
    decay: float = 0.98  # weight kept by older counts at each cycle
    smoothing: float = 0.3  # weight of the newest cycle in the running cost averages
    min_probe_gap: int = 8
    max_probe_gap: int = 64
    plain_probe_gap: int = 16  # the longest gap between probes while a plain step is best
    explore: int = 4  # first cycles: the full chain and the largest tree, this many each
    explore_blind: int = 2  # of which this many where none of them accepted a draft
    stale: float = 1.0  # the other kind's weight below which its largest arm is played again
    fixed_costs: tuple[dict[int, float], dict[int, float]] | None = None
    rows: int = 1  # the rows of the cycles it plans (several: a batch's shared cycles)
    tokens: dict[Plan, float] = field(default_factory=dict)  # decayed sums by arm
    weight: dict[Plan, float] = field(default_factory=dict)
    seconds: dict[bool, dict[int, float]] = field(default_factory=dict)  # by kind, positions
    plain_timed: int = 0  # the cycle a plain step was last timed
    cycles: int = 0
    probes: int = 0
    probe_gap: int = 0
    next_probe: int = 0
    last_best: Plan | None = None
    plain_probe: bool = False  # whether the cycle planned last is a probe from plain steps
    regrow: bool | None = None  # the kind whose largest arm a probe that paid asks for next

    def __post_init__(self) -> None:
        self.probe_gap = self.next_probe = self.min_probe_gap
        self.seconds = {False: {}, True: {}}
        if self.fixed_costs is not None:
            for kind, costs in zip((False, True), self.fixed_costs):
                self.seconds[kind] = {n: interpolated_cost(costs, n) for n in block_ladder(64)}

    @property
    def timed(self) -> bool:
        """Whether the arms are costed by the clock (greedy) or by fixed tables (sampling)."""
        return self.fixed_costs is None

    @property
    def setting(self) -> tuple[str, int]:
        """What it was made for: ("chains and trees up to block size", n)."""
        return "chains and trees up to block size", self.block_size

    def arms(self, tree: bool | None = None) -> list[Plan]:
        """Every arm (of one kind: chains, tree=False, or trees)."""
        chains = [Plan(n - 1) for n in block_ladder(self.block_size)]
        budgets = block_ladder(self.tree_budget) if self.tree_budget > 1 else []
        trees = [Plan(b, True) for b in budgets if b > 1]
        return {None: chains + trees, False: chains, True: trees}[tree]

    def expected_tokens(self, plan: Plan) -> float:
        """E: tokens a cycle of this plan commits on average (the bonus token included), as
        measured for it or for the largest smaller arm of its kind (1 where none was)."""
        measured = [
            p for p in self.arms(plan.tree) if p.drafts <= plan.drafts and self.weight.get(p)
        ]
        if not measured:
            return 1.0
        return self.tokens[measured[-1]] / self.weight[measured[-1]]

    def cost(self, plan: Plan) -> float:
        """c in seconds (or steps, with fixed costs)."""
        chain = shared_cost(self.seconds[False], plan.drafts + 1, self.rows)
        if plan.tree and self.seconds[True]:
            return max(shared_cost(self.seconds[True], plan.drafts + 1, self.rows), chain)
        return chain

    def rate(self, plan: Plan) -> float:
        """E / c: tokens a cycle of this plan is expected to commit per second."""
        return self.expected_tokens(plan) / self.cost(plan)

    def best(self) -> Plan:
        return max(self.arms(), key=self.rate)

    def plan(self) -> Plan:
        """What the next cycle verifies. A reply's own cycles first explore the largest arms
        of each kind; shared cycles (`rows` > 1), where each position costs more, start
        from a plain cycle and grow from the smallest arms."""
        chains, trees = self.arms(False), self.arms(True)
        self.plain_probe = False
        if self.regrow is not None:  # a probe from plain steps paid: measure all its kind's arms
            kind, self.regrow = self.arms(self.regrow), None
            return kind[-1] if self.rows == 1 else max(kind, key=self.rate)
        if self.rows > 1:
            if not self.seconds[False]:
                return chains[0]
        elif (
            self.cycles < 2 * self.explore
            and trees
            and (self.cycles < 2 * self.explore_blind or self.accepted_any)
        ):
            return (trees, chains)[self.cycles % 2][-1]
        if not self.seconds[False]:
            return chains[-1]
        best = self.best()
        plain = best == Plan(0)
        other = chains if best.tree else trees
        drafting = [p for p in other if p.drafts]
        if drafting and not plain and self.weight.get(drafting[0], 0.0) < self.stale:
            # what is known of the other kind is old: measure it again, all its arms at once
            # with its largest (shared cycles: its arm expected to pay most, the largest
            # being the dearest there)
            return drafting[-1] if self.rows == 1 else max(drafting, key=self.rate)
        if best != self.last_best:
            self.last_best, self.probe_gap = best, self.min_probe_gap
        if self.cycles < self.next_probe:
            return best
        self.next_probe = self.cycles + self.probe_gap
        longest = self.plain_probe_gap if plain else self.max_probe_gap
        self.probe_gap = min(2 * self.probe_gap, longest)
        self.probes += 1
        if plain:  # the smallest arm of both kinds: probe the cheapest drafting arm of each
            self.plain_probe = True
            cheapest = [chains[1], *trees[:1]]
            return cheapest[self.probes % len(cheapest)]
        same = self.arms(best.tree)
        i = same.index(best)
        up = (self.probes % 2 or i == 0) and i < len(same) - 1
        return same[i + 1 if up else max(i - 1, 0)]

    @property
    def accepted_any(self) -> bool:
        """Whether any cycle it learned from accepted a draft (else exploring the largest arms
        further costs cycles that a plain step does in less time)."""
        return any(self.tokens[p] > self.weight[p] for p in self.tokens if p.drafts)

    @property
    def trees_measured(self) -> bool:
        """Whether it has learned from a verified tree."""
        return any(w for p, w in self.weight.items() if p.tree)

    def drop_trees(self) -> bool:
        """Plan chains only from now on, where the target refused a tree forward before any
        verified (else whatever failed was not the refusal: False)."""
        if self.trees_measured:
            return False
        self.tree_budget = 0
        return True

    def record(self, cycle: Cycle) -> None:
        """One finished cycle: a chain, or a tree (with its accepted path)."""
        self.cycles += cycle.seconds is not None
        tree = cycle.path is not None
        if self.plain_probe and cycle.accepted:
            self.regrow = tree
        if tree and not cycle.proposed:
            return  # the root alone (a reply's last token): nothing learned
        if self.timed and cycle.seconds is not None:
            idle = plain_idle(self, not tree and not cycle.proposed)
            running_average(
                self.seconds[tree], cycle.proposed + 1, cycle.seconds, self.smoothing, idle
            )
        for plan in self.arms():
            self.tokens[plan] = self.decay * self.tokens.get(plan, 0.0)
            self.weight[plan] = self.decay * self.weight.get(plan, 0.0)
            if plan.tree == tree and 0 < plan.drafts <= cycle.proposed:
                if tree:  # the path's nodes come in increasing order
                    accepted = sum(node <= plan.drafts for node in cycle.path[1:])
                else:
                    accepted = min(cycle.accepted, plan.drafts)
                self.tokens[plan] += 1 + accepted
                self.weight[plan] += 1
