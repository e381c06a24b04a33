"""Adaptive drafting: the block size chosen by measured cost settles near the best fixed size
(plain decoding when drafting does not pay, the full block when it is nearly free), a tree's
budget chosen per cycle from the drafter's confidence beats every fixed budget when confidence
tells good cycles from bad ones, and neither ever changes the output."""

import random

import mlx.core as mx
import numpy as np
import pytest
from helpers import reference_greedy
from test_generate import OracleDraft, run

import dflash_mlx
from dflash_mlx.adaptive import (
    FIXED_CYCLE_COSTS,
    AdaptiveBlock,
    AdaptiveTree,
    Cycle,
    interpolated_cost,
)


def simulate(policy: AdaptiveBlock, rates: list[float], cost, cycles: int, seed: int = 0):
    """Drive the policy with drafts accepted at position k with probability rates[k] and
    cycles of size n costing cost(n) seconds; return (tokens per second, sizes chosen)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    sizes = []
    for _ in range(cycles):
        n = policy.plan() + 1
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
    assert policy.plan() + 1 == 16  # nothing measured: the drafter's block
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
    tokens, _ = run(model, draft, tokenizer, prompt, max_tokens=24, prompt_cache=cache)
    kept = cache.block_policy
    assert kept is not None and kept.cycles > 0
    reply = prompt + tokens + [5, 6, 7]  # the next turn of a chat
    expected = reference_greedy(model, reply, 24, set(tokenizer.eos_token_ids))
    cache.block_policy = learned_plain_decoding()
    tokens, responses = run(model, draft, tokenizer, reply, max_tokens=24, prompt_cache=cache)
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
            n = policy.plan() + 1
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
            model, draft, tokenizer, prompt, max_tokens=120, prompt_cache=cache, temperature=1.0
        )
        replies.append((tokens, [r.proposed for r in responses]))
        assert not cache.block_policy.timed  # sampling: fixed costs, not the clock
    assert replies[0] == replies[1]
    assert len(set(replies[0][1][1:])) > 1  # the block size changed along the way
    with pytest.raises(ValueError, match="made for greedy decoding: make a new one"):
        run(model, draft, tokenizer, prompt, max_tokens=4, temperature=1.0,
            block_policy=AdaptiveBlock(16))  # fmt: skip


# A tree cycle's budget. The synthetic drafter proposes one chain per cycle whose i-th node has
# path probability confidence^i; the target accepts each next node with probability `truth`
# (so a calibrated drafter has truth == confidence). Cycles verifying n positions cost
# drafted(n); a cycle that skips the drafter costs 1 (a plain step).


def drafted(n: int) -> float:  # this CPU: the drafter ~0.15 of a step, each position +7 %
    return 1.15 + 0.07 * (n - 1)


def tree_cycle(rng: random.Random, confidence: float, truth: float, depth: int = 15):
    probabilities = [confidence**i for i in range(1, depth + 1)]
    accepted = 0
    while accepted < depth and rng.random() < truth:
        accepted += 1
    return probabilities, accepted


def simulate_tree(policy, kinds, cycles: int = 600, seed: int = 0):
    """Tokens per unit cost over `cycles`, each of a (confidence, truth) drawn from `kinds`,
    and the budgets chosen per kind (None: the drafter skipped)."""
    rng = random.Random(seed)
    tokens = spent = 0.0
    chosen = {kind: [] for kind in kinds}
    for _ in range(cycles):
        kind = rng.choice(kinds)
        probabilities, accepted = tree_cycle(rng, *kind)
        if policy is None or not policy.plan():
            budget, cost = None, 1.0
        else:
            budget = policy.fit(probabilities)
            cost = drafted(budget + 1)
            policy.record(Cycle(budget, min(accepted, budget), cost, probabilities[:budget]))
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


def test_tree_budget_follows_each_cycles_confidence():
    """Confident and unsure cycles mixed: big trees for the first, small ones for the second, which
    no fixed budget can do."""
    kinds = [CONFIDENT, UNSURE]
    rate, chosen = simulate_tree(AdaptiveTree(32), kinds, cycles=1000)
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
    assert policy.plan() == 8 and policy.fit([0.5] * 8) == 8
    policy.record(Cycle(8, 0, 2.0, [0.5] * 8))
    assert policy.seconds == {9: 2.0}
    policy.plan()
    assert policy.fit([0.5] * 8) == 0  # costed proportionally below 9: verify the root
    policy.record(Cycle(0, 0, 1.0, []))
    assert policy.seconds == {9: 2.0, 1: 1.0}
    assert not policy.plan()  # after the root alone was best, plain steps
