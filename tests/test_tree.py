"""Tree verification: the tree builder, mask and walk against brute force, a tree forward against
plain forwards over each node's path, and greedy output equal to mlx-lm's for every family whose
caches can keep a tree's accepted path (and a clear refusal for the others)."""

import itertools
import json
import random

import mlx.core as mx
import numpy as np
import pytest
import test_families
from helpers import mlx_lm_greedy, reference_greedy
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_logits_processors
from test_cli import dflash, dflash_in_process, greedy_text
from test_families import FAMILIES, PROMPT, first_difference, prompt_of
from test_generate import OracleDraft
from test_sampling import (
    SIGNIFICANCE,
    NoisyBlockOracleDraft,
    chi2_pvalue,
    exact_marginals,
    sample_runs,
)

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.decode.adaptive import AdaptiveBlock, AdaptiveTree
from dflash_mlx.decode.sampling import make_logprobs_transform
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.rollback import cache_parts, keep_path
from dflash_mlx.models.target import TargetAdapter, TreeShape
from dflash_mlx.models.tree import Tree, ancestor_mask, ranked_tree, search, walk

TREE_FAMILIES = [
    "llama",
    "qwen3",
    "qwen3_moe",
    "minimax",
    "kimi_k25",
    "gpt_oss",
    "gemma4_text",
    "gemma4",
    "muse_glimmer",
    "laguna",
]
RECURRENT = "its recurrent layers cannot keep"
REFUSED = {  # family: why its attention cannot verify a tree
    "qwen3_5": RECURRENT,
    "qwen3_5_moe": RECURRENT,
    "qwen3_next": RECURRENT,
    "llama4": "its chunked attention builds its mask from positions",
    "minimax_m3_vl": "its block-sparse indexer groups keys by cache slot",
    "deepseek_v41": "its compressed sparse attention picks its keys from positions",
    "glm_moe_dsa": "its sparse indexer's top-k selection is computed as decoding does",
}
MAX_TOKENS = 120
family, tokenizer = test_families.family, test_families.tokenizer  # their fixtures, shared


