"""Trees in cycles several replies share: each row drafts its own tree (the prompt lookup's
grafts included) in one drafter forward with the others, and the target verifies every row's
tree, chain or plain step in one forward; every reply is still its own greedy reply."""

import numpy as np
import pytest
from helpers import reference_greedy
from test_batch import interleave, no_eos
from test_dflash2 import dflash2_pair  # noqa: F401 (a fixture)
from test_dspark import dspark_pair  # noqa: F401 (a fixture)

from dflash_mlx import load, load_draft, make_batch, stream_generate

MAX_TOKENS = 32


def repeating_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a phrase of their own, so that the prompt lookup finds
    continuations to graft."""
    rng = np.random.default_rng(11)
    out = []
    for _ in range(count):
        phrase = rng.integers(4, 300, size=int(rng.integers(4, 9))).tolist()
        out.append(phrase * 3 + phrase[:2])
    return out


def shared_replies(model, draft, tokenizer, texts, **settings) -> dict:
    """The replies to `texts` decoded together, each shared cycle planned by each reply's own
    settings (not as the batch's measured costs would choose: the shapes are the point)."""
    batch = make_batch(model, draft)
    batch.widths.policy = lambda reply, rows: reply.policy
    generators = {
        i: stream_generate(
            model, draft, tokenizer, text, max_tokens=MAX_TOKENS, batch=batch, **settings
        )
        for i, text in enumerate(texts)
    }
    return interleave(generators)


def expected(model, texts) -> dict:
    return {i: reference_greedy(model, text, MAX_TOKENS, set()) for i, text in enumerate(texts)}


def assert_shared_trees(launched, grafts: bool) -> None:
    shared = [(trees, grafted) for rows, trees, grafted in launched if rows > 1]
    assert any(sum(trees) > 1 for trees, _ in shared)  # several rows' trees in one forward
    if grafts:
        assert any(any(g) for _, g in shared)  # with the prompt lookup's grafts


@pytest.mark.parametrize("settings", [{"tree_budget": 8}, {}], ids=["tree-budget-8", "default"])
def test_shared_cycles_verify_each_rows_tree_with_the_lookup(loaded, launched, settings):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    texts = repeating_prompts(4)
    got = shared_replies(model, draft, no_eos(tokenizer), texts, **settings)
    assert got == expected(model, texts)
    if settings:  # the default may settle on chains: what it runs is its own choice
        assert_shared_trees(launched, grafts=True)


def test_a_fixed_tree_budget_is_costed_for_shared_cycles(loaded, launched):
    """Shared cycles cost more per position than a reply's own: a fixed tree budget's shared
    cycles are planned by the batch's policy for that many rows, which tries the trees and
    keeps what pays; every reply is still its own greedy reply."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    texts = repeating_prompts(4)
    batch = make_batch(model, draft)
    generators = {
        i: stream_generate(
            model,
            draft,
            no_eos(tokenizer),
            text,
            max_tokens=MAX_TOKENS,
            batch=batch,
            tree_budget=8,
        )
        for i, text in enumerate(texts)
    }
    assert interleave(generators) == expected(model, texts)
    by_rows = {rows: policy for (rows, _), policy in batch.widths.policies.items()}
    assert by_rows[4].trees_measured  # trees tried at four rows, and costed


def test_shared_dflash2_selector_trees(dflash2_pair, loaded, launched):  # noqa: F811
    target, draft_dir = dflash2_pair("qwen3-tied-gqa")
    model, tokenizer = load(target)
    draft = load_draft(draft_dir)
    texts = repeating_prompts(3)
    got = shared_replies(model, draft, no_eos(tokenizer), texts, tree_budget=8)
    assert got == expected(model, texts)
    assert_shared_trees(launched, grafts=True)


def test_shared_dspark_markov_trees_and_walks(dspark_pair, loaded, launched):  # noqa: F811
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    draft = load_draft(dspark_pair("deepspec")[1])
    texts = repeating_prompts(3)
    tokenizer = no_eos(tokenizer)
    assert shared_replies(model, draft, tokenizer, texts, tree_budget=8) == expected(model, texts)
    assert_shared_trees(launched, grafts=True)
    launched.clear()  # chains: the Markov walk and the confidence cut per row
    assert shared_replies(model, draft, tokenizer, texts, block_size=6) == expected(model, texts)
    assert any(rows > 1 for rows, _, _ in launched)


def test_rows_of_chains_trees_and_plain_steps_share_one_forward(loaded, launched):
    """Replies that ask for different shapes (a tree, a chain, plain steps, the default)
    share cycles, each its own greedy reply."""
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    tokenizer = no_eos(tokenizer)
    texts = repeating_prompts(4)
    batch = make_batch(model, draft)
    shapes = [{"tree_budget": 6}, {"block_size": 4}, {"block_size": 1}, {}]
    generators = {
        i: stream_generate(
            model, draft, tokenizer, text, max_tokens=MAX_TOKENS, batch=batch, **shape
        )
        for i, (text, shape) in enumerate(zip(texts, shapes))
    }
    assert interleave(generators) == expected(model, texts)
    mixed = [trees for rows, trees, _ in launched if rows > 1 and any(trees)]
    assert any(not all(trees) for trees in mixed)  # a tree beside rows that were not
