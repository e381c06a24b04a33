"""muse_spark, the family whose mlx-lm model runs fused Metal kernels (`mlx_lm/kernels`): a tiny
random config with mlx-lm's own kernel bodies run on the CPU by the MSL emulator (tests/msl_emu),
greedy DFlash output equal to mlx-lm's token for token, every rollback depth lossless, trees
refused in one line."""

import importlib
import os

import mlx.core as mx
import msl_emu
import pytest
import test_families as families
from helpers import reference_greedy
from mlx_lm.models import muse_spark
from mlx_lm.models.cache import KVCache, RotatingKVCache
from test_families import PROMPT, NoisyOracleDraft, first_difference, run
from test_generate import OracleDraft

from dflash_mlx import stream_generate
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.rollback import WindowKVCache
from dflash_mlx.models.target import TargetAdapter

NO_COMPILER = "no clang with _Float16/__bf16 (apt-get install clang-19 libclang-rt-19-dev)"
# Skipped on a developer's machine without clang; under CI=true they run, and fail.
pytestmark = pytest.mark.skipif(
    msl_emu.find_compiler() is None and os.environ.get("CI") != "true", reason=NO_COMPILER
)

KERNELS = [
    "expert_routing",
    "norm_add_norm",
    "post_expert_norm_combine",
    "qk_norm",
    "qk_norm_rope",
    "rms_norm_sigmoid_gate",
]
SLIDING, FULL = "sliding_attention", "full_attention"
TEXT = dict(  # sliding (window 8, RoPE) and global (NoPE) layers, MoE in every layer
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=families.VOCAB,
    rms_norm_eps=1e-6,
    post_norm_eps=1e-6,
    rope_parameters={"rope_theta": 50000.0},
    layer_rope_theta=[50000.0, 0.0, 50000.0],
    layer_types=[SLIDING, FULL, SLIDING],
    sliding_window=8,
    final_logit_softcapping=30.0,
    output_multiplier=1.0,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_hidden_size=32,
    moe_intermediate_size=48,
)
KERNEL_FAMILIES = {"muse_spark": (muse_spark, dict(text_config=TEXT))}
MAX_TOKENS = 40  # each kernel call is a process: ~0.3 s a forward


@pytest.fixture(scope="module")
def emulated_kernels():
    """mlx-lm's Metal kernels made by the emulator's `metal_kernel` (the modules reloaded with
    it, so that the model's imported functions call emulated kernels), put back afterwards."""
    modules = [importlib.import_module(f"mlx_lm.kernels.{name}") for name in KERNELS]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx.fast, "metal_kernel", msl_emu.metal_kernel)
        for module in modules:
            importlib.reload(module)
        yield
    for module in modules:
        importlib.reload(module)


@pytest.fixture(scope="module")
def spark(emulated_kernels):
    """(model, random 2-layer drafter, mlx-lm's greedy continuation of PROMPT)."""
    model = families.build("muse_spark", families=KERNEL_FAMILIES)
    draft = init_draft(model, num_layers=2, block_size=16)
    expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
    assert len(set(expected)) > MAX_TOKENS // 3, "a degenerate random model proves little"
    return model, draft, expected


tokenizer = families.tokenizer  # its fixture, shared


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_mlx_lm(spark, tokenizer, block_size):
    model, draft, expected = spark
    tokens, responses = run(
        model, draft, tokenizer, PROMPT, block_size=block_size, max_tokens=MAX_TOKENS
    )
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.accepted for r in responses) < sum(r.proposed for r in responses)


def test_oracle_is_fully_accepted_and_every_rollback_depth_is_lossless(spark, tokenizer):
    model, draft, expected = spark
    continuation = reference_greedy(model, PROMPT, MAX_TOKENS + 16, set())
    oracle = OracleDraft(draft, PROMPT + continuation)
    tokens, responses = run(model, oracle, tokenizer, PROMPT, block_size=16, max_tokens=MAX_TOKENS)
    assert tokens == expected
    assert all(r.accepted == r.proposed for r in responses)

    noisy = NoisyOracleDraft(draft, PROMPT + continuation)
    tokens, responses = run(model, noisy, tokenizer, PROMPT, block_size=4, max_tokens=MAX_TOKENS)
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert {r.accepted for r in responses[1:-1]} == set(range(4))


def test_caches_are_replaced_the_head_found_and_embeddings_normalised(spark):
    model, draft, _ = spark
    target = TargetAdapter(model)
    native = model.make_cache()
    assert [type(c) for c in target.make_cache()] == [
        WindowKVCache if type(c) is RotatingKVCache else KVCache for c in native
    ]
    assert target.head is model.lm_head
    ids = mx.array([[5, 9, 33]])
    assert mx.array_equal(target.embed_tokens(ids), model.model.language_model.embed(ids))


def test_trees_are_refused_in_one_line(spark, tokenizer):
    model, draft, _ = spark
    with pytest.raises(ValueError, match="'muse_spark'.*rotates queries and keys in a fused"):
        next(stream_generate(model, draft, tokenizer, PROMPT, tree_budget=4))
