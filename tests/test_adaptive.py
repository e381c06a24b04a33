"""Adaptive drafting: the block size chosen by measured cost settles near the best fixed size
(plain decoding when drafting does not pay, the full block when it is nearly free), a tree's
budget chosen per cycle from the drafter's confidence in the tree before beats every fixed
budget when confidence comes in stretches that tell good cycles from bad ones, and neither ever
changes the output."""

import random
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from helpers import reference_greedy
from test_generate import OracleDraft, run

import dflash_mlx
from dflash_mlx.decode.adaptive import (
    SHARED_POSITION_SHARE,
    AdaptiveBlock,
    AdaptiveStrategy,
    AdaptiveTree,
    Cycle,
    Plan,
    for_rows,
)
from dflash_mlx.decode.plan import learned_policy
from dflash_mlx.decode.scheduler import ByWidth
from dflash_mlx.models.cycle_costs import FIXED_CYCLE_COSTS, FIXED_TREE_COSTS, interpolated_cost


def simulate(policy: AdaptiveBlock, rates: list[float], cost, cycles: int, seed: int = 0):
    """Drive the policy with drafts accepted at position k with probability rates[k] and
    cycles of size n costing cost(n) seconds; return (tokens per second, sizes chosen)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    sizes = []
    for _ in range(cycles):
        n = policy.plan().drafts + 1
        accepted = 0
        while accepted < n - 1 and rng.random() < rates[accepted]:
            accepted += 1
        policy.record(Cycle(n - 1, accepted, cost(n)))
        tokens, seconds = tokens + accepted + 1, seconds + cost(n)
        sizes.append(n)
    return tokens / seconds, sizes


def fixed_rate(rates: list[float], cost, n: int) -> float:
    """Expected tokens per second of a fixed block size n, computed directly."""
    expected, run = 1.0, 1.0
    for rate in rates[: n - 1]:
        run *= rate
        expected += run
    return expected / cost(n)


def cpu_cost(n: int) -> float:  # this CPU: each verified position adds ~7 % of a step
    return 1.0 + 0.07 * (n - 1)


def gpu_cost(n: int) -> float:  # a GPU: more than one position costs a flat premium
    return 1.0 if n == 1 else 1.7


WEAK = [0.39, 0.36, 0.36] + [0.1] * 12  # the shipped SmolLM2 drafter's conditional acceptance
STRONG = [0.9] * 15
NEVER = [0.0] * 15


@pytest.mark.parametrize(
    "rates, cost, best",
    [(WEAK, cpu_cost, {2, 3, 4}), (STRONG, gpu_cost, {16}), (NEVER, cpu_cost, {1})],
    ids=["weak-drafter-cpu", "strong-drafter-gpu", "useless-drafter"],
)
def test_policy_settles_near_the_best_fixed_block_size(rates, cost, best):
    rate, sizes = simulate(AdaptiveBlock(16), rates, cost, cycles=400)
    settled = sizes[-200:]
    assert sum(n in best for n in settled) > 0.85 * len(settled)
    rates_fixed = {n: fixed_rate(rates, cost, n) for n in range(1, 17)}
    assert rate >= 0.93 * max(rates_fixed.values())
    # never worse than the better of plain decoding and the full block, but for exploring
    assert rate >= 0.96 * max(rates_fixed[1], rates_fixed[16])


def cpu_batch_cost(rows: int, n: int) -> float:
    """This CPU's shared cycles (`benchmarks/batched_forward.py`, in plain steps): a forward
    of rows x n positions costs more with every row and position, drafting adds per row."""
    return 0.55 + 0.13 * rows * n + (0.1 * rows if n > 1 else 0.0)


def gpu_batch_cost(rows: int, n: int) -> float:
    """A GPU's: reading the weights dominates until hundreds of positions."""
    return 1.0 + 0.002 * rows * n + (0.3 if n > 1 else 0.0)


