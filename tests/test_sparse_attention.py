"""Sparse attention past its selection size (glm_moe_dsa, DeepSeek-V3.2's attention): a verify
forward's queries attend as one-token decoding's do, so greedy output stays mlx-lm's.

The compressed and block-sparse families (deepseek_v41, minimax_m3_vl) compute one query and
several by one formula in mlx-lm; tests/test_families.py runs them past their selection sizes
(4 of ~80 compressed groups, 3 of ~40 blocks of keys)."""

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import test_families
from helpers import reference_greedy
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache
from test_families import FAMILIES, GLM_DSA, build, first_difference, run
from test_generate import OracleDraft

from dflash_mlx.models import backends
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.target import TargetAdapter

TOP_K = 32
SPARSE = {"glm_moe_dsa": (FAMILIES["glm_moe_dsa"][0], dict(GLM_DSA, index_topk=TOP_K))}
MAX_TOKENS = 300

tokenizer = test_families.tokenizer  # its fixture: the tiny tokenizer without an EOS

# 16 tokens (the last two rare), normal weights, a sharp LM head: top tokens often within a few
# thousandths, so that a verify forward rounding anything otherwise than decoding shows (seed 0:
# one key selected otherwise at context 57, another token at 63)
NEAR_TIES = dict(
    GLM_DSA,
    vocab_size=16,
    intermediate_size=128,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=32,
    index_n_heads=2,
    index_topk=TOP_K,
    rope_theta=10000.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


@pytest.fixture(scope="module")
def sparse():
    """glm_moe_dsa selecting 32 keys per query."""
    return build("glm_moe_dsa", families=SPARSE)


# (rows, columns) of products a verify forward takes: a layer's over 4 positions; a whole
# target's over 16, its MoE gate's (4 experts) too
LAYER_PRODUCTS, TARGET_PRODUCTS = [(4, 48)], [(4, 48), (16, 48), (4, 4)]


def _rows_alike(products: list[tuple[int, int]]) -> bool:
    """Whether this machine's matrix products give each of several rows the bits of that row
    alone, as MLX's bundled BLAS and the few-row kernel do (not OpenBLAS alone, which takes a
    product of as many rows as columns otherwise)."""
    key = mx.random.key(2)
    for rows, columns in products:
        x = mx.random.normal((1, rows, 64), key=key)
        w = mx.random.normal((columns, 64), key=key)
        alone = mx.concatenate([x[:, i : i + 1] @ w.T for i in range(rows)], axis=1)
        if not mx.array_equal(x @ w.T, alone).item():
            return False
    return True


@pytest.mark.parametrize("cached", [40, 30, 10])  # all select; the first two do not; none does
@pytest.mark.parametrize("tied", [False, True])
def test_a_verify_forward_attends_as_decoding_does(sparse, cached, tied):
    """Four positions in one verify forward against four one-token forwards of mlx-lm: the
    same output, bit for bit, also where every index score ties and only the selection's
    tie-breaking decides which keys a query sees."""
    if not _rows_alike(LAYER_PRODUCTS):
        pytest.skip("this machine's products round a row differently among several")
    model = sparse
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


def test_a_verify_forward_of_such_a_target_has_decodings_bits():
    """Forwards over 4 and 16 positions, before the selection starts and past it, against
    mlx-lm's one-token steps: every position's logits bit for bit. Any other rounding
    anywhere in the forward (a SwiGLU's exps) would become other keys selected later."""
    if not _rows_alike(TARGET_PRODUCTS):
        pytest.skip("this machine's products round a row among several otherwise than alone")
    model = near_tie_target(0)
    target, tokens = TargetAdapter(model), [(5 * i + 1) % 14 for i in range(68)]
    decoding = make_prompt_cache(model)
    model(mx.array([tokens[:20]]), cache=decoding)
    expected = [model(mx.array([[t]]), cache=decoding)[0, -1] for t in tokens[20:]]
    for block in (4, 16):
        cache = target.make_cache()
        target.forward(mx.array([tokens[:20]]), [cache], prompt=True)
        logits = [
            row
            for start in range(20, 68, block)
            for row in target.forward(mx.array([tokens[start : start + block]]), [cache]).logits[0]
        ]
        differing = [
            20 + i
            for i, (a, b) in enumerate(zip(logits, expected))
            if not mx.array_equal(a, b).item()
        ]
        assert differing == [], f"block {block}: positions {differing} round otherwise"


class PartlyRight(OracleDraft):
    """The target's greedy continuation with every fifth position of the sequence wrong: runs of
    accepted drafts of every length, so every row of a verify forward decides a token."""

    def block_logits(self, block, embed, lm_head, cache):
        start, vocab = cache[0].offset, self.config.vocab_size
        positions = np.arange(start + 1, start + block.shape[0])
        truth = np.array(self.sequence)[positions]
        drafts = np.where(positions % 5 == 0, (truth + 1) % vocab, truth)
        return 100.0 * mx.eye(vocab)[mx.array(drafts)]


def near_tie_target(seed: int) -> nn.Module:
    module = FAMILIES["glm_moe_dsa"][0]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({"model_type": "glm_moe_dsa", **NEAR_TIES}))
    mx.random.seed(seed)
    normal = lambda p: mx.random.normal(p.shape) * p.shape[-1] ** -0.5 if p.ndim > 1 else p  # noqa: E731
    model.update(tree_map(normal, model.parameters()))
    rare = mx.concatenate([mx.ones((14, 1)), mx.full((2, 1), 0.1)])
    model.lm_head.weight = 4.0 * rare * model.lm_head.weight
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda seed: f"seed{seed}")
def near_ties(request):
    """(a glm_moe_dsa target of 16 tokens whose top two often nearly tie, its prompt, a random
    drafter, a partly right one, mlx-lm's greedy reply), per seed."""
    seed = request.param
    model = near_tie_target(seed)
    prompt = [(7 * i + 3 + seed) % 14 for i in range(20)]
    expected = reference_greedy(model, prompt, MAX_TOKENS, set())
    assert len(set(expected)) > 8, "a degenerate random model proves little"
    draft = init_draft(model, num_layers=2, block_size=16, seed=seed)
    return model, prompt, draft, PartlyRight(draft, prompt + expected + [0] * 16), expected


