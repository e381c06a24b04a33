"""Sparse attention past its selection size (glm_moe_dsa, DeepSeek-V3.2's attention): a verify
forward's queries attend as one-token decoding's do, so greedy output stays mlx-lm's.

The compressed and block-sparse families (deepseek_v41, minimax_m3_vl) compute one query and
several by one formula in mlx-lm; tests/test_families.py runs them past their selection sizes
(4 of ~80 compressed groups, 3 of ~40 blocks of keys)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
import test_families
from helpers import reference_greedy
from test_families import FAMILIES, GLM_DSA, build, first_difference, prompt_of, run

from dflash_mlx.models import backends
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.target import TargetAdapter

TOP_K = 32
SPARSE = {"glm_moe_dsa": (FAMILIES["glm_moe_dsa"][0], dict(GLM_DSA, index_topk=TOP_K))}
PROMPT = prompt_of(20, seed=0)
MAX_TOKENS = 300

tokenizer = test_families.tokenizer  # its fixture: the tiny tokenizer without an EOS


@pytest.fixture(scope="module")
def sparse():
    """(glm_moe_dsa selecting 32 keys per query, a random drafter, mlx-lm's greedy reply)."""
    model = build("glm_moe_dsa", families=SPARSE)
    draft = init_draft(model, num_layers=2, block_size=16)
    expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
    assert len(set(expected)) > 50, "a degenerate random model proves little"
    return model, draft, expected


@pytest.mark.parametrize("block_size", [4, 16])
def test_sparse_attention_greedy_equals_mlx_lm_past_its_selection_size(
    sparse, tokenizer, block_size
):
    model, draft, expected = sparse
    assert len(PROMPT) < TOP_K < len(PROMPT) + MAX_TOKENS  # blocks cross it, then select
    tokens, responses = run(
        model, draft, tokenizer, PROMPT, block_size=block_size, max_tokens=MAX_TOKENS
    )
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.accepted for r in responses) < sum(r.proposed for r in responses)


def _rows_alike() -> bool:
    """Whether this machine's matrix products give a row of 4 the bits of a row alone (the
    few-row kernel does); the attention's projections run over all positions at once."""
    linear, x = nn.Linear(64, 48), mx.random.normal((1, 4, 64), key=mx.random.key(2))
    alone = mx.concatenate([linear(x[:, i : i + 1]) for i in range(4)], axis=1)
    return mx.array_equal(linear(x), alone).item()


@pytest.mark.parametrize("cached", [40, 30, 10])  # all select; the first two do not; none does
@pytest.mark.parametrize("tied", [False, True])
def test_a_verify_forward_attends_as_decoding_does(sparse, cached, tied):
    """Four positions in one verify forward against four one-token forwards of mlx-lm: the
    same output, bit for bit, also where every index score ties and only the selection's
    tie-breaking decides which keys a query sees."""
    if not _rows_alike():
        pytest.skip("this machine's products round a row differently among several")
    model, _, _ = sparse
    target, attention = TargetAdapter(model), model.layers[1].self_attn
    weights = attention.indexer.weights_proj
    saved = weights.weight
    if tied:
        weights.weight = mx.zeros_like(saved)
    x = 3.0 * mx.random.normal((1, cached + 4, 64), key=mx.random.key(1))
    decoding, verifying = target.make_cache()[1], target.make_cache()[1]
    try:
        for cache in (decoding, verifying):
            attention(x[:, :cached], cache=cache)
        expected = [attention(x[:, p : p + 1], cache=decoding) for p in range(cached, cached + 4)]
        mask = verifying[0].make_mask(4, return_array=True, window_size=None)
        with backends.building(backends.verify_swaps([attention], backends.current(), 4)):
            out = attention(x[:, cached:], mask, verifying)
        mx.eval(out, expected)
    finally:
        weights.weight = saved
    assert mx.array_equal(out, mx.concatenate(expected, axis=1))
    assert verifying[1].offset == decoding[1].offset == cached + 4  # the indexer's keys too
    assert mx.array_equal(verifying[1].state[0], decoding[1].state[0])