def simulate_batch(widths: ByWidth, own, rates, cost, rows: int, cycles: int, seed: int = 0):
    """Shared cycles of `rows` rows planned by the batch's policy for them (`own`: a reply's
    own policy), each row accepting as `simulate`'s; (tokens per second, the sizes chosen)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    sizes = []
    for _ in range(cycles):
        policy = widths.policy(SimpleNamespace(policy=own), rows)
        n = policy.plan().drafts + 1
        tried = []
        for _ in range(rows):
            accepted = 0
            while accepted < n - 1 and rng.random() < rates[accepted]:
                accepted += 1
            tried.append((n - 1, accepted))
        for j, (proposed, accepted) in enumerate(tried):  # each row, the cycle's cost once
            policy.record(Cycle(proposed, accepted, None if j else cost(rows, n)))
        tokens += sum(a + 1 for _, a in tried)
        seconds += cost(rows, n)
        sizes.append(n)
    return tokens / seconds, sizes


@pytest.mark.parametrize(
    "rates, cost, rows, best",
    [
        (WEAK, cpu_batch_cost, 4, {1}),
        (STRONG, cpu_batch_cost, 4, {3, 4, 5, 6}),
        (STRONG, gpu_batch_cost, 8, {16}),
        (NEVER, gpu_batch_cost, 8, {1}),
    ],
    ids=["weak-cpu-4", "strong-cpu-4", "strong-gpu-8", "useless-gpu-8"],
)
def test_shared_cycles_settle_near_the_best_width_never_far_below_plain(rates, cost, rows, best):
    widths, own = ByWidth(), AdaptiveBlock(16)
    simulate_batch(widths, own, rates, cost, 2, cycles=100)  # first learned at another count
    rate, sizes = simulate_batch(widths, own, rates, cost, rows, cycles=400, seed=1)
    settled = sizes[-200:]
    assert sum(n in best for n in settled) > 0.8 * len(settled), sorted(set(settled))
    fixed = {n: rows * fixed_rate(rates, lambda m: cost(rows, m), n) for n in range(1, 17)}
    assert rate >= 0.9 * max(fixed.values())
    assert rate >= 0.95 * fixed[1]  # plain batched decoding, within the probes' cost


def test_policy_follows_a_drafter_that_becomes_useless():
    policy = AdaptiveBlock(16)
    simulate(policy, STRONG, gpu_cost, cycles=100)
    _, sizes = simulate(policy, NEVER, gpu_cost, cycles=100, seed=1)
    assert sizes[-50:].count(1) > 45


def test_acceptance_estimates_and_expected_tokens():
    policy = AdaptiveBlock(4, prior_weight=0.0, decay=1.0)
    for committed in (1, 2, 2, 4):  # drafts reached: 1, 2, 2, 3; accepted: 0, 1, 1, 3
        policy.record(Cycle(3, committed - 1, 1.0))
    a1, a2, a3 = policy.acceptance_rates()
    assert (a1, a2, a3) == (3 / 4, 1 / 3, 1.0)
    assert policy.expected_tokens(1) == 1.0
    assert policy.expected_tokens(4) == pytest.approx(1 + a1 + a1 * a2 + a1 * a2 * a3)


def test_untried_sizes_are_costed_between_measured_ones():
    policy = AdaptiveBlock(16)
    assert policy.plan().drafts + 1 == 16  # nothing measured: the drafter's block
    policy.record(Cycle(15, 0, 3.0))
    assert policy.cost(8) == pytest.approx(1.5)  # proportional below the smallest measured
    policy.record(Cycle(1, 0, 1.0))
    assert policy.cost(9) == pytest.approx(2.0)  # interpolated between 2 and 16
    assert policy.cost(1) == pytest.approx(0.5)


def test_adaptive_generation_is_lossless_and_switches(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = (
        np.random.default_rng(26).integers(4, 300, size=12).tolist()
    )  # runs 300 tokens without EOS
    expected = reference_greedy(model, prompt, 300, set(tokenizer.eos_token_ids))
    assert len(expected) == 300
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=300, adaptive=True)
    assert tokens == expected
    proposed = [r.proposed for r in responses[1:]]
    assert proposed[0] == 15  # nothing measured yet: the drafter's block
    assert len(set(proposed)) > 2  # then other sizes, plain decoding among them
    assert 0 in proposed


def test_adaptive_with_a_perfect_drafter_stays_lossless(loaded):
    """Whether drafting pays on tiny models depends on the machine's timings, so this checks
    only the bookkeeping across switches; `test_policy_keeps_drafting_when_it_pays` checks
    the decision deterministically."""
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(26).integers(4, 300, size=12).tolist()
    expected = reference_greedy(model, prompt, 160, set(tokenizer.eos_token_ids))
    assert len(expected) == 160
    oracle = OracleDraft(draft, prompt + expected)
    tokens, responses = run(model, oracle, tokenizer, prompt, max_tokens=160, adaptive=True)
    assert tokens == expected
    assert all(r.accepted == r.proposed for r in responses)


def test_plain_decoding_notices_a_drafter_that_starts_helping():
    """At block 1 only probes see the drafter, so they stay frequent: after 300 cycles of a
    useless drafter, one that turns good (prose gave way to code) is drafting with again
    within a few dozen cycles (with probes 64 cycles apart: 56 % of the next 100)."""
    good = [0.8] * 15
    for seed in range(3):
        policy = AdaptiveBlock(16)
        simulate(policy, NEVER, cpu_cost, cycles=300, seed=seed)
        _, sizes = simulate(policy, good, cpu_cost, cycles=100, seed=seed + 10)
        assert sum(n > 1 for n in sizes) > 0.8 * len(sizes)


def learned_plain_decoding() -> AdaptiveBlock:
    """A policy that measured block 1 far cheaper than block 16 and saw no draft accepted."""
    policy = AdaptiveBlock(16)
    policy.record(Cycle(15, 0, 1.0))
    policy.record(Cycle(0, 0, 0.001))
    return policy


def test_a_block_policy_carries_over_between_generations(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(27).integers(4, 300, size=12).tolist()
    expected = reference_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
    fresh = AdaptiveBlock(16)
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=40, block_policy=fresh)
    assert tokens == expected
    assert responses[1].proposed == 15  # nothing learned yet: the drafter's block
    assert fresh.cycles == len(responses) - 1  # every verify cycle was recorded into it
    cycles = fresh.cycles
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=40, block_policy=fresh)
    assert tokens == expected
    assert fresh.cycles == cycles + len(responses) - 1  # it went on counting
    # what the policy learned decides the first cycle of the next generation
    learned = learned_plain_decoding()
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=40, block_policy=learned)
    assert tokens == expected
    assert responses[1].proposed == 0


def test_a_prompt_cache_keeps_its_block_policy(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(28).integers(4, 300, size=12).tolist()
    cache = dflash_mlx.make_prompt_cache(model, draft)
    chain = {"adaptive": True}  # the adaptive chain (the default: `AdaptiveStrategy`)
    tokens, _ = run(model, draft, tokenizer, prompt, max_tokens=24, prompt_cache=cache, **chain)
    kept = cache.block_policy
    assert kept is not None and kept.cycles > 0
    reply = prompt + tokens + [5, 6, 7]  # the next turn of a chat
    expected = reference_greedy(model, reply, 24, set(tokenizer.eos_token_ids))
    cache.block_policy = learned_plain_decoding()
    tokens, responses = run(
        model, draft, tokenizer, reply, max_tokens=24, prompt_cache=cache, **chain
    )
    assert tokens == expected
    assert responses[1].proposed == 0  # went on from the policy the cache holds


def test_a_block_policy_for_another_block_size_is_refused(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    with pytest.raises(ValueError, match="made for block size 8, not block size 16"):
        run(model, draft, tokenizer, [5, 6, 7], max_tokens=4, block_policy=AdaptiveBlock(8))


def test_a_sampling_policy_ignores_the_clock():
    """With fixed costs the sizes follow the acceptance alone: two runs fed the same
    acceptance and very different timings choose the same sizes."""
    costs = FIXED_CYCLE_COSTS["cpu"]
    chosen = []
    for timing in (lambda n: 1.0, lambda n: 1e-3 * n**3):
        policy, rng, sizes = AdaptiveBlock(16, fixed_costs=costs), random.Random(3), []
        for _ in range(200):
            n = policy.plan().drafts + 1
            accepted = 0
            while accepted < n - 1 and rng.random() < WEAK[accepted]:
                accepted += 1
            policy.record(Cycle(n - 1, accepted, timing(n)))
            sizes.append(n)
        chosen.append(sizes)
    assert chosen[0] == chosen[1]
    assert {2, 3, 4} & set(chosen[0]) and max(chosen[0]) < 16  # a weak drafter: short blocks
    assert policy.cost(3) == pytest.approx(costs[3]) and policy.cost(6) == pytest.approx(
        (costs[4] + costs[8]) / 2
    )


@pytest.mark.parametrize("backend", sorted(FIXED_CYCLE_COSTS))
@pytest.mark.parametrize(
    "rates, settles_on", [(STRONG, (12, 16)), (NEVER, (1, 1))], ids=["strong", "never"]
)
def test_fixed_costs_settle_on_long_blocks_or_plain_steps(backend, rates, settles_on):
    """A strong drafter gets long blocks (12 pays about as well as 16 where a cycle's cost
    grows past 8 positions, as on the CPU), a useless one plain steps."""
    costs = FIXED_CYCLE_COSTS[backend]
    policy = AdaptiveBlock(16, fixed_costs=costs)
    _, sizes = simulate(policy, rates, lambda n: interpolated_cost(costs, n), cycles=200)
    low, high = settles_on
    assert low <= max(set(sizes[-50:]), key=sizes[-50:].count) <= high


def test_seeded_sampling_adapts_by_default_and_stays_reproducible(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(29).integers(4, 300, size=12).tolist()
    replies = []
    for _ in range(2):
        cache = dflash_mlx.make_prompt_cache(model, draft)
        mx.random.seed(11)
        tokens, responses = run(
            model,
            draft,
            tokenizer,
            prompt,
            max_tokens=120,
            prompt_cache=cache,
            temperature=1.0,
            acceptance="speculative",
        )
        replies.append((tokens, [r.proposed for r in responses]))
        assert not cache.block_policy.timed  # sampling by draws: fixed costs, not the clock
    assert replies[0] == replies[1]
    assert len(set(replies[0][1][1:])) > 1  # the block size changed along the way
    with pytest.raises(ValueError, match="made for greedy decoding: make a new one"):
        run(model, draft, tokenizer, prompt, max_tokens=4, temperature=1.0,
            acceptance="speculative", block_policy=AdaptiveBlock(16))  # fmt: skip


# A tree cycle's budget. The synthetic drafter proposes one chain per cycle whose i-th node has
# path probability confidence^i; the target accepts each next node with probability `truth`
# (so a calibrated drafter has truth == confidence). Cycles verifying n positions cost
# drafted(n); a cycle that skips the drafter costs 1 (a plain step). A drafted cycle verifies
# the first nodes of its chain, as many as the policy chose from the chain before.


def drafted(n: int) -> float:  # this CPU: the drafter ~0.15 of a step, each position +7 %
    return 1.15 + 0.07 * (n - 1)


def tree_cycle(rng: random.Random, confidence: float, truth: float, depth: int = 15):
    probabilities = [confidence**i for i in range(1, depth + 1)]
    accepted = 0
    while accepted < depth and rng.random() < truth:
        accepted += 1
    return probabilities, accepted


def simulate_tree(policy, kinds, cycles: int = 600, seed: int = 0, stay: float = 0.0):
    """Tokens per unit cost over `cycles`, each of a (confidence, truth) drawn from `kinds`
    (the cycle before's kind kept with probability `stay`: stretches of text), and the budgets
    chosen per kind (None: the drafter skipped)."""
    rng = random.Random(seed)
    tokens = spent = 0.0
    chosen = {kind: [] for kind in kinds}
    kind = rng.choice(kinds)
    for _ in range(cycles):
        kind = kind if rng.random() < stay else rng.choice(kinds)
        probabilities, accepted = tree_cycle(rng, *kind)
        plan = policy.plan()
        if not plan.searched:
            budget, cost = None, 1.0
        else:
            budget = min(plan.drafts, len(probabilities))
            cost = drafted(budget + 1)
            policy.record(Cycle(budget, min(accepted, budget), cost, probabilities))
        tokens += 1 + min(accepted, budget or 0)
        spent += cost
        chosen[kind].append(budget)
    return tokens / spent, chosen


def fixed_tree_rate(kinds, budget: int) -> float:
    """Expected tokens per unit cost of a fixed budget (the drafter always runs)."""
    expected = [1 + sum(truth**i for i in range(1, budget + 1)) for _, truth in kinds]
    return sum(expected) / len(kinds) / drafted(budget + 1)


CONFIDENT, UNSURE = (0.9, 0.9), (0.3, 0.3)


def test_tree_budget_is_a_plain_step_when_nothing_is_accepted():
    """An overconfident drafter that is never right: plain steps, the drafter mostly skipped."""
    kinds = [(0.9, 0.0)]
    rate, chosen = simulate_tree(AdaptiveTree(32), kinds)
    assert rate >= 0.95  # a plain step without the drafter commits 1 token per unit
    assert rate > max(fixed_tree_rate(kinds, b) for b in range(33))  # the drafter never pays
    late = chosen[kinds[0]][100:]
    assert late.count(None) > 0.8 * len(late)  # the drafter skipped
    assert all(b in (None, 0, 1) for b in late)  # probes verify the smallest useful tree


def test_tree_budget_grows_when_acceptance_is_high():
    rate, chosen = simulate_tree(AdaptiveTree(32), [CONFIDENT])
    best = max(fixed_tree_rate([CONFIDENT], b) for b in range(33))
    assert rate >= 0.9 * best
    late = chosen[CONFIDENT][100:]
    assert None not in late and np.mean(late) >= 8


def test_tree_budget_follows_stretches_of_confidence():
    """Stretches of confident and of unsure cycles: big trees in the first, small ones in the
    second, which no fixed budget can do."""
    kinds = [CONFIDENT, UNSURE]
    rate, chosen = simulate_tree(AdaptiveTree(32), kinds, cycles=1000, stay=0.9)
    best_fixed = max(fixed_tree_rate(kinds, b) for b in range(33))
    assert rate > 1.1 * best_fixed
    confident = [b for b in chosen[CONFIDENT][200:] if b is not None]
    unsure = [b for b in chosen[UNSURE][200:] if b is not None]
    assert np.median(confident) >= 8 and np.median(unsure) <= 2


def test_tree_calibration_follows_an_overconfident_drafter():
    policy = AdaptiveTree(32)
    simulate_tree(policy, [(0.9, 0.6)], cycles=300)
    # the drafter predicts 0.9 + 0.81 + ... where 0.6 + 0.36 + ... is accepted: s ~ 1.5 / (8.1)
    predicted = sum(0.9**i for i in range(1, 16))
    assert policy.accepted / policy.predicted == pytest.approx(1.5 / predicted, rel=0.5)


def test_tree_costs_are_measured_per_size_and_the_first_tree_is_the_largest():
    policy = AdaptiveTree(8)
    assert policy.plan() == Plan(8, tree=True, searched=8)
    policy.record(Cycle(8, 0, 2.0, [0.5] * 8))
    assert policy.seconds == {9: 2.0}
    # costed proportionally below 9: verify the root of the largest tree searched
    assert policy.plan() == Plan(0, tree=True, searched=8)
    policy.record(Cycle(0, 0, 1.0, [0.5] * 8))
    assert policy.seconds == {9: 2.0, 1: 1.0}
    assert policy.plan() == Plan(0, tree=True)  # after the root alone was best, plain steps


def test_tree_size_follows_the_tree_before():
    """Each drafted cycle searches the largest tree and verifies as many of its nodes as the
    last tree's path probabilities are worth; the calibration compares the drafts accepted
    with the verified nodes' probabilities alone."""
    confident, unsure = [0.95**i for i in range(1, 17)], [0.2**i for i in range(1, 17)]
    policy = AdaptiveTree(16, min_probe_gap=0, max_probe_gap=0)  # no plain steps skipped
    assert policy.plan() == Plan(16, tree=True, searched=16)  # nothing seen: the largest
    policy.record(Cycle(16, 0, 1.6, unsure))
    policy.seconds = {1: 1.0, 2: 1.2, 3: 1.25, 5: 1.3, 9: 1.4, 17: 1.6}
    assert policy.plan() == Plan(0, tree=True, searched=16)  # after an unsure tree: the root
    trees = [confident, unsure, confident, confident, unsure, unsure, confident]
    sizes = []
    for before in trees:
        calibration = policy.accepted, policy.predicted
        verified = sizes[-1] if sizes else 0
        accepted = round(sum(before[:verified]))  # a calibrated drafter
        policy.record(Cycle(verified, accepted, 1.2, before))
        if verified:  # the verified nodes' probabilities alone are predicted
            assert policy.predicted == pytest.approx(
                policy.decay * calibration[1] + sum(before[:verified])
            )
        else:  # the root alone verified: nothing to calibrate
            assert (policy.accepted, policy.predicted) == calibration
        plan = policy.plan()
        assert plan.tree and plan.searched == 16
        sizes.append(plan.drafts)
    after_confident = [b for tree, b in zip(trees, sizes) if tree is confident]
    after_unsure = [b for tree, b in zip(trees, sizes) if tree is unsure]
    assert min(after_confident) >= 8 and max(after_unsure) <= 1, sizes


def test_rows_sharing_a_cycle_size_the_next_tree_together():
    """Rows one policy plans in a shared cycle share the next size: from their trees' mean
    path probabilities, the next cycle's trees replacing them."""
    confident, unsure = [0.95**i for i in range(1, 17)], [0.2**i for i in range(1, 17)]

    def next_size(*cycles: list[list[float]]) -> int:
        policy = AdaptiveTree(16, min_probe_gap=0, max_probe_gap=0, rows=2)
        policy.seconds = {1: 1.0, 2: 1.2, 3: 1.25, 5: 1.3, 9: 1.4, 17: 1.6}
        for trees in cycles:  # the first row is timed, the others are not
            for row, tree in enumerate(trees):
                policy.record(Cycle(0, 0, None if row else 1.0, tree))
        return policy.plan().drafts

    mean = [(a + b) / 2 for a, b in zip(confident, unsure)]
    assert next_size([unsure]) < next_size([confident, unsure]) == next_size([mean])
    assert next_size([confident, unsure], [unsure]) == next_size([unsure])


# Chains or trees each cycle (`AdaptiveStrategy`). The synthetic tree is `width` nodes per depth
# along its best path: the target accepts each next depth with probability `rate`, so a tree of
# budget b reaches depth b // width (at most 15), and node j * width is its depth-j node.


def chain_cycle(rng: random.Random, rates: list[float], n: int) -> int:
    accepted = 0
    while accepted < n - 1 and rng.random() < rates[accepted]:
        accepted += 1
    return accepted


def simulate_strategy(policy, chain_rates, tree, chain_cost, tree_cost, cycles=600, seed=0):
    """Tokens per unit cost and the plans chosen; `tree` is (rate, width)."""
    rng, (rate, width) = random.Random(seed), tree
    tokens = spent = 0.0
    plans = []
    for _ in range(cycles):
        plan = policy.plan()
        if plan.tree:
            accepted, cost = 0, tree_cost(plan.drafts + 1)
            while accepted < min(plan.drafts // width, 15) and rng.random() < rate:
                accepted += 1
            path = [width * j for j in range(accepted + 1)]
            policy.record(Cycle(plan.drafts, accepted, cost, None, path))
        else:
            accepted = chain_cycle(rng, chain_rates, plan.drafts + 1)
            cost = chain_cost(plan.drafts + 1)
            policy.record(Cycle(plan.drafts, accepted, cost))
        tokens, spent = tokens + accepted + 1, spent + cost
        plans.append(plan)
    return tokens / spent, plans


def best_fixed_rate(chain_rates, tree, chain_cost, tree_cost) -> tuple[float, float]:
    """(the best fixed chain's, the best fixed tree's) expected tokens per unit cost."""
    rate, width = tree
    chains = [fixed_rate(chain_rates, chain_cost, n) for n in range(1, 17)]
    trees = [
        (1 + sum(rate**j for j in range(1, min(b // width, 15) + 1))) / tree_cost(b + 1)
        for b in range(2, 17)
    ]
    return max(chains), max(trees)


def cpu_chain_cost(n: int) -> float:  # this CPU, measured (FIXED_CYCLE_COSTS["cpu"])
    return interpolated_cost(FIXED_CYCLE_COSTS["cpu"], n)


def cpu_tree_cost(positions: int) -> float:  # trees of 6, 8, 12: 1.23, 1.26, 1.35 steps
    return 1.1 + 0.02 * positions


H100_CHAIN = {1: 1.0, 2: 2.45, 16: 2.73}  # steps: the loop at block 1, a 2- and a 16-chain
H100_TREE = {5: 2.81, 9: 3.26, 17: 3.45, 33: 3.60}  # trees of 4, 8, 16, 32, the same run


def h100_chain_cost(n: int) -> float:
    return interpolated_cost(H100_CHAIN, n)


def h100_tree_cost(positions: int) -> float:
    return max(interpolated_cost(H100_TREE, positions), h100_chain_cost(positions))


SHIPPED_TREE = (0.6, 2)  # the shipped drafter's trees with the lookup: τ ≈ 2.1-2.3 at 8 nodes
STRONG_TREE = (0.9, 1)  # a strong drafter's tree is its chain: its other nodes rarely help


def settled_runs(setup, kind, seeds=range(7)):
    """Per seed: (tokens per unit cost / the best fixed arm's, share of the last 300 of 600
    cycles whose plan satisfies `kind`)."""
    best = max(best_fixed_rate(*setup))
    runs = []
    for seed in seeds:
        rate, plans = simulate_strategy(AdaptiveStrategy(16), *setup, seed=seed)
        runs.append((rate / best, sum(map(kind, plans[-300:])) / 300))
    return runs


def test_strategy_chooses_trees_with_the_shipped_drafter_on_this_cpu():
    setup = WEAK, SHIPPED_TREE, cpu_chain_cost, cpu_tree_cost
    chain, tree = best_fixed_rate(*setup)
    assert tree > 1.25 * chain  # the measured gap: trees of 8 1.66x, the chain 1.31x
    runs = settled_runs(setup, lambda p: p.tree and 4 <= p.drafts <= 16)
    assert all(share > 0.8 for _, share in runs)
    assert np.median([rate for rate, _ in runs]) >= 0.93


def test_strategy_keeps_deep_chains_with_a_strong_drafter_on_an_h100():
    """Trees cost more than the chain there and a strong drafter's chain commits ~8 tokens."""
    setup = STRONG, STRONG_TREE, h100_chain_cost, h100_tree_cost
    chain, tree = best_fixed_rate(*setup)
    assert chain > 1.2 * tree
    runs = settled_runs(setup, lambda p: not p.tree and p.drafts >= 11)
    assert np.median([share for _, share in runs]) > 0.8
    assert np.median([rate for rate, _ in runs]) >= 0.93


def test_strategy_decodes_plainly_when_no_draft_is_accepted():
    setup = NEVER, (0.0, 1), cpu_chain_cost, cpu_tree_cost
    for rate, share in settled_runs(setup, lambda p: p == Plan(0), seeds=[0]):
        assert share > 0.9 and rate >= 0.95


def test_strategy_measures_every_smaller_arm_from_one_cycle():
    policy = AdaptiveStrategy(16, tree_budget=8)
    assert policy.plan() == Plan(8, tree=True)  # nothing measured: the largest tree first
    policy.record(Cycle(8, 3, 2.0, None, [0, 2, 5, 7]))
    assert policy.plan() == Plan(15)  # then the full chain
    policy.record(Cycle(15, 4, 3.2))
    trees = {b.drafts: policy.expected_tokens(b) for b in policy.arms(tree=True)}
    assert trees == {2: 2.0, 3: 2.0, 4: 2.0, 5: 3.0, 6: 3.0, 8: 4.0}
    chains = {p.drafts + 1: policy.expected_tokens(p) for p in policy.arms(tree=False)}
    assert chains == {
        1: 1.0,
        2: 2.0,
        3: 3.0,
        4: 4.0,
        5: 5.0,
        6: 5.0,
        8: 5.0,
        10: 5.0,
        12: 5.0,
        16: 5.0,
    }
    assert policy.cost(Plan(8, tree=True)) == 2.0
    assert policy.cost(Plan(12, tree=True)) == pytest.approx(3.2 * 13 / 16)  # its chain's


def test_a_sampling_strategy_ignores_the_clock():
    fixed = FIXED_CYCLE_COSTS["cpu"], FIXED_TREE_COSTS["cpu"]
    chosen = []
    for timing in (lambda n: 1.0, lambda n: 1e-3 * n**3):
        policy = AdaptiveStrategy(16, fixed_costs=fixed)
        _, plans = simulate_strategy(policy, WEAK, SHIPPED_TREE, timing, timing, cycles=200)
        chosen.append(plans)
    assert chosen[0] == chosen[1]
    assert sum(p.tree for p in chosen[0][-100:]) > 80  # trees: cheaper per token here


class RandomStrategy(AdaptiveStrategy):
    """Any chain or tree, plain steps among them (so trees get queued after them): the output
    must not care."""

    def __init__(self, block_size: int, seed: int):
        super().__init__(block_size)
        self.rng = random.Random(seed)

    def plan(self) -> Plan:
        return self.rng.choice(self.arms())


@pytest.mark.parametrize("name", ["llama-untied-mha", "qwen3-tied-gqa"])
def test_the_default_chooses_chains_and_trees_and_equals_mlx_lm(loaded, name):
    model, tokenizer, draft = loaded(name)
    prompt = np.random.default_rng(30).integers(4, 300, size=12).tolist()
    expected = reference_greedy(model, prompt, 160, set(tokenizer.eos_token_ids))
    cache = dflash_mlx.make_prompt_cache(model, draft)
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=160, prompt_cache=cache)
    assert tokens == expected
    policy = cache.block_policy
    assert isinstance(policy, AdaptiveStrategy) and policy.timed
    assert policy.seconds[True] and policy.seconds[False]  # both kinds were timed
    randomly = RandomStrategy(draft.config.block_size, seed=1)
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=160, block_policy=randomly)
    assert tokens == expected
    oracle = OracleDraft(draft, prompt + expected)  # every draft accepted, chain or tree
    tokens, responses = run(model, oracle, tokenizer, prompt, max_tokens=160)
    assert tokens == expected
    assert len(tokens) / len(responses) > 4


def test_a_strategy_carries_over_between_generations(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(31).integers(4, 300, size=12).tolist()
    expected = reference_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
    policy = AdaptiveStrategy(draft.config.block_size)
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=40, block_policy=policy)
    assert tokens == expected and policy.cycles == len(responses) - 1
    cycles = policy.cycles
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=40, block_policy=policy)
    assert tokens == expected and policy.cycles == cycles + len(responses) - 1
    cache = dflash_mlx.make_prompt_cache(model, draft)
    cache.block_policy = policy  # a prompt cache goes on from the policy it holds
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=40, prompt_cache=cache)
    assert tokens == expected and cache.block_policy is policy
    with pytest.raises(ValueError, match="takes no block size or tree budget"):
        run(model, draft, tokenizer, prompt, max_tokens=4, block_size=4, block_policy=policy)
    with pytest.raises(ValueError, match="made for greedy decoding: make a new one"):
        run(model, draft, tokenizer, prompt, max_tokens=4, temperature=1.0, block_policy=policy,
            acceptance="speculative")  # fmt: skip
    # the coupled rule (the default) keeps a greedy run's timed policy: only speed changes
    run(model, draft, tokenizer, prompt, max_tokens=4, temperature=1.0, block_policy=policy)


def test_explicit_settings_keep_their_meaning(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(32).integers(4, 300, size=12).tolist()
    for setting, kind in [
        ({"adaptive": True}, AdaptiveBlock),  # the adaptive chain
        ({"block_size": 8, "adaptive": True}, AdaptiveBlock),
        ({"tree_budget": 4, "adaptive": True}, AdaptiveTree),
        ({"temperature": 1.0}, AdaptiveStrategy),  # sampled: fixed costs
    ]:
        cache = dflash_mlx.make_prompt_cache(model, draft)
        run(model, draft, tokenizer, prompt, max_tokens=12, prompt_cache=cache, **setting)
        assert type(cache.block_policy) is kind
    for setting in ({"adaptive": False}, {"block_size": 8}, {"tree_budget": 4}):
        cache = dflash_mlx.make_prompt_cache(model, draft)
        _, responses = run(
            model, draft, tokenizer, prompt, max_tokens=12, prompt_cache=cache, **setting
        )
        assert cache.block_policy is None  # fixed


def test_a_shared_width_measures_its_costs_from_a_plain_cycle_up():
    """A reply's strategy learned alone, where a long chain costs little more than a step,
    copied for cycles of four rows: the copy keeps the acceptance but not the costs, starts
    with a plain cycle, then costs untried sizes from it as dearer per position, so it does
    not play the largest arms blind (a 4 x 17 forward costs several steps here)."""
    own = AdaptiveStrategy(16, tree_budget=16)
    for _ in range(12):
        own.record(Cycle(15, 2, 1.3))  # alone: chains of 16 cost 1.3 and commit 3 tokens
    shared = for_rows(own, 4)
    assert shared.rows == 4 and own.rows == 1 and own.seconds[False] == {16: pytest.approx(1.3)}
    assert shared.expected_tokens(Plan(15)) == own.expected_tokens(Plan(15))
    assert shared.plan() == Plan(0)  # nothing measured at four rows: a plain cycle first
    shared.record(Cycle(0, 0, 2.0))
    assert shared.cost(Plan(15)) == pytest.approx(2.0 * (1 + SHARED_POSITION_SHARE * 4 * 15))
    plan = shared.plan()  # trees never measured: the one expected to pay most, not the largest
    assert plan.tree and plan.drafts < 4
    assert for_rows(own, 1).plan() == own.plan()  # a reply's own cycles: unchanged


def test_a_loop_of_default_calls_goes_on_from_the_last_policy(loaded, make_pair):
    """A reply with no policy or prompt cache of its own starts from what the last such reply
    of its target and drafter learned, when the clock times it; a policy costed from fixed
    tables (the speculative rule) is not kept, nor one of another drafter; replies stay
    mlx-lm's."""
    model, tokenizer, draft = loaded("llama-untied-mha")
    ids = tokenizer.encode("def add(a, b):")
    expected = reference_greedy(model, ids, 12, set(tokenizer.eos_token_ids))
    first = [t for r in dflash_mlx.stream_generate(model, draft, tokenizer, ids, max_tokens=12)
             for t in r.tokens]  # fmt: skip
    kept = learned_policy(model, draft)
    assert isinstance(kept, AdaptiveStrategy) and kept.timed and first == expected
    again = [t for r in dflash_mlx.stream_generate(model, draft, tokenizer, ids, max_tokens=12)
             for t in r.tokens]  # fmt: skip
    assert again == expected and learned_policy(model, draft) is kept
    sampled = dict(temperature=0.8, acceptance="speculative", max_tokens=6)
    list(dflash_mlx.stream_generate(model, draft, tokenizer, ids, **sampled))
    assert learned_policy(model, draft) is kept
    other = dflash_mlx.load_draft(make_pair("llama-untied-mha")[1])
    assert learned_policy(model, other) is None


def test_shared_cycles_decode_plainly_when_no_draft_is_accepted():
    """Shared cycles re-measure a kind gone stale with its arm expected to pay most; that
    measure must count as fresh even when it is the kind's smallest tree (else the policy
    replays it every cycle and never settles on plain steps)."""
    policy = AdaptiveStrategy(16, rows=4)
    _, plans = simulate_strategy(policy, NEVER, (0.0, 1), cpu_chain_cost, cpu_tree_cost)
    assert sum(p == Plan(0) for p in plans[-300:]) > 0.9 * 300


def mtp_chain_cost(n: int) -> float:  # an MTP layer: each chained draft a step of it and the head
    return 1.0 + 0.25 * (n - 1)


def mtp_tree_cost(positions: int) -> float:  # its trees: every depth a step, whatever the budget
    return 1.6 + 0.03 * positions


def test_a_drafter_never_accepted_ends_in_plain_steps_within_a_few_cycles():
    """A drafter whose drafts are dear and never accepted: after two rounds of exploring,
    plain steps, their probes the cheapest drafting arm of each kind, so that the policy
    costs little more than plain decoding even over a short reply."""
    policy = AdaptiveStrategy(4)
    rate, plans = simulate_strategy(policy, NEVER, (0.0, 1), mtp_chain_cost, mtp_tree_cost, 64)
    assert all(p == Plan(0) for p in plans[4:8])
    assert sum(p != Plan(0) for p in plans) <= 8
    assert {p for p in plans[4:] if p != Plan(0)} <= {Plan(1), Plan(2, tree=True)}
    assert rate >= 0.9
    rate, plans = simulate_strategy(policy, NEVER, (0.0, 1), mtp_chain_cost, mtp_tree_cost, 400)
    assert rate >= 0.96


def test_a_plain_step_timed_in_a_busy_moment_does_not_keep_the_policy_drafting():
    """Plain steps measured while another process held the cores (ten times their cost) and
    a drafter that barely pays for one draft: the policy is back on plain steps within a
    couple of probes, not after the spike's average has decayed over dozens of cycles."""
    policy = AdaptiveStrategy(4, tree_budget=0)
    weak = [0.05, 0.0, 0.0]
    simulate_strategy(policy, weak, (0.0, 1), mtp_chain_cost, mtp_tree_cost, 100)
    busy = iter([10.0] * 3)
    spiked = lambda n: mtp_chain_cost(n) * (next(busy, 1.0) if n == 1 else 1.0)  # noqa: E731
    _, plans = simulate_strategy(policy, weak, (0.0, 1), spiked, mtp_tree_cost, 100, seed=1)
    assert sum(p == Plan(0) for p in plans[-60:]) > 0.9 * 60


def test_a_probe_that_pays_after_plain_steps_measures_its_whole_kind():
    """Plain steps probe the cheapest arm of each kind in turn; one that accepts a draft is
    followed by the kind's largest arm, which measures every arm of the kind at once."""
    policy = AdaptiveStrategy(16)
    simulate_strategy(policy, NEVER, (0.0, 1), cpu_chain_cost, cpu_tree_cost, 100)
    probes = []
    while len(probes) < 2:
        plan = policy.plan()
        if plan.drafts:
            probes.append(plan)
            accepted = int(plan.tree)  # the chain's probe accepts nothing, the tree's a draft
            if plan.tree:
                cost, path = cpu_tree_cost(plan.drafts + 1), [0, 1]
                policy.record(Cycle(plan.drafts, accepted, cost, None, path))
            else:
                policy.record(Cycle(plan.drafts, accepted, cpu_chain_cost(plan.drafts + 1)))
        else:
            policy.record(Cycle(0, 0, cpu_chain_cost(1)))
    assert probes == [Plan(1), Plan(2, tree=True)]
    assert policy.plan() == Plan(16, tree=True)


class NeverAccepted(OracleDraft):
    """Drafts the token after the target's own and ranks the target's own last."""

    def block_logits(self, block, embed, lm_head, cache):
        truth = super().block_logits(block, embed, lm_head, cache).argmax(axis=-1)
        eye = mx.eye(self.config.vocab_size)
        return 100.0 * eye[(truth + 1) % self.config.vocab_size] - 100.0 * eye[truth]


def test_the_default_stops_drafting_a_drafter_never_accepted_and_says_why(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = np.random.default_rng(26).integers(4, 300, size=12).tolist()
    expected = reference_greedy(model, prompt, 64, set(tokenizer.eos_token_ids))
    never = NeverAccepted(draft, prompt + reference_greedy(model, prompt, 80, set()))
    tokens, responses = run(model, never, tokenizer, prompt, max_tokens=64, prompt_lookup=False)
    assert tokens == expected
    assert all(r.accepted == 0 for r in responses)
    drafting = responses[-1].drafting
    assert drafting.chains + drafting.trees <= 8 and drafting.plain >= len(responses) - 9
    assert drafting.off_since == 4  # from the fifth cycle on, probes aside
    assert drafting.as_dict()["drafting_off_reason"] == (
        "drafting did not pay here (measured cycle costs and acceptance)"
    )
