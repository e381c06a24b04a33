"""The recurrent target families of the published drafters (LFM2, LFM2-MoE, Nemotron-H, Kimi-K3):
tiny random configs of the very mlx-lm classes, the tapped layers covering every layer kind, and
`tests/test_families.py`'s checks run on them (greedy equal to mlx-lm's, an oracle fully accepted,
every rollback depth lossless, a prompt cache across turns), plus each kind of recurrent state
equal to single-token decoding's after a rollback, and trees refused in one line."""

from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
import test_families as families
import test_muse_spark
from helpers import reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.models import kimi_k3, lfm2, lfm2_moe, nemotron_h
from mlx_lm.models.cache import ArraysCache, KVCache
from test_families import BASE, DEEPSEEK_V3, FAMILIES, PROMPT, prompt_of

from dflash_mlx import stream_generate
from dflash_mlx.decode.adaptive import Plan
from dflash_mlx.decode.plan import FixedPlan
from dflash_mlx.decode.scheduler import make_batch
from dflash_mlx.models.rollback import RecurrentCache
from dflash_mlx.models.target import SUPPORTED_MODEL_TYPES, TargetAdapter

LFM2 = dict(  # layers 0, 2, 3 short convolutions, 1 and 4 attention (LFM2: 10 of 16 convolutions)
    BASE,
    norm_eps=1e-5,
    conv_bias=False,
    conv_L_cache=3,
    block_dim=64,
    block_ff_dim=96,
    block_multiple_of=1,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False,
    layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
)


def with_random_routers(module):
    """mlx-lm's `module`, its Model made with random weights where mlx-lm starts from zeros
    (Nemotron-H's router), so that the tiny model sends tokens to different experts."""

    def model(args):
        made = module.Model(args)
        zeros = [(k, v) for k, v in tree_flatten(made.parameters()) if v.ndim >= 2 and not v.any()]
        made.load_weights([(k, mx.random.normal(v.shape)) for k, v in zeros], strict=False)
        return made

    return SimpleNamespace(Model=model, ModelArgs=module.ModelArgs)


KDA = dict(num_heads=4, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0)
RECURRENT = {
    "lfm2": (lfm2, LFM2),
    "lfm2_moe": (  # layers 0 and 1 dense, MoE from layer 2
        lfm2_moe,
        dict(
            LFM2,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            use_expert_bias=True,
            num_dense_layers=2,
        ),
    ),
    "nemotron_h": (  # Mamba, attention, MoE and MLP layers; caches only for Mamba and attention
        with_random_routers(nemotron_h),
        dict(
            BASE,
            hybrid_override_pattern=["M", "*", "E", "-", "M", "*", "M"],
            attention_bias=False,
            mamba_num_heads=4,
            mamba_head_dim=16,
            mamba_proj_bias=False,
            ssm_state_size=16,
            conv_kernel=4,
            n_groups=2,
            mlp_bias=False,
            layer_norm_epsilon=1e-5,
            use_bias=False,
            use_conv_bias=True,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        ),
    ),
    "kimi_k3": (  # layers 0, 2, 3 Kimi delta attention, 1 and 4 MLA; attention residuals
        kimi_k3,
        dict(
            text_config=dict(
                DEEPSEEK_V3,
                linear_attn_config=dict(KDA, kda_layers=[1, 3, 4]),
                num_experts=4,
                num_experts_per_token=2,
                num_shared_experts=1,
                first_k_dense_replace=2,  # layers 0 and 1 dense
                attn_res_block_size=2,
            )
        ),
    ),
}
# the drafter's depth where 2 layers' taps would miss a layer kind (taps spread as published)
DRAFT_LAYERS = {"nemotron_h": 4}  # taps 1-4: attention, MoE, MLP, Mamba

RECURRENT_MIXERS = {
    "lfm2": lfm2.ShortConv,
    "lfm2_moe": lfm2_moe.ShortConv,
    "nemotron_h": nemotron_h.NemotronHMamba2Mixer,
    "kimi_k3": kimi_k3.KimiK3DeltaAttention,
}

tokenizer = families.tokenizer  # test_families' fixture, shared


@pytest.fixture(scope="module")
def family():
    return families.family_builder(RECURRENT, DRAFT_LAYERS)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(RECURRENT))
def test_greedy_equals_mlx_lm(family, tokenizer, name, block_size):
    families.test_greedy_equals_mlx_lm(family, tokenizer, name, block_size)


