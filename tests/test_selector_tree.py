"""DFlash 2 draft trees scored by the candidate selector: the tree against brute force over the
selector's rule, what it keeps of the selector's greedy walk, and the tree loop with a DFlash 2
drafter (greedy output equal to mlx-lm's, seeded sampling reproducible)."""

import importlib
import itertools

import mlx.core as mx
import numpy as np
import pytest
import test_dflash2
from helpers import reference_greedy
from mlx.utils import tree_flatten
from test_dflash2 import tiny_config
from test_tree import prefixes

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.decode.sampling import make_verifier
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.tree import Drafted, Tree, search

dflash2_pair = test_dflash2.dflash2_pair  # its fixture, shared
drafter = importlib.import_module("dflash_mlx.models.draft")
VOCAB, K, RANK, STEPS = 12, 4, 4, 4


def tiny_selector_draft(seed: int) -> DFlashDraft:
    """A DFlash 2 drafter whose codebooks are random (not zero), so transitions matter."""
    mx.random.seed(seed)
    dflash = {"mask_token_id": VOCAB - 1, "target_layer_ids": [0]}
    dflash |= {"selector_top_k": K, "selector_rank": RANK}
    draft = DFlashDraft(tiny_config(vocab_size=VOCAB, dflash_config=dflash))
    selector = draft.candidate_selector
    selector.predecessor_codebook = mx.random.normal((VOCAB, RANK))
    selector.successor_codebook = mx.random.normal((VOCAB, RANK))
    return draft


def selector_inputs(seed: int, draft_vocab: bool = False) -> tuple[mx.array, mx.array, int]:
    """(hidden (STEPS, 32), logits (STEPS, VOCAB), anchor); with `draft_vocab`, only three
    tokens are drafted, so one of the K candidates has probability 0."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(STEPS, VOCAB)) * 2.0
    if draft_vocab:
        logits[:, 3:] = -np.inf
    hidden = rng.normal(size=(STEPS, 32))
    return mx.array(hidden, mx.float32), mx.array(logits, mx.float32), int(rng.integers(VOCAB))


def numpy_prefix_scores(draft, hidden, logits, anchor) -> dict[tuple[int, ...], float]:
    """Every prefix over the selector's candidates and its score, from the rule's definition:
    candidates = top-K of U_t; log q_t(b | a) = log softmax over the candidates b' of
    U_t(b') + <A[a] * (W h_t), B[b']>; a prefix scores the sum (probability 0 left out)."""
    params = dict(tree_flatten(draft.parameters()))
    A = np.array(params["candidate_selector.predecessor_codebook"], np.float64)
    B = np.array(params["candidate_selector.successor_codebook"], np.float64)
    W = np.array(params["candidate_selector.hidden_projection.weight"], np.float64)
    h, U = np.array(hidden, np.float64), np.array(logits, np.float64)
    candidates = [sorted(np.argsort(-U[t], kind="stable")[:K].tolist()) for t in range(STEPS)]

    def logprob(t: int, a: int, b: int) -> float:
        scores = np.array([U[t, c] + np.sum(A[a] * (W @ h[t]) * B[c]) for c in candidates[t]])
        finite = scores[scores > -np.inf]
        top = finite.max()
        return scores[candidates[t].index(b)] - top - np.log(np.exp(finite - top).sum())

    out = {}
    for depth in range(1, STEPS + 1):
        for prefix in itertools.product(*candidates[:depth]):
            previous = (anchor, *prefix[:-1])
            score = sum(logprob(t, previous[t], b) for t, b in enumerate(prefix))
            if score > -np.inf:
                out[prefix] = score
    return out


def selector_tree(draft, hidden, logits, anchor, budget) -> Tree:
    edges = draft.candidate_selector.edge_logprobs(hidden, logits, mx.array(anchor))
    return search(mx.array([anchor]), *edges, budget).read()


@pytest.mark.parametrize("budget", [1, 3, 10, 40, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selector_tree_is_the_budget_best_prefixes_of_the_selector(seed, budget):
    draft = tiny_selector_draft(seed)
    hidden, logits, anchor = selector_inputs(seed, draft_vocab=seed == 2)
    scores = numpy_prefix_scores(draft, hidden, logits, anchor)
    best = sorted(scores, key=scores.get, reverse=True)[:budget]
    tree = selector_tree(draft, hidden, logits, anchor, budget)
    assert tree.tokens[0] == anchor and tree.parents[0] == -1 and tree.depths[0] == 0
    for node in range(1, len(tree)):
        assert tree.parents[node] < node
        assert tree.depths[node] == tree.depths[tree.parents[node]] + 1
    # prefixes of probability 0 (a token outside the draft vocabulary) come only after all
    # others, where the budget is larger than their count
    held = sum(logprob > -np.inf for logprob in tree.logprobs)
    assert tree.logprobs[held:] == [-np.inf] * (len(tree) - held)
    finite = {tuple(tree.tokens[n] for n in tree.path(node)[1:]) for node in range(1, held)}
    assert prefixes(tree) >= finite == set(best)
    assert len(tree) == 1 + budget or held == 1 + len(scores)  # every prefix held
    if seed == 2:
        assert max(tree.tokens[1:held]) < 3 and len(scores) == 3 + 9 + 27 + 81


def best_child_chain(tree: Tree, scores: dict[tuple[int, ...], float]) -> list[int]:
    """From the root, the tree's most likely child at each node, while it has one."""
    children, node, chain = tree.children(), 0, []
    while children[node]:
        token = max(children[node], key=lambda t: scores[(*chain, t)])
        chain.append(token)
        node = children[node][token]
    return chain