def brute_force_best(logprobs: np.ndarray, budget: int) -> set[tuple[int, ...]]:
    """The `budget` best prefixes of every length, by enumerating all of them."""
    depth, vocab = logprobs.shape
    scored = []
    for d in range(1, depth + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            score = sum(logprobs[t, x] for t, x in enumerate(prefix))
            if score > -np.inf:
                scored.append((score, prefix))
    scored.sort(key=lambda s: -s[0])
    return {prefix for _, prefix in scored[:budget]}


def prefixes(tree: Tree) -> set[tuple[int, ...]]:
    out = [tuple(tree.tokens[n] for n in tree.path(node)[1:]) for node in range(1, len(tree))]
    assert len(set(out)) == len(out)
    return set(out)


@pytest.mark.parametrize("budget", [1, 2, 5, 17, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_is_the_budget_best_prefixes(budget, seed):
    """The tree built on the device holds the `budget` best prefixes of every length, found by
    enumerating all of them, best first."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(4, 5)) * 2.0
    if seed == 2:  # tokens outside a draft vocabulary never enter the tree
        logits[:, 3] = -np.inf
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    drafted = ranked_tree(mx.array([99]), mx.array(logits), budget)
    tree = drafted.read()
    assert tree.tokens[0] == 99 and tree.parents[0] == -1 and tree.depths[0] == 0
    assert prefixes(tree) == brute_force_best(logprobs, budget)
    assert len(tree) == len(drafted) == 1 + budget
    for node in range(1, len(tree)):
        assert tree.parents[node] < node
        assert tree.depths[node] == tree.depths[tree.parents[node]] + 1
        path = tree.path(node)[1:]
        score = sum(logprobs[tree.depths[n] - 1, tree.tokens[n]] for n in path)
        assert tree.logprobs[node] == pytest.approx(score, abs=1e-4)
    # best first: probabilities never rise, and the first b + 1 nodes are the tree of budget b
    probabilities = tree.probabilities()
    assert probabilities == sorted(probabilities, reverse=True)
    for smaller in range(budget):
        assert prefixes(drafted.first(smaller + 1).read()) == brute_force_best(logprobs, smaller)
        assert tree.first(smaller + 1) == drafted.first(smaller + 1).read()  # the host's cut
    assert ancestor_mask(drafted.parents).tolist() == ancestor_mask(tree.parents).tolist()


def test_the_lookup_chain_is_grafted_where_it_meets_the_tree():
    """A chain of known tokens joins the tree as a path from the root: a node it meets keeps
    the better score, the chain goes on below it, and the tree is cut to its budget."""
    logits = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.7, 0.2, 0.1]]))
    chain = ([1, 2, 0], [np.log(0.9)] * 3)  # meets node "1" (0.3 < 0.9), then grows new ones
    tree = ranked_tree(mx.array([7]), mx.array(logits), 5, chain=chain).read()
    expected = {(1,): 0.9, (1, 2): 0.81, (1, 2, 0): 0.729, (0,): 0.6, (0, 0): 0.3}
    found = {
        tuple(tree.tokens[n] for n in tree.path(node)[1:]): p
        for node, p in zip(range(1, len(tree)), tree.probabilities())
    }
    assert found == pytest.approx(expected)
    assert [tree.tokens[node] for node in tree.chain] == chain[0]
    assert all(tree.parents[node] < node for node in range(1, len(tree)))
    cut = ranked_tree(mx.array([7]), mx.array(logits), 2, chain=chain).read()
    assert cut.chain == [1, 2, -1]  # the budget left the chain's last token out
    assert tree.first(3) == cut  # best first: the host's cut of the larger tree is the same
    alone = search(mx.array([7]), None, None, 2, chain).read()  # no drafter: the chain alone
    assert alone.tokens == [7, 1, 2] and alone.chain == [1, 2, -1]


def test_ancestor_mask_and_walk():
    #        0
    #      /   \
    #     1(7)  2(8)
    #    /  \     \
    #  3(5) 4(6)  5(5)
    tree = Tree([9, 7, 8, 5, 6, 5], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2])
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ]
    assert ancestor_mask(tree.parents).tolist() == [[bool(v) for v in row] for row in expected]
    # the target's choice after each node's prefix
    assert walk(tree, [8, 0, 5, 0, 0, 3].__getitem__) == ([0, 2, 5], 3)
    assert walk(tree, [7, 6, 0, 0, 4, 0].__getitem__) == ([0, 1, 4], 4)
    assert walk(tree, [1, 0, 0, 0, 0, 0].__getitem__) == ([0], 1)


def held(cache, first: int) -> list[mx.array]:
    """K and V of positions [first, cache.offset) (a window cache's arrays begin at the positions
    it has dropped)."""
    shift = getattr(cache, "dropped", 0)
    return [x[..., first - shift : cache.offset - shift, :] for x in cache.state[:2]]


def random_tree(seed: int, size: int, vocab: int) -> Tree:
    rng = np.random.default_rng(seed)
    tokens, parents, depths = [int(rng.integers(vocab))], [-1], [0]
    for node in range(1, size):
        parent = int(rng.integers(node))
        tokens.append(int(rng.integers(vocab)))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return Tree(tokens, parents, depths)


@pytest.mark.parametrize("name", TREE_FAMILIES)
def test_tree_forward_equals_plain_forwards_and_compaction_equals_the_path(family, name):
    """Every node's logits equal a plain forward over its root-to-node path; the cache kept for
    a path equals the cache of a plain forward over the path's tokens."""
    model, _, _ = family(name)
    target = TargetAdapter(model)
    tree = random_tree(seed=len(name), size=12, vocab=300)
    cache = target.make_cache()
    model(mx.array(PROMPT)[None], cache=cache)
    classes = [type(x) for x in [*cache, *target.ropes]]
    shape = TreeShape(tree.depths, ancestor_mask(tree.parents))
    logits = target.forward(mx.array(tree.tokens)[None], [cache], [shape]).logits[0]
    assert [type(x) for x in [*cache, *target.ropes]] == classes  # per instance, and restored
    assert all(c.offset == len(PROMPT) + len(tree) for c in cache)
    deepest = max(range(len(tree)), key=lambda n: tree.depths[n])
    for node in [0, 1, deepest, len(tree) - 1]:
        path = tree.path(node)
        reference = target.make_cache()
        plain = model(mx.array(PROMPT + [tree.tokens[n] for n in path])[None], cache=reference)
        assert mx.allclose(logits[node], plain[0, -1], atol=1e-4, rtol=1e-4), node
    path = tree.path(deepest)
    assert path != list(range(len(path)))  # the path's K/V must move
    keep_path(cache, len(PROMPT), path)
    reference = target.make_cache()
    model(mx.array(PROMPT + [tree.tokens[n] for n in path])[None], cache=reference)
    for ours, plain in zip(cache_parts(cache), cache_parts(reference)):
        assert ours.offset == plain.offset == len(PROMPT) + len(path)
        first = max(getattr(ours, "dropped", 0), getattr(plain, "dropped", 0))
        for a, b in zip(held(ours, first), held(plain, first)):
            assert a.shape[2] >= 7 and mx.allclose(a, b, atol=1e-4)  # windows: 8 and 16


class RunnerUpOracle(OracleDraft):
    """The true continuation as every position's second choice, behind a wrong first choice:
    a chain accepts nothing, a tree that holds runners-up accepts them."""

    def block_logits(self, block, embed, lm_head, cache):
        start, vocab = cache[0].offset, self.config.vocab_size
        truth = mx.array(self.sequence[start + 1 : start + block.shape[0]])
        wrong = (truth + 1) % vocab
        eye = mx.eye(vocab)
        return 1.0 * eye[wrong] + 0.6 * eye[truth] - 50.0 * (1 - eye[wrong] - eye[truth])


def run(model, draft, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kwargs))
    return [t for r in responses for t in r.tokens], responses


def tau(responses) -> float:
    return (responses[-1].generation_tokens - 1) / (len(responses) - 1)


@pytest.mark.parametrize("name", TREE_FAMILIES)
def test_tree_greedy_equals_mlx_lm(family, tokenizer, name):
    model, draft, expected = family(name)
    expected = expected[:MAX_TOKENS]
    for budget in (1, 4, 32):  # a root-only tree, a small one, the largest
        tokens, responses = run(
            model, draft, tokenizer, PROMPT, max_tokens=MAX_TOKENS, tree_budget=budget
        )
        assert tokens == expected, (
            f"budget {budget}: first difference at {first_difference(tokens, expected)}"
        )
        assert all(r.proposed <= budget for r in responses)
    runner_up = RunnerUpOracle(draft, PROMPT + family(name)[2])
    chain_tokens, chain = run(
        model, runner_up, tokenizer, PROMPT, max_tokens=MAX_TOKENS, adaptive=True
    )
    tree_tokens, tree = run(
        model, runner_up, tokenizer, PROMPT, max_tokens=MAX_TOKENS, tree_budget=32
    )
    default_tokens, _ = run(model, runner_up, tokenizer, PROMPT, max_tokens=MAX_TOKENS)
    assert chain_tokens == tree_tokens == default_tokens == expected
    assert tau(chain) == 1.0 and tau(tree) > 2.0


class RandomBudget(AdaptiveTree):
    """Any tree the budget allows, the drafter skipped now and then: the output must not care."""

    def __init__(self, max_budget: int, seed: int):
        super().__init__(max_budget)
        self.rng = random.Random(seed)
        self.chosen: list[int | None] = []

    def draft_next(self) -> bool:
        self.drafting = self.rng.random() < 0.8
        if not self.drafting:
            self.chosen.append(None)
        return self.drafting

    def budget(self, probabilities: list[float]) -> int:
        self.chosen.append(self.rng.randint(0, self.max_budget))
        return self.chosen[-1]


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma4_text"])
def test_adaptive_tree_greedy_equals_mlx_lm(family, tokenizer, name):
    model, draft, expected = family(name)
    expected = expected[:MAX_TOKENS]
    for budget in (4, 32):
        policy, randomly = AdaptiveTree(budget), RandomBudget(budget, seed=budget)
        for chooser in (policy, randomly):
            tokens, responses = run(
                model,
                draft,
                tokenizer,
                PROMPT,
                max_tokens=MAX_TOKENS,
                tree_budget=budget,
                adaptive=True,
                block_policy=chooser,
            )
            assert tokens == expected, (
                f"budget {budget}: differs at {first_difference(tokens, expected)}"
            )
            if chooser is policy:
                assert all(r.proposed <= budget for r in responses)
                assert policy.seconds  # its cycles were timed
        # the random chooser's responses (the loop's last): each cycle verifies the size chosen
        # before it, but the last, which may have one token left (the root alone)
        proposed = [r.proposed for r in responses[1:]]
        chosen = [b or 0 for b in randomly.chosen]
        assert len(proposed) == len(chosen)
        assert proposed[:-1] == chosen[:-1] and proposed[-1] <= chosen[-1]
        assert None in randomly.chosen and 0 in randomly.chosen and budget in randomly.chosen


def test_adaptive_tree_is_kept_by_a_prompt_cache(loaded):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    eos = set(tokenizer.eos_token_ids)
    cache = make_prompt_cache(model, draft)
    first = prompt_of(40, seed=24)
    reply, _ = run(
        model,
        draft,
        tokenizer,
        first,
        max_tokens=30,
        prompt_cache=cache,
        tree_budget=8,
        adaptive=True,
    )
    assert reply == reference_greedy(model, first, 30, eos)
    kept = cache.block_policy
    assert isinstance(kept, AdaptiveTree) and kept.max_budget == 8 and kept.seconds
    second = first + reply + prompt_of(6, seed=25)
    tokens, _ = run(
        model,
        draft,
        tokenizer,
        second,
        max_tokens=30,
        prompt_cache=cache,
        tree_budget=8,
        adaptive=True,
    )
    assert tokens == reference_greedy(model, second, 30, eos)
    assert cache.block_policy is kept


def test_tree_with_long_chunked_prompts_and_a_prompt_cache_across_calls(loaded):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    eos = set(tokenizer.eos_token_ids)
    long = prompt_of(2049, seed=21)  # prefilled in two chunks
    expected = reference_greedy(model, long, 24, eos)
    assert run(model, draft, tokenizer, long, max_tokens=24, tree_budget=8)[0] == expected
    cache = make_prompt_cache(model, draft)
    first = prompt_of(40, seed=22)
    reply, _ = run(model, draft, tokenizer, first, max_tokens=30, prompt_cache=cache, tree_budget=8)
    assert reply == reference_greedy(model, first, 30, eos)
    second = first + reply + prompt_of(6, seed=23)
    expected = reference_greedy(model, second, 30, eos)
    tokens, _ = run(
        model, draft, tokenizer, second, max_tokens=30, prompt_cache=cache, tree_budget=16
    )
    assert tokens == expected
    assert all(c.offset == len(cache.tokens) for c in cache.target + cache.draft)


@pytest.mark.parametrize("name", REFUSED)
def test_families_whose_attention_cannot_verify_a_tree_are_refused(family, tokenizer, name):
    assert set(TREE_FAMILIES) | set(REFUSED) == set(FAMILIES)
    model, draft, _ = family(name)
    with pytest.raises(ValueError, match=f"'{name}': {REFUSED[name]}"):
        next(stream_generate(model, draft, tokenizer, PROMPT, tree_budget=4))


@pytest.mark.parametrize("name", REFUSED)
def test_the_default_keeps_the_chain_where_trees_cannot_be_verified(family, tokenizer, name):
    model, draft, expected = family(name)
    cache = make_prompt_cache(model, draft)
    tokens, _ = run(model, draft, tokenizer, PROMPT, max_tokens=48, prompt_cache=cache)
    assert tokens == expected[:48]
    assert isinstance(cache.block_policy, AdaptiveBlock)  # silently: the adaptive chain


def test_bad_tree_settings_are_refused(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(9, seed=4)
    with pytest.raises(ValueError, match="tree_budget must be at least 1"):
        next(stream_generate(model, draft, tokenizer, prompt, tree_budget=0))
    with pytest.raises(ValueError, match="tree verification needs a drafter or the prompt"):
        next(stream_generate(model, None, tokenizer, prompt, tree_budget=4, prompt_lookup=False))
    with pytest.raises(ValueError, match="made for tree budget 8, not tree budget 4"):
        next(
            stream_generate(
                model,
                draft,
                tokenizer,
                prompt,
                tree_budget=4,
                adaptive=True,
                block_policy=AdaptiveTree(8),
            )
        )
    with pytest.raises(ValueError, match="made for block size 16, not tree budget 4"):
        next(
            stream_generate(
                model,
                draft,
                tokenizer,
                prompt,
                tree_budget=4,
                adaptive=True,
                block_policy=AdaptiveBlock(16),
            )
        )


@pytest.mark.parametrize("budget", [4, 16])
def test_tree_with_logits_processors_equals_mlx_lm(loaded, budget):
    """Each node's logits are processed seeing its own path: greedy output and logprobs are
    mlx-lm's with the same processors."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(40, seed=budget)
    settings = dict(logit_bias={11: 2.0}, repetition_penalty=1.2, presence_penalty=0.5)
    eos = set(tokenizer.eos_token_ids)
    expected, logprobs = mlx_lm_greedy(model, prompt, 48, eos, **settings)
    assert expected != mlx_lm_greedy(model, prompt, 48, eos)[0]  # the processors matter
    tokens, responses = run(
        model,
        draft,
        tokenizer,
        prompt,
        max_tokens=48,
        logits_processors=make_logits_processors(**settings),
        tree_budget=budget,
    )
    assert tokens == expected
    ours = mx.concatenate([r.logprobs for r in responses])
    np.testing.assert_allclose(np.array(ours), np.array(mx.stack(logprobs)), rtol=1e-4, atol=1e-3)


@pytest.mark.slow
def test_sampled_tree_is_exact_in_distribution(loaded):
    """Tokens 2-4 come from accepted tree nodes or from the target's sample where no child
    matched: each marginal must be the target's own."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    setting = dict(temperature=0.8, top_k=5, min_p=0.05)
    prompt = [0, 39, 259, 28]
    expected = exact_marginals(model, prompt, make_logprobs_transform(**setting), 4)
    drafter = NoisyBlockOracleDraft(draft, model, prompt, seed=1)
    mx.random.seed(5)
    tokens, accepted = sample_runs(model, drafter, tokenizer, prompt, 4, tree_budget=6, **setting)
    counts = np.bincount(accepted, minlength=4)
    assert counts[0] > 0 and counts[1] > 0 and counts[2:].sum() > 0
    for k in (1, 2, 3):
        assert chi2_pvalue(np.array([t[k] for t in tokens]), expected[k]) > SIGNIFICANCE


def test_cli_tree_budget_equals_greedy(make_pair, loaded):
    target, draft = make_pair("llama-tied-gqa")
    out = dflash(f"generate --model {target} --draft {draft} --json -m 24 --tree-budget 8", "Hi")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    text, n = greedy_text(loaded, "Hi", 24)
    assert result["text"] == text and result["generation_tokens"] == n
    assert 0 < result["proposed"] <= 8 * result["cycles"]
    # the other command lines in this process
    bad = dflash_in_process(f"generate --model {target} --draft {draft} -m 4 --tree-budget 0", "Hi")
    assert bad.returncode != 0 and "--tree-budget must be at least 1" in bad.stderr.splitlines()[-1]
    sized = dflash_in_process(
        f"generate --model {target} --draft {draft} --json -m 24 --tree-budget 8 --adaptive", "Hi"
    )
    assert sized.returncode == 0, sized.stderr
    assert json.loads(sized.stdout)["text"] == text
    no_draft = f"generate --model {target} --no-draft --json -m 24 --tree-budget 4"
    lookup = dflash_in_process(no_draft, "Hi")
    assert lookup.returncode == 0, lookup.stderr  # prompt lookup decoding, no drafter
    assert json.loads(lookup.stdout)["text"] == text


def test_sliding_window_target_keeps_a_prompt_cache_across_tree_turns(family, tokenizer):
    model, draft, _ = family("gpt_oss")  # window 8: every turn crosses it many times
    cache = make_prompt_cache(model, draft)
    first = prompt_of(30, seed=3)
    reply, _ = run(model, draft, tokenizer, first, max_tokens=40, prompt_cache=cache, tree_budget=8)
    assert reply == reference_greedy(model, first, 40, set())
    second = first + reply + prompt_of(5, seed=4)
    tokens, responses = run(
        model, draft, tokenizer, second, max_tokens=40, prompt_cache=cache, tree_budget=8
    )
    assert tokens == reference_greedy(model, second, 40, set())
    assert responses[0].prompt_tokens == len(second)
    assert all(c.offset == len(cache.tokens) for c in cache.target + cache.draft)


class CausalOnlyLlama(llama.LlamaModel):
    """A backbone that builds its own causal mask instead of asking its cache for one."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.embed_tokens(inputs)
        for layer, c in zip(self.layers, cache):
            h = layer(h, "causal" if h.shape[1] > 1 else None, cache=c)
        return self.norm(h)


def test_a_model_that_does_not_take_the_tree_mask_is_refused(tokenizer):
    model = test_families.build("llama")
    model.model.__class__ = CausalOnlyLlama  # this instance only
    draft = init_draft(model, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="'llama'.*did not take the tree's positions and mask"):
        list(stream_generate(model, draft, tokenizer, PROMPT, max_tokens=8, tree_budget=4))
    cache = make_prompt_cache(model, draft)
    tokens, _ = run(model, draft, tokenizer, PROMPT, max_tokens=24, prompt_cache=cache)
    assert tokens == reference_greedy(model, PROMPT, 24, set())  # the hooks were removed
    assert cache.block_policy.tree_budget == 0  # the default's first tree undone: chains
    assert all(c.offset == len(cache.tokens) for c in cache.target)


def tree_shape(parents: list[int]) -> TreeShape:
    """The `TreeShape` of a tree with these parents (-1: the root)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return TreeShape(depths, ancestor_mask(parents))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_forward_of_several_rows_gives_each_row_its_own_forward(family, name):
    """A chain and two trees of other shapes, over caches of other lengths, in one forward:
    each row's logits and features are its own one-row forward's."""
    model, _, _ = family(name)
    target, taps = TargetAdapter(model), [1, 3]
    rows = [[31, 32, 33, 34, 35, 36], [5, 9, 11, 13, 17, 19], [7, 8, 21, 22, 23, 24]]
    shapes = [None, tree_shape([-1, 0, 0, 1, 1, 2]), tree_shape([-1, 0, 1, 2, 0, 4])]
    prompts = [PROMPT[:5], PROMPT, PROMPT[:9]]

    def prefilled() -> list[list]:
        caches = [target.make_cache() for _ in prompts]
        for prompt, cache in zip(prompts, caches):
            target.forward(mx.array(prompt)[None], [cache], prompt=True)
        return caches

    caches = prefilled()
    shared = target.forward(mx.array(rows), caches, shapes, taps)
    assert [c[0].offset for c in caches] == [len(p) + 6 for p in prompts]
    for i, (row, cache, shape) in enumerate(zip(rows, prefilled(), shapes)):
        alone = target.forward(mx.array(row)[None], [cache], [shape], taps)
        for ours, theirs in ((shared.logits, alone.logits), (shared.features, alone.features)):
            # float32 rounding of products over other row counts: 1e-5 of the row's scale
            assert mx.abs(ours[i] - theirs[0]).max() <= 1e-5 * mx.abs(theirs[0]).max(), i
        assert mx.array_equal(shared.logits[i].argmax(-1), alone.logits[0].argmax(-1)), i


def test_a_forward_of_several_rows_needs_caches_that_can_share_it(family):
    model, _, _ = family("gemma4_text")  # sliding-window layers
    target = TargetAdapter(model)
    with pytest.raises(ValueError, match="plain KV or recurrent caches"):
        target.forward(mx.array([[5, 6], [7, 8]]), [target.make_cache(), target.make_cache()])


@pytest.mark.parametrize("name", ["llama", "gemma4_text"])
def test_a_one_row_tree_forward_is_each_paths_own_forward(family, name):
    """A chain-shaped tree verifies as the chain does, bit for bit; every node of a branching
    tree gets the logits of the one-position decoding of its root-to-node path."""
    model, _, _ = family(name)
    target = TargetAdapter(model)

    def prefilled() -> list:
        cache = target.make_cache()
        target.forward(mx.array(PROMPT)[None], [cache], prompt=True)
        return cache

    tokens = mx.array([[5, 9, 11, 13, 17, 19]])
    chain = target.forward(tokens, [prefilled()]).logits
    as_tree = target.forward(tokens, [prefilled()], [tree_shape([-1, 0, 1, 2, 3, 4])]).logits
    assert mx.array_equal(as_tree, chain)
    tree = random_tree(seed=3, size=10, vocab=300)
    shape = TreeShape(tree.depths, ancestor_mask(tree.parents))
    logits = target.forward(mx.array(tree.tokens)[None], [prefilled()], [shape]).logits[0]
    for node in range(len(tree)):
        cache = prefilled()
        for n in tree.path(node):
            decoded = target.forward(mx.array([[tree.tokens[n]]]), [cache]).logits[0, -1]
        assert mx.allclose(logits[node], decoded, atol=1e-4, rtol=1e-4), node
        assert logits[node].argmax().item() == decoded.argmax().item(), node
