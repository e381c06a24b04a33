"""Every published drafter's target family: tiny random configs of the very mlx-lm class the
real checkpoint loads into, greedy DFlash output equal to mlx-lm's own token for token."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.models import (
    deepseek_v41,
    gemma4,
    gemma4_text,
    glm_moe_dsa,
    gpt_oss,
    kimi_k25,
    laguna,
    llama,
    llama4,
    minimax,
    minimax_m3_vl,
    muse_glimmer,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_generate import OracleDraft

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.hooks import feature
from dflash_mlx.models.rollback import (
    CacheGroup,
    ChunkCache,
    CompressedWindowCache,
    RecurrentCache,
    WindowKVCache,
    trim_caches,
)
from dflash_mlx.models.target import SUPPORTED_MODEL_TYPES, TargetAdapter

VOCAB = 320  # the tiny tokenizer's 300 tokens + padded rows
MAX_TOKENS = 300
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_theta=50000.0,
    tie_word_embeddings=False,
)
QWEN_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
)
GATED_DELTA = dict(  # layers 0, 2, 4 recurrent, 1 and 3 full attention (Qwen3.5: 3 of 4 recurrent)
    BASE,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    partial_rotary_factor=0.25,
)
GEMMA4 = dict(  # layers 0, 1, 3, 4 sliding (window 16), 2 full
    BASE,
    global_head_dim=32,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    sliding_window=16,
    sliding_window_pattern=3,
    attention_k_eq_v=True,
    use_double_wide_mlp=False,
)
DEEPSEEK_V3 = dict(  # MLA attention, MoE from layer 1
    BASE,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
GPT_OSS_LAYERS = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
SLIDING, FULL = "sliding_attention", "full_attention"
GLM_DSA = dict(  # MLA + a sparse-attention indexer picking 48 keys a query; layer 1 dense, 2-4 MoE
    DEEPSEEK_V3,
    first_k_dense_replace=2,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=48,
    routed_scaling_factor=1.0,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    moe_layer_freq=1,
    attention_bias=False,
    rope_parameters={"rope_theta": 50000.0, "rope_type": "default"},
)
MINIMAX_M3 = dict(  # block-sparse attention (3 of blocks of 8 keys) but layers 1 and 4
    BASE,
    dense_intermediate_size=96,
    shared_intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["sparse_attention", FULL, "sparse_attention", "sparse_attention", FULL],
    mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"],
    index_n_heads=2,
    index_head_dim=16,
    index_block_size=8,
    index_topk_blocks=3,
)
LLAMA4 = dict(  # chunks of 8 positions; layer 3 global (NoPE); odd layers MoE
    BASE,
    model_type="llama4_text",
    num_hidden_layers=6,
    attention_bias=False,
    attention_chunk_size=8,
    interleave_moe_layer_step=2,
    intermediate_size_mlp=96,
    num_local_experts=4,
    num_experts_per_tok=1,
    rope_scaling=None,
    use_qk_norm=True,
)
MUSE_GLIMMER = dict(  # sliding (window 16, RoPE) and global (NoPE) layers
    BASE,
    sliding_window=16,
    post_norm_eps=1e-6,
    layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
)
LAGUNA = dict(  # sliding (window 8) and full layers with their own RoPEs; MoE from layer 1
    BASE,
    sliding_window=8,
    layer_types=[FULL, SLIDING, FULL, SLIDING, SLIDING],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    rope_parameters={
        FULL: {"rope_theta": 50000.0, "partial_rotary_factor": 0.5},
        SLIDING: {"rope_theta": 10000.0},
    },
)
DEEPSEEK_V41 = dict(  # hyper-connections (4 streams); window 8; groups of 4 positions compressed
    BASE,  # by layers 0 and 3, their index keys scored by 0, 2 and 3 (candidate blocks from 0);
    num_hidden_layers=6,  # 1 and 5 window only
    head_dim=32,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    o_groups=2,
    o_lora_rank=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    compress_ratios=[4, 0, 4, 4, 4, 0],
    kv_source_layer_ids=[0, 3],
    index_source_layer_ids=[0, 2, 3],
    candidate_source_layer_id=0,
    candidate_topk_blocks=3,
    candidate_block_size=2,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
    hc_sinkhorn_iters=3,  # published: 20; 3 normalise alike at a fraction of the CPU time
)

# model_type -> (mlx-lm module, ModelArgs fields)
FAMILIES = {
    "llama": (llama, BASE),
    "qwen3": (qwen3, dict(BASE, tie_word_embeddings=True)),
    "qwen3_moe": (qwen3_moe, dict(BASE, **QWEN_MOE)),
    "qwen3_5": (qwen3_5, dict(text_config=dict(GATED_DELTA, tie_word_embeddings=True))),
    "qwen3_5_moe": (qwen3_5_moe, dict(text_config=dict(GATED_DELTA, **QWEN_MOE))),
    "qwen3_next": (qwen3_next, dict(GATED_DELTA, **QWEN_MOE)),
    "gpt_oss": (
        gpt_oss,
        dict(
            BASE,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=GPT_OSS_LAYERS,
        ),
    ),
    "gemma4_text": (gemma4_text, GEMMA4),
    "gemma4": (  # the multimodal wrapper, MoE, K/V of the last two layers shared
        gemma4,
        dict(
            vocab_size=VOCAB,
            text_config=dict(
                GEMMA4,
                enable_moe_block=True,
                num_experts=4,
                top_k_experts=2,
                moe_intermediate_size=32,
                attention_k_eq_v=False,
                num_kv_shared_layers=2,
            ),
        ),
    ),
    "kimi_k25": (kimi_k25, dict(text_config=DEEPSEEK_V3)),
    "minimax": (
        minimax,
        dict(
            BASE,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=0,
            rotary_dim=8,
        ),
    ),
    "glm_moe_dsa": (glm_moe_dsa, GLM_DSA),
    "minimax_m3_vl": (minimax_m3_vl, dict(text_config=MINIMAX_M3)),
    "llama4": (llama4, dict(text_config=LLAMA4)),
    "muse_glimmer": (muse_glimmer, MUSE_GLIMMER),
    "laguna": (laguna, LAGUNA),
    "deepseek_v41": (deepseek_v41, DEEPSEEK_V41),
}


def build(name: str, seed: int = 0, fields: dict | None = None, families: dict = FAMILIES):
    """The mlx-lm Model for a family of `families` (`fields` replace its ModelArgs), with a
    larger-than-default init (as helpers.save_target) so the tiny random model has peaked,
    non-degenerate outputs. Matrices mlx-lm starts at zero (routers, hyper-connection mixes)
    get random values too, so that every path is exercised."""
    module, default_fields = families[name]
    fields = default_fields if fields is None else fields
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({"model_type": name, **fields}))
    params = tree_flatten(model.parameters())
    model.load_weights([(k, _scaled(v)) for k, v in params])
    mx.eval(model.parameters())
    return model


def _scaled(v: mx.array) -> mx.array:
    if v.ndim < 2:
        return v
    if not mx.any(v).item():
        return mx.random.uniform(-1.0, 1.0, v.shape) * 4.0 / v.shape[-1] ** 0.5
    return v * 4.0


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 300, size=length).tolist()


def family_builder(families: dict = FAMILIES, draft_layers: dict[str, int] | None = None):
    """(model, random drafter, mlx-lm's greedy continuation of PROMPT) per family of `families`,
    built once; the drafter has 2 layers, or `draft_layers[name]` (taps spread as published)."""
    built = {}

    def get(name: str):
        if name not in built:
            model = build(name, families=families)
            layers = (draft_layers or {}).get(name, 2)
            draft = init_draft(model, num_layers=layers, block_size=16)
            expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
            assert len(set(expected)) > 50, "a degenerate random model proves little"
            built[name] = model, draft, expected
        return built[name]

    return get


@pytest.fixture(scope="module")
def family():
    return family_builder()


@pytest.fixture(scope="module")
def tokenizer(loaded):
    """The tiny tokenizer without an EOS, so that every run is MAX_TOKENS long."""
    wrapper = TokenizerWrapper(loaded("llama-tied-gqa")[1]._tokenizer)
    wrapper.eos_token_ids = []
    return wrapper


PROMPT = prompt_of(21, seed=0)


def run(model, draft, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kwargs))
    return [t for r in responses for t in r.tokens], responses


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


# a short block and the drafters' own; block 8, with every rollback depth, is the
# noisy-oracle test's
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_mlx_lm(family, tokenizer, name, block_size):
    model, draft, expected = family(name)
    tokens, responses = run(
        model, draft, tokenizer, PROMPT, block_size=block_size, max_tokens=MAX_TOKENS
    )
    assert len(tokens) == MAX_TOKENS
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.accepted for r in responses) < sum(r.proposed for r in responses)


class NoisyOracleDraft(OracleDraft):
    """The true continuation with one token wrong at a pseudo-random place (or none), so that
    every cycle rolls back a different number of positions, 0 to block_size - 1."""

    def block_logits(self, block, embed, lm_head, cache):
        start, n = cache[0].offset, block.shape[0] - 1
        truth = self.sequence[start + 1 : start + 1 + n]
        wrong = int(np.random.default_rng(start).integers(0, n + 1))
        if wrong < n:
            truth[wrong] = (truth[wrong] + 1) % self.config.vocab_size
        return 100.0 * mx.eye(self.config.vocab_size)[mx.array(truth)]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_oracle_is_fully_accepted_and_every_rollback_depth_is_lossless(family, tokenizer, name):
    model, draft, expected = family(name)
    oracle = OracleDraft(draft, PROMPT + expected)
    tokens, responses = run(model, oracle, tokenizer, PROMPT, block_size=16, max_tokens=MAX_TOKENS)
    assert tokens == expected
    assert all(r.accepted == r.proposed for r in responses)
    assert len(responses) == 1 + -(-(MAX_TOKENS - 1) // 16)

    noisy = NoisyOracleDraft(draft, PROMPT + expected)
    tokens, responses = run(model, noisy, tokenizer, PROMPT, block_size=8, max_tokens=MAX_TOKENS)
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert {r.accepted for r in responses[1:-1]} == set(range(8))


@pytest.mark.parametrize(
    "name, special, ours",
    [
        ("qwen3_5", ArraysCache, RecurrentCache),
        ("qwen3_5_moe", ArraysCache, RecurrentCache),
        ("qwen3_next", ArraysCache, RecurrentCache),
        ("gpt_oss", RotatingKVCache, WindowKVCache),
        ("gemma4_text", RotatingKVCache, WindowKVCache),
        ("gemma4", RotatingKVCache, WindowKVCache),
        ("muse_glimmer", RotatingKVCache, WindowKVCache),
        ("laguna", RotatingKVCache, WindowKVCache),
        ("llama4", ChunkedKVCache, ChunkCache),
    ],
)
def test_caches_are_replaced_and_taps_span_both_layer_kinds(family, name, special, ours):
    model, draft, _ = family(name)
    native = model.make_cache()
    cache = TargetAdapter(model).make_cache()
    assert [type(c) for c in cache] == [ours if type(c) is special else KVCache for c in native]
    tapped = {type(cache[i]) for i in draft.config.target_layer_ids}
    assert tapped == {ours, KVCache}
    windows = {c.max_size for c in native if type(c) is RotatingKVCache}
    assert all(8 <= w <= 32 for w in windows)


@pytest.mark.parametrize(
    "name, kinds",
    [
        ("glm_moe_dsa", {(KVCache, KVCache)}),  # MLA latents and indexer keys in every layer
        ("minimax_m3_vl", {(KVCache,), (KVCache, KVCache)}),  # dense and block-sparse layers
    ],
)
def test_cache_lists_become_groups_and_taps_span_their_kinds(family, name, kinds):
    model, draft, _ = family(name)
    cache = TargetAdapter(model).make_cache()
    assert all(type(c) is CacheGroup for c in cache)
    taps = draft.config.target_layer_ids
    assert {tuple(type(part) for part in cache[i].caches) for i in taps} == kinds


def test_deepseek_v41_caches_and_taps_span_window_and_compressed_layers(family):
    model, draft, _ = family("deepseek_v41")
    target = TargetAdapter(model)
    assert all(type(c) is CompressedWindowCache for c in target.make_cache())
    taps = draft.config.target_layer_ids
    assert {hasattr(model.layers[i].self_attn, "compressor") for i in taps} == {True, False}
    assert target.checkpointed == [model.layers[i].self_attn.compressor for i in (0, 3)]


def test_a_multi_stream_layer_is_captured_as_the_mean_of_its_streams(family):
    model, _, _ = family("deepseek_v41")
    streams = mx.random.normal((1, 3, 4, 64))
    assert mx.array_equal(feature((streams, mx.zeros((1, 3, 4)))), streams.mean(axis=2))
    target, cache = TargetAdapter(model), TargetAdapter(model).make_cache()
    features = target.forward(mx.array(PROMPT)[None], [cache], taps=[1], prompt=True).features
    assert features.shape == (1, len(PROMPT), 64)
    assert not mx.allclose(features, model.model.embed_tokens(mx.array(PROMPT)[None]))


def test_muse_glimmer_drafter_embeds_as_its_first_layer_sees(family):
    target = TargetAdapter(family("muse_glimmer")[0])
    ids = mx.array([[5, 9, 33]])
    h = target.embed_tokens(ids)
    assert mx.allclose(h, mx.fast.rms_norm(target.embedding(ids), None, 1e-6))
    assert mx.allclose((h * h).mean(axis=-1), mx.ones((1, 3)), atol=1e-4)


@pytest.mark.parametrize("accepted", [0, 2, 5, 7])
def test_compressed_cache_rollback_equals_the_cache_of_the_kept_positions(family, accepted):
    """A block that crosses two group boundaries (groups of 4), rolled back to every kind of
    place: the window, the compressed groups, their index keys and the open group's rows
    equal those of a plain forward over the kept positions."""
    model, _, expected = family("deepseek_v41")
    target = TargetAdapter(model)
    block = expected[:8]  # from position 21: closes the groups at 24 and 28
    cache, reference = target.make_cache(), target.make_cache()
    target.forward(mx.array(PROMPT)[None], [cache], prompt=True)
    target.rollback(cache, 0)
    target.forward(mx.array(block)[None], [cache], prompt=True)
    target.rollback(cache, len(block) - accepted - 1)
    model(mx.array(PROMPT + block[: accepted + 1])[None], cache=reference)
    for ours, plain in zip(cache, reference):
        assert ours.offset == plain.offset == len(PROMPT) + accepted + 1
        for a, b in zip(ours.state[:-1], plain.state[:-1]):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4), (a.shape, b.shape)


def test_chunked_cache_goes_back_only_while_its_chunk_is_held():
    cache = ChunkCache(chunk_size=8)
    keys = mx.zeros((1, 1, 21, 4))
    cache.update_and_fetch(keys, keys)
    cache.maybe_trim_front()  # as llama4 does before a forward: holds positions 13..20
    assert cache.start_position == 13
    assert cache.can_trim(4) and not cache.can_trim(6)  # 17 is in the chunk of 16; 15 is not
    assert trim_caches([cache], 15) == 0 and cache.offset == 0


def test_wrapped_models_use_their_language_model_head_and_gemma_its_scaled_input(family):
    for name in ("qwen3_5_moe", "kimi_k25", "gemma4"):
        model = family(name)[0]
        assert TargetAdapter(model).lm_head is model.language_model.lm_head
    target = TargetAdapter(family("gemma4")[0])
    ids = mx.array([[5, 9, 33]])
    assert mx.array_equal(target.embed_tokens(ids), target.embedding(ids) * 8.0)  # sqrt(hidden)
    assert target.max_context == 4096
    assert set(FAMILIES) <= set(SUPPORTED_MODEL_TYPES)
    # Families are mlx-lm's modules: a model_type it remaps (gemma4_unified -> gemma4) is one too.
    unified = gemma4.Model(gemma4.ModelArgs.from_dict(FAMILIES["gemma4"][1]))
    unified.model_type = "gemma4_unified"
    adapter = TargetAdapter(unified)
    assert adapter.embed_scale == 8.0
    assert {type(c) for c in adapter.make_cache()} == {WindowKVCache, KVCache}


def test_window_cache_holds_what_autoregressive_decoding_holds_across_the_wrap():
    """Random K/V streams: blocks + rollbacks vs one position at a time in mlx-lm's
    RotatingKVCache; the `window` newest positions must be identical after every cycle."""
    window, rng = 8, np.random.default_rng(0)
    stream = mx.array(rng.normal(size=(1, 2, 200, 4)).astype(np.float32))
    ours, reference = WindowKVCache(window), RotatingKVCache(max_size=window)
    ours.update_and_fetch(stream[..., :5, :], stream[..., :5, :])
    for p in range(5):
        reference.update_and_fetch(stream[..., p : p + 1, :], stream[..., p : p + 1, :])
    while ours.offset < 180:
        block = int(rng.integers(1, 17))
        start = ours.offset
        rejected = mx.array(rng.normal(size=(1, 2, block, 4)).astype(np.float32))
        verify = mx.concatenate([stream[..., start : start + 1, :], rejected[..., 1:, :]], axis=2)
        keys, _ = ours.update_and_fetch(verify, verify)
        assert keys.shape[2] == min(start, window - 1) + block  # nothing a query sees is evicted
        ours.trim(block - 1)  # only the first position (the committed token) stays
        reference.update_and_fetch(
            stream[..., start : start + 1, :], stream[..., start : start + 1, :]
        )
        keys, _ = ours.update_and_fetch(stream[..., start + 1 : start + 2, :], stream[..., :1, :])
        ours.trim(1)
        expected = reference._temporal_order(reference.keys)[..., -min(start + 1, window) :, :]
        visible = keys[..., -1 - min(start + 1, window - 1) : -1, :]
        assert mx.array_equal(visible, expected[..., -visible.shape[2] :, :])
    assert not ours.can_trim(window) and ours.can_trim(ours.offset)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("accepted", [0, 3, 7])
def test_recurrent_rollback_leaves_the_state_after_the_last_committed_token(family, name, accepted):
    model, _, expected = family(name)
    target = TargetAdapter(model)
    truth = expected[: accepted + 2]
    block = truth[: accepted + 1] + [(truth[-1] + 1) % VOCAB] * (7 - accepted)
    cache, reference = target.make_cache(), target.make_cache()
    target.forward(mx.array(PROMPT)[None], [cache], prompt=True)
    target.forward(mx.array(block)[None], [cache], prompt=True)
    target.rollback(cache, len(block) - accepted - 1)
    model(mx.array(PROMPT)[None], cache=reference)
    for t in truth[: accepted + 1]:
        model(mx.array([[t]]), cache=reference)
    for ours, ar in zip(cache, reference):
        assert ours.offset == ar.offset == len(PROMPT) + accepted + 1
        if isinstance(ours, RecurrentCache):
            for a, b in zip(ours.cache, ar.cache):
                # |state| ~ 10; a verify's matmuls over 8 rows differ from 1-row ones by ~1e-5
                assert mx.allclose(a, b, rtol=1e-4, atol=1e-4)
    target.forward(mx.array([[5, 6]]), [cache], prompt=True)
    recurrent = [c for c in cache if isinstance(c, RecurrentCache)]
    assert all(c.can_trim(1) for c in recurrent)
    model(mx.array([[7]]), cache=cache)  # mlx-lm's own forward: its snapshot is now stale
    assert not any(c.can_trim(1) for c in recurrent)


def test_hooks_are_per_instance_and_removed_after_every_forward(family, tokenizer):
    model, draft, expected = family("qwen3_5")
    twin = build("qwen3_5")
    modules = list(model.modules())
    classes = [type(m) for m in modules]
    call = qwen3_5.DecoderLayer.__call__
    gen = stream_generate(model, draft, tokenizer, PROMPT, max_tokens=40)
    tokens = list(next(gen).tokens)
    assert [type(m) for m in modules] == classes  # between forwards: mlx-lm's own classes
    assert qwen3_5.DecoderLayer.__call__ is call
    assert reference_greedy(twin, PROMPT, 40, set()) == expected[:40]  # another instance: untouched
    tokens += [t for r in gen for t in r.tokens]
    assert tokens == expected[:40]  # its tapped layers recorded, its mixers checkpointed
    assert [type(m) for m in modules] == classes


@pytest.mark.parametrize(
    "name, goes_back",
    [
        ("qwen3_5", False),  # recurrent
        ("gpt_oss", False),  # sliding window
        ("llama4", False),  # chunked
        ("deepseek_v41", False),  # sliding window, compressed groups
        ("glm_moe_dsa", True),  # cache groups of plain KV caches
        ("minimax_m3_vl", True),
    ],
)
def test_prompt_cache_across_turns(family, tokenizer, name, goes_back):
    """Follow-up turns reuse the cache, also after a reply cut short; an edited history that a
    recurrent, windowed or compressed cache cannot go back to is prefilled again. All
    lossless."""
    model, draft, _ = family(name)
    cache = make_prompt_cache(model, draft)
    first = prompt_of(30, seed=3)
    gen = stream_generate(model, draft, tokenizer, first, max_tokens=200, prompt_cache=cache)
    cut = [t for _, r in zip(range(4), gen) for t in r.tokens]
    gen.close()
    second = first + cut + prompt_of(5, seed=4)
    for prompt, reused in ((second, len(first + cut) - 1), (first[:12], 11 * goes_back)):
        assert cache.reuse(prompt) == reused
        expected = reference_greedy(model, prompt, 40, set())
        assert (
            run(model, draft, tokenizer, prompt, max_tokens=40, prompt_cache=cache)[0] == expected
        )
        assert all(c.offset == len(cache.tokens) for c in cache.target + cache.draft)
