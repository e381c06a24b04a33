"""Prompt lookup in trees: the index against a brute-force scan, the graft against the best
nodes of the union, and the loop's accepted tokens against an independent simulation."""

import math
import random

import mlx.core as mx
import numpy as np
import pytest
import test_families
from helpers import reference_greedy
from test_families import FAMILIES, build, first_difference
from test_generate import OracleDraft
from test_tree import prefixes, run

from dflash_mlx.decode import proposers
from dflash_mlx.decode.lookup import PRIORS, ContextLookup
from dflash_mlx.decode.proposers import LookupProposer
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.tree import Tree, ranked_tree

tokenizer = test_families.tokenizer  # its fixture, shared


def scanned_continuation(tokens: list[int], length: int) -> list[int]:
    """What followed the latest earlier occurrence of the last two tokens, else of the last one,
    by scanning backwards (the reference for `ContextLookup`)."""
    for n in (2, 1):
        if len(tokens) < n + 1:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + length]
    return []


@pytest.mark.parametrize("seed", range(4))
def test_lookup_finds_what_a_scan_finds(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6 + 4 * seed) for _ in range(300)]
    lookup = ContextLookup(tokens[:5])
    for end in range(5, len(tokens)):
        lookup.extend(tokens[end : end + 1])
        for length in (1, 4):
            chain, logprobs = lookup.proposal(length)
            assert chain == scanned_continuation(tokens[: end + 1], length), (end, length)
            assert len(logprobs) == len(chain)


def test_lookup_prefers_the_pair_and_counts_acceptance():
    lookup = ContextLookup([5, 1, 2, 7, 1, 3, 9, 5])
    assert lookup.proposal(3)[0] == [1, 2, 7]  # after the only earlier 5
    lookup.extend([1])
    assert lookup.proposal(3)[0] == [2, 7, 1]  # after the pair (5, 1), not the later 1
    lookup.extend([8])
    assert lookup.proposal(3) == ([], [])  # 8 never occurred before
    assert lookup.proposal(0) == ([], [])
    lookup.extend([1])
    chain, logprobs = lookup.proposal(2)
    assert chain == [8, 1]  # after the latest earlier 1
    assert logprobs == pytest.approx([math.log(p) for p in PRIORS])
    tried, accepted = list(lookup.tried), list(lookup.accepted)
    lookup.record([4, 6, 2], path=[0, 4, 6, 3])  # the first two accepted, the third not
    assert lookup.tried == [tried[0] + 1, tried[1] + 2]
    assert lookup.accepted == [accepted[0] + 1, accepted[1] + 1]
    lookup.record([-1, 6], path=[0])  # the budget left the chain out: nothing tried
    lookup.record([3], path=[0])  # its first token rejected
    assert lookup.tried == [tried[0] + 2, tried[1] + 2]
    assert lookup.accepted == [accepted[0] + 1, accepted[1] + 1]


def union_best(tree: Tree, chain: list[int], logprobs: list[float], budget: int) -> dict:
    """The reference graft: every prefix of the tree and of the chain with its score (the
    better one where both hold it), the `budget` best kept."""
    scores = {}
    for node in range(1, len(tree)):
        scores[tuple(tree.tokens[n] for n in tree.path(node)[1:])] = tree.logprobs[node]
    for depth in range(1, len(chain) + 1):  # each chain token given its parent's best score
        prefix = tuple(chain[:depth])
        total = scores.get(prefix[:-1], 0.0) + logprobs[depth - 1]
        scores[prefix] = max(scores.get(prefix, -math.inf), total)
    # a prefix's score never beats its parent's: the graft keeps the parent first
    best = sorted(scores, key=lambda p: (-scores[p], len(p)))[:budget]
    return {p: scores[p] for p in best}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 8, 20])
def test_graft_keeps_the_best_nodes_of_tree_and_chain(seed, budget):
    rng = np.random.default_rng(seed)
    vocab, depth = 5, 6
    logits = mx.array(rng.normal(0, 2, size=(depth, vocab)), mx.float32)
    root = mx.array([99])
    tree = ranked_tree(root, logits, budget).read()
    best = np.argsort(-np.array(logits), axis=-1)[:, 0].tolist()
    # a chain that runs along the tree's best path for a while, then leaves it
    chain = best[:2] + rng.integers(vocab, size=depth - 2).tolist()
    chain_logprobs = np.log(rng.uniform(0.05, 0.95, size=depth)).tolist()
    grafted = ranked_tree(root, logits, budget, chain=(chain, chain_logprobs)).read()
    expected = union_best(tree, chain, chain_logprobs, budget)
    assert prefixes(grafted) == set(expected)
    assert len(grafted) == len(expected) + 1 and grafted.tokens[0] == 99
    for node in range(1, len(grafted)):  # parents first, depths and scores consistent
        parent = grafted.parents[node]
        assert 0 <= parent < node
        assert grafted.depths[node] == grafted.depths[parent] + 1
        assert grafted.logprobs[node] <= grafted.logprobs[parent]
        path = tuple(grafted.tokens[n] for n in grafted.path(node)[1:])
        assert grafted.logprobs[node] == pytest.approx(expected[path], abs=1e-5)
    assert grafted.logprobs[1:] == sorted(grafted.logprobs[1:], reverse=True)  # best first
    assert len(grafted.chain) == len(chain)
    for index, node in enumerate(grafted.chain):  # each chain token's node, or -1 if cut
        if node >= 0:
            assert tuple(grafted.tokens[n] for n in grafted.path(node)[1:]) == tuple(
                chain[: index + 1]
            )
        else:
            assert tuple(chain[: index + 1]) not in expected