@pytest.mark.parametrize("block_size", [4, 8, 16], ids=lambda block: f"block{block}")
def test_greedy_equals_mlx_lm_token_for_token_where_top_tokens_nearly_tie(
    near_ties, tokenizer, block_size
):
    """Blocks that cross the selection size, then select, in chains whose drafts are rejected
    at once (a random drafter) or accepted in runs of every length: mlx-lm's one-token decoding
    token for token, whatever the margin between its top two tokens."""
    model, prompt, draft, partly_right, expected = near_ties
    for drafter in (draft, partly_right):
        tokens, responses = run(
            model, drafter, tokenizer, prompt, block_size=block_size, max_tokens=MAX_TOKENS
        )
        assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.accepted for r in responses) > MAX_TOKENS // 2  # the partly right drafter's


def test_greedy_and_verify_bits_equal_decodings_on_mlx_own_blas():
    """The same on MLX's bundled BLAS (a program that imports mlx before dflash_mlx), whose
    products of several rows round each row as alone: seed 0 at blocks 4 and 16 there once gave
    another token than mlx-lm's decoding at 43 (context 63); and the verify forward's bits."""
    if os.environ.get("DFLASH_MLX_NO_BLAS"):
        pytest.skip("this process is on MLX's BLAS already")
    wanted = "(nearly_tie and seed0 and (block4 or block16)) or bits"
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, __file__, "-k", wanted],
        env={**os.environ, "DFLASH_MLX_NO_BLAS": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout[-3000:]