@pytest.mark.parametrize("budget", [1, 2, 4, 8, 30])
@pytest.mark.parametrize("seed", [0, 1, 3, 4])
def test_the_trees_best_children_follow_the_selectors_greedy_walk(seed, budget):
    """Every node's most likely child is its greedy choice, and a child in the tree implies its
    best sibling is: following best children from the root is the greedy walk, as deep as the
    tree holds it. The whole walk is in the tree only when its score ranks among the budget
    best prefixes, which a budget of the block length does not ensure (next test)."""
    draft = tiny_selector_draft(seed)
    hidden, logits, anchor = selector_inputs(seed)
    greedy = make_verifier().propose
    walk = draft.candidate_selector.walk(hidden, logits, mx.array(anchor), greedy)[0].tolist()
    scores = numpy_prefix_scores(draft, hidden, logits, anchor)
    tree = selector_tree(draft, hidden, logits, anchor, budget)
    chain = best_child_chain(tree, scores)
    assert len(chain) >= 1 and chain == walk[: len(chain)]
    rank = sorted(scores.values(), reverse=True).index(scores[tuple(walk)])
    assert (len(chain) == STEPS) == (rank < budget)


def test_a_budget_of_the_block_length_need_not_hold_the_whole_greedy_walk():
    """Walk 10 (0.55) -> 20 (0.51) -> 30 (0.99) scores 0.278; the runner-up 11 (0.45) is followed
    by near-certain tokens (11 -> 20: 0.446, 11 -> 20 -> 30: 0.441), so the three best prefixes
    are 10, 11, 11 20, and the whole walk needs a budget of 6."""
    p = np.array(
        [
            [[0.55, 0.45], [0.55, 0.45]],  # after the root (both rows are the anchor's)
            [[0.51, 0.49], [0.99, 0.01]],  # after 10, after 11
            [[0.99, 0.01], [0.5, 0.5]],  # after 20, after 21
        ]
    )
    candidates = mx.array([[10, 11], [20, 21], [30, 31]])
    edges = mx.array(np.log(p), mx.float32)
    walk = (10, 20, 30)
    held = {}
    for budget in range(1, 8):
        tree = prefixes(search(mx.array([9]), candidates, edges, budget).read())
        held[budget] = sum(walk[:depth] in tree for depth in (1, 2, 3))
        if budget == 3:
            assert tree == {(10,), (11,), (11, 20)}
    assert held == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 3, 7: 3}


def spied_trees(monkeypatch) -> list[Drafted]:
    """The trees the loop builds with the selector from here on."""
    trees = []

    def spy(*args):
        trees.append(search(*args))
        return trees[-1]

    monkeypatch.setattr(drafter, "search", spy)
    return trees


def test_tree_verification_with_a_dflash2_drafter_equals_mlx_lm(dflash2_pair, loaded, monkeypatch):
    model, tokenizer, _ = loaded("qwen3-tied-gqa")
    draft = load_draft(dflash2_pair("qwen3-tied-gqa")[1])
    prompt = tokenizer.encode("def add(a, b):")
    expected = reference_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
    for budget in (1, 4, 16):
        trees = spied_trees(monkeypatch)
        responses = list(
            stream_generate(model, draft, tokenizer, prompt, max_tokens=40, tree_budget=budget)
        )
        assert [t for r in responses for t in r.tokens] == expected, budget
        # every cycle that drafted (not the last one-token cycle) built its tree with the selector
        assert [len(tree) - 1 for tree in trees] == [r.proposed for r in responses if r.proposed]
        assert max(r.proposed for r in responses) == budget


def test_sampled_tree_with_a_dflash2_drafter_is_reproducible(dflash2_pair, loaded, monkeypatch):
    model, tokenizer, _ = loaded("qwen3-tied-gqa")
    draft = load_draft(dflash2_pair("qwen3-tied-gqa")[1])
    prompt = tokenizer.encode("The quick brown fox")
    runs = []
    for _ in range(2):
        trees = spied_trees(monkeypatch)
        mx.random.seed(11)
        responses = list(
            stream_generate(
                model, draft, tokenizer, prompt, max_tokens=32, temperature=0.8, tree_budget=6
            )
        )
        runs.append([t for r in responses for t in r.tokens])
        assert trees and 0 < len(runs[-1]) <= 32
    assert runs[0] == runs[1]