def simulated_lookup_walk(prompt: list[int], reply: list[int], budget: int) -> list[int]:
    """Drafts accepted per cycle when only the prompt lookup can be right: each cycle accepts
    the scanned continuation's agreement with the reply (at most `budget` deep)."""
    accepted, done = [], 1  # the prefill commits the reply's first token
    while done < len(reply):
        context = prompt + reply[:done]
        chain = scanned_continuation(context, min(budget, len(reply) - done - 1))
        agree = 0
        while agree < len(chain) and chain[agree] == reply[done + agree]:
            agree += 1
        accepted.append(agree)
        done += agree + 1
    return accepted


class WrongOracle(OracleDraft):
    """Sure of a wrong token at every position, and least of all of the true one: no tree
    node it proposes is ever accepted."""

    def block_logits(self, block, embed, lm_head, cache):
        start, vocab = cache[0].offset, self.config.vocab_size
        truth = mx.array(self.sequence[start + 1 : start + block.shape[0]])
        eye = mx.eye(vocab)
        return 1.0 * eye[(truth + 1) % vocab] - 50.0 - 50.0 * eye[truth]


def test_tree_accepts_what_the_lookup_predicts_and_equals_mlx_lm(tokenizer):
    """A drafter that is always wrong: every accepted draft is the lookup's. A 40-token vocabulary
    makes a random model's reply repeat itself now and then, as text does; a tree of 32 never
    reaches the true token, the drafter's least likely."""
    module, fields = FAMILIES["llama"]
    model = build("llama", fields={**fields, "vocab_size": 40})
    draft = init_draft(model, num_layers=2, block_size=16)
    prompt = np.random.default_rng(1).integers(0, 40, size=21).tolist()
    reply = reference_greedy(model, prompt, 120, set())  # mlx-lm's
    assert len(set(reply)) > 20, "a degenerate random model proves little"
    predicted = simulated_lookup_walk(prompt, reply, budget=15)
    assert sum(predicted) >= 8, "the test needs a reply the lookup can predict"
    wrong = WrongOracle(draft, prompt + reply)
    tokens, responses = run(model, wrong, tokenizer, prompt, max_tokens=120, tree_budget=32)
    assert tokens == reply, f"differs at {first_difference(tokens, reply)}"
    assert [r.accepted for r in responses[1:]] == predicted
    bare, responses = run(
        model, wrong, tokenizer, prompt, max_tokens=120, tree_budget=32, prompt_lookup=False
    )
    assert bare == reply
    assert all(r.accepted == 0 for r in responses)
    # no drafter at all: the lookup's chain is the tree (prompt lookup decoding), 15 deep
    alone, responses = run(model, None, tokenizer, prompt, max_tokens=120, tree_budget=15)
    assert alone == reply
    assert [r.accepted for r in responses[1:]] == predicted


def test_a_tree_after_a_plain_step_grafts_no_chain_that_follows_the_token_before(
    tokenizer, monkeypatch
):
    """The default queues a tree on a plain step's token before the host reads it, so the
    lookup has not been given that root yet: a chain it grafted would continue the token
    before the root. Every grafted chain continues the root's real token, and the output is
    mlx-lm's."""
    _, fields = FAMILIES["llama"]
    model = build("llama", fields={**fields, "vocab_size": 40})  # replies that repeat
    draft = init_draft(model, num_layers=2, block_size=16)
    prompt = np.random.default_rng(1).integers(0, 40, size=21).tolist()
    trees, seen = proposers.trees, []

    def watched(requests):
        drafted = trees(requests)
        for request, tree in zip(requests, drafted):
            if isinstance(request.proposer, LookupProposer):
                last = request.proposer.lookup.tokens[-1]
                grafted = bool((tree.chain >= 0).any().item())
                seen.append((request.root.item(), last, grafted))
        return drafted

    monkeypatch.setattr(proposers, "trees", watched)
    tokens, _ = run(model, draft, tokenizer, prompt, max_tokens=120)
    assert tokens == reference_greedy(model, prompt, 120, set())
    assert any(root != last for root, last, _ in seen), "no tree followed a plain step"
    assert all(root == last for root, last, grafted in seen if grafted), seen