@pytest.mark.parametrize("name", list(RECURRENT))
def test_oracle_is_fully_accepted_and_every_rollback_depth_is_lossless(family, tokenizer, name):
    families.test_oracle_is_fully_accepted_and_every_rollback_depth_is_lossless(
        family, tokenizer, name
    )


@pytest.mark.parametrize("name", list(RECURRENT))
@pytest.mark.parametrize("accepted", [0, 3, 7])
def test_recurrent_rollback_leaves_the_state_after_the_last_committed_token(family, name, accepted):
    families.test_recurrent_rollback_leaves_the_state_after_the_last_committed_token(
        family, name, accepted
    )


@pytest.mark.parametrize("name", list(RECURRENT))
def test_prompt_cache_across_turns(family, tokenizer, name):
    families.test_prompt_cache_across_turns(family, tokenizer, name, goes_back=False)


def kinds(layer) -> set[str]:
    """The classes of a layer's parts: its mixer (attention, convolution, SSM), its MLP or MoE."""
    return {type(m).__name__ for m in layer.values() if isinstance(m, nn.Module)} - {"RMSNorm"}


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_caches_are_replaced_and_taps_span_every_layer_kind(family, name):
    model, draft, _ = family(name)
    target = TargetAdapter(model)
    native, cache = model.make_cache(), target.make_cache()
    assert [type(c) for c in cache] == [
        RecurrentCache if type(c) is ArraysCache else KVCache for c in native
    ]
    assert {RecurrentCache, KVCache} == {type(c) for c in cache}
    layers = target.layers
    tapped = set().union(*(kinds(layers[i]) for i in draft.config.target_layer_ids))
    assert tapped == set().union(*(kinds(layer) for layer in layers))
    assert RECURRENT_MIXERS[name].__name__ in tapped
    # each recurrent cache is checkpointed by the module it is passed to
    recurrent = [m for layer in layers for m in layer.values() if type(m) is RECURRENT_MIXERS[name]]
    assert [id(m) for m in target.recurrent_mixers] == [id(m) for m in recurrent]


@pytest.mark.parametrize("name", list(RECURRENT))
def test_trees_are_refused_in_one_line(family, tokenizer, name):
    model, draft, _ = family(name)
    with pytest.raises(ValueError, match=f"'{name}'.*its recurrent layers cannot keep"):
        next(stream_generate(model, draft, tokenizer, PROMPT, tree_budget=4))


# kimi_k3's MLA masks its scores with the mask itself, which no row-by-row attention hands
# it: its shared cycle fails to launch and its replies take turns
SHARING = {
    **{name: family for name, family in RECURRENT.items() if name != "kimi_k3"},
    "qwen3_5": FAMILIES["qwen3_5"],
    "qwen3_next": FAMILIES["qwen3_next"],
}


@pytest.mark.parametrize("name", list(SHARING))
def test_replies_share_cycles_and_each_is_its_own(tokenizer, name):
    """Three replies of one batch verify in shared cycles (3 drafts a row), every recurrent
    state stacked for the forward and each row rolled back as far as it rejected: each
    reply is mlx-lm's greedy one."""
    model, draft, _ = families.family_builder(SHARING, DRAFT_LAYERS)(name)
    prompts = [PROMPT, prompt_of(len(PROMPT), 1), prompt_of(len(PROMPT) - 5, 2)]
    batch = make_batch(model, draft)
    batch.widths.policy = lambda reply, rows: FixedPlan(Plan(3))
    generators = [
        stream_generate(model, draft, tokenizer, p, max_tokens=24, block_size=4, batch=batch)
        for p in prompts
    ]
    replies = [[] for _ in prompts]
    while generators:
        for i, g in list(enumerate(generators)):
            r = next(g, None)
            if r is None:
                generators[i] = None
            else:
                replies[i].append(r)
        generators = [g for g in generators if g is not None]
    for prompt, responses in zip(prompts, replies):
        expected = reference_greedy(model, prompt, 24, set())
        assert [t for r in responses for t in r.tokens] == expected
        assert responses[-1].drafting.shared > 0


def test_every_supported_family_is_tested():
    tested = set(families.FAMILIES) | set(RECURRENT) | set(test_muse_spark.KERNEL_FAMILIES)
    assert set(SUPPORTED_MODEL_TYPES) == tested
