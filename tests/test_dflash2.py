"""DFlash 2 drafters: the published layout loads, converts and generates losslessly; the
convolution, the sliding-window rule and the candidate selector follow the reference."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import (
    DFLASH2,
    propose_one,
    read_config,
    reference_greedy,
    rows_equal_each_alone,
    save_draft,
)
from mlx.utils import tree_flatten
from test_sampling import SIGNIFICANCE, chi2_pvalue

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.cli.convert import convert_draft
from dflash_mlx.decode.sampling import Verdict, make_verifier
from dflash_mlx.models.draft import DFlashConfig, DFlashDraft, GroupedDynamicConv
from dflash_mlx.models.target import TargetAdapter

BLOCK = 8


@pytest.fixture(scope="module")
def dflash2_pair(make_pair, workdir):
    """(target dir, DFlash 2 drafter dir) per target variant."""
    built = {}

    def make(name: str):
        if name not in built:
            target, _ = make_pair(name)
            draft = save_draft(
                workdir / f"{name}-dflash2",
                read_config(target),
                target_layer_ids=[1, 3],
                block_size=BLOCK,
                dflash2=DFLASH2,
            )
            built[name] = (target, draft)
        return built[name]

    return make


def greedy_run(model, draft, tokenizer, prompt, max_tokens=40) -> list[int]:
    return [
        t
        for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens)
        for t in r.tokens
    ]


def test_published_layout_loads_strictly(dflash2_pair, tmp_path):
    _, draft_dir = dflash2_pair("qwen3-tied-gqa")
    stored = mx.load(str(draft_dir / "model.safetensors"))
    draft = load_draft(draft_dir)
    cfg = draft.config
    assert (cfg.block_size, cfg.conv_kernel_size, cfg.conv_group_size) == (BLOCK, 2, 16)
    assert (cfg.selector_top_k, cfg.selector_rank, cfg.is_causal) == (16, 8, False)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.5, 20.0)
    params = dict(tree_flatten(draft.parameters()))
    assert params.keys() == stored.keys()  # every tensor used, none missing
    for name, value in stored.items():
        assert mx.array_equal(params[name], value.astype(mx.float32)), name

    for broken in ("missing", "unexpected"):
        bad = tmp_path / broken
        bad.mkdir()
        (bad / "config.json").write_text((draft_dir / "config.json").read_text())
        weights = dict(stored)
        if broken == "missing":
            del weights["layers.1.mlp_conv.base_kernel"]
        else:
            weights["candidate_selector.extra_codebook"] = weights["norm.weight"]
        mx.save_safetensors(str(bad / "model.safetensors"), weights)
        with pytest.raises(ValueError, match=broken):
            load_draft(bad)


def test_dflash2_config_errors_name_the_field(dflash2_pair):
    _, draft_dir = dflash2_pair("qwen3-tied-gqa")
    config = read_config(draft_dir)
    no_conv = json.loads(json.dumps(config))
    del no_conv["dflash_config"]["conv_kernel_size"]
    with pytest.raises(ValueError, match="lacks dflash_config.conv_kernel_size"):
        DFlashConfig.from_dict(no_conv)
    with pytest.raises(ValueError, match="conv_group_size 24 must divide hidden_size 64"):
        DFlashConfig.from_dict(
            config | {"dflash_config": config["dflash_config"] | {"conv_group_size": 24}}
        )
    with pytest.raises(ValueError, match="no sliding_window"):
        DFlashConfig.from_dict(config | {"sliding_window": None})


@pytest.mark.parametrize("name", ["qwen3-tied-gqa", "llama-untied-mha"])
def test_dflash2_greedy_equals_mlx_lm(dflash2_pair, loaded, name):
    model, tokenizer, _ = loaded(name)
    _, draft_dir = dflash2_pair(name)
    draft = load_draft(draft_dir)
    for text in ("The quick brown fox", "def add(a, b):"):
        prompt = tokenizer.encode(text)
        expected = reference_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
        assert greedy_run(model, draft, tokenizer, prompt) == expected


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_converted_dflash2_generates_like_mlx_lm(dflash2_pair, loaded, tmp_path, bits):
    model, tokenizer, _ = loaded("qwen3-tied-gqa")
    _, draft_dir = dflash2_pair("qwen3-tied-gqa")
    out = convert_draft(draft_dir, tmp_path / "converted", dtype="bfloat16", q_bits=bits)
    config = read_config(out)
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_top_k"] == 16 and config["is_causal"] is False
    source = load_draft(draft_dir)
    stored = mx.load(str(out / "model.safetensors"))
    for linear in ("layers.1.mlp_conv.kernel_projection", "candidate_selector.hidden_projection"):
        assert (f"{linear}.scales" in stored) == (bits is not None)
    assert stored["candidate_selector.successor_codebook"].dtype == mx.bfloat16
    assert DFlashConfig.from_dict(config).to_dict() == config  # our layout round-trips
    if bits is None:  # a cast to the checkpoint's own dtype changes no weight
        same = dict(tree_flatten(load_draft(out).parameters()))
        assert all(mx.array_equal(v, same[k]) for k, v in tree_flatten(source.parameters()))
    prompt = tokenizer.encode("Speculative decoding drafts")
    expected = reference_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))
    assert greedy_run(model, load_draft(out), tokenizer, prompt, 30) == expected


def test_conv_matches_a_loop_over_positions_and_channels():
    """y = conv_1(f(conv_0(x))), conv_s(z)[t, c] = sum_k (base[s, k, c] + delta_s[t, k, c // g])
    * z[t - k, c], with delta projected from x and z before the block start read as zero."""
    hidden, taps, group = 32, 3, 8
    mx.random.seed(0)
    conv = GroupedDynamicConv(hidden, taps, group)
    conv.base_kernel = mx.random.normal(conv.base_kernel.shape)
    sub = mx.random.normal((hidden, hidden)) / hidden**0.5
    x = mx.random.normal((2, 5, hidden))
    y = np.array(conv(x, lambda z: z @ sub))

    xn, subn = np.array(x, np.float64), np.array(sub, np.float64)
    base = np.array(conv.base_kernel, np.float64)
    proj = xn @ np.array(conv.kernel_projection.weight, np.float64).T  # (2, 5, 2*taps*groups)
    delta = proj.reshape(2, 5, 2, taps, hidden // group)

    def conv_loop(z, side):
        out = np.zeros_like(z)
        for b in range(z.shape[0]):
            for t in range(z.shape[1]):
                for c in range(hidden):
                    for k in range(taps):
                        if t - k >= 0:
                            w = base[side, k, c] + delta[b, t, side, k, c // group]
                            out[b, t, c] += w * z[b, t - k, c]
        return out

    expected = conv_loop(conv_loop(xn, 0) @ subn, 1)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


def tiny_config(**fields) -> DFlashConfig:
    cfg = {
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 50,
        "dflash_config": {"mask_token_id": 49, "target_layer_ids": [0]},
    }
    return DFlashConfig.from_dict(cfg | fields)


def block_output(draft: DFlashDraft, context: mx.array, block: mx.array) -> np.ndarray:
    cache = draft.make_cache()
    draft.append_context(context, [cache])
    return np.array(draft(block, cache)[0])


@pytest.mark.parametrize(
    "kind, is_causal, causal",
    [
        ("full_attention", None, False),
        ("sliding_attention", None, True),  # the reference: causal iff sliding when unset
        ("sliding_attention", False, False),  # DFlash 2's published configs
        ("full_attention", True, True),
    ],
)
def test_in_block_causality_follows_the_reference_rule(kind, is_causal, causal):
    fields = {"layer_types": [kind], "sliding_window": 64, "is_causal": is_causal}
    mx.random.seed(1)
    draft = DFlashDraft(tiny_config(**fields))
    context, block = mx.random.normal((1, 6, 32)), mx.random.normal((1, 5, 32))
    changed = block + mx.array([0, 0, 0, 0, 1.0])[None, :, None]  # only the last position
    before, after = block_output(draft, context, block), block_output(draft, context, changed)
    moved = np.abs(before - after).max(axis=-1) > 1e-5
    assert moved[-1]
    assert moved[:-1].any() == (not causal)


def test_sliding_window_is_per_query_position():
    """Query i of a block at offset P sees context j iff P + i - j < W, and (not causal)
    block key k iff |i - k| < W: the reference's `_attention_mask`."""
    window, offset = 3, 10
    fields = {"layer_types": ["sliding_attention"], "sliding_window": window, "is_causal": False}
    mx.random.seed(2)
    draft = DFlashDraft(tiny_config(**fields))
    context, block = mx.random.normal((1, offset, 32)), mx.random.normal((1, 5, 32))
    base = block_output(draft, context, block)
    for j in range(offset):
        bumped = context + (mx.arange(offset) == j)[None, :, None] * 1.0
        moved = np.abs(block_output(draft, bumped, block) - base).max(axis=-1) > 1e-5
        assert list(moved) == [offset + i - j < window for i in range(5)], j
    for k in range(5):
        bumped = block + (mx.arange(5) == k)[None, :, None] * 1.0
        moved = np.abs(block_output(draft, context, bumped) - base).max(axis=-1) > 1e-5
        assert list(moved) == [abs(i - k) < window for i in range(5)], k


def numpy_selector_path(draft, hidden, head_weight, anchor) -> list[int]:
    """The published rule, straight from its definition: top-K of the drafter's logits,
    score U_t(b) + <A[a] * (W h_t), B[b]>, greedy from the anchor."""
    params = dict(tree_flatten(draft.parameters()))
    A = np.array(params["candidate_selector.predecessor_codebook"], np.float64)
    B = np.array(params["candidate_selector.successor_codebook"], np.float64)
    W = np.array(params["candidate_selector.hidden_projection.weight"], np.float64)
    cfg = draft.config
    logits = hidden @ head_weight.T * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    logits = np.tanh(logits / cap) * cap
    path, prev = [], anchor
    for t in range(len(hidden)):
        candidates = np.argsort(-logits[t])[: cfg.selector_top_k]
        scores = [logits[t, b] + np.sum(A[prev] * (W @ hidden[t]) * B[b]) for b in candidates]
        prev = int(candidates[int(np.argmax(scores))])
        path.append(prev)
    return path


def test_selector_greedy_path_equals_the_published_rule(dflash2_pair, loaded):
    model, _, _ = loaded("qwen3-tied-gqa")
    target = TargetAdapter(model)
    draft = load_draft(dflash2_pair("qwen3-tied-gqa")[1])
    head_weight = np.array(target.embedding.weight, np.float64)
    greedy = make_verifier().propose
    rng = np.random.default_rng(0)
    differs = 0
    for trial in range(6):
        context = mx.array(rng.normal(size=(1, 5 + 7 * trial, 128)).astype(np.float32))
        anchor = int(rng.integers(4, 300))
        block = mx.array([anchor] + [draft.config.mask_token_id] * (BLOCK - 1))
        cache = draft.make_cache()
        draft.append_context(context, [cache])
        tokens, logq = propose_one(draft, block, target.embed_tokens, target.lm_head, cache, greedy)
        assert logq is None
        cache = draft.make_cache()
        draft.append_context(context, [cache])
        hidden = np.array(
            draft.mask_hidden(block[None], target.embed_tokens, [cache])[0], np.float64
        )
        expected = numpy_selector_path(draft, hidden, head_weight, anchor)
        assert tokens.tolist() == expected
        differs += expected != np.argmax(hidden @ head_weight.T, axis=-1).tolist()
    assert differs  # the codebooks matter: the walk is not just the per-position argmax


def test_selector_rows_equal_each_alone(dflash2_pair, loaded):
    """One drafter forward over rows: each row's selector walk and selector tree are its own."""
    model, _, _ = loaded("qwen3-tied-gqa")
    rows_equal_each_alone(load_draft(dflash2_pair("qwen3-tied-gqa")[1]), model)


def test_sampled_walk_keeps_speculative_sampling_exact():
    """Tokens emitted after a sampled walk (q over the candidates, conditioned on the path)
    follow the target: its first token, and its second given the first."""
    vocab, k, steps = 6, 3, 2
    mx.random.seed(0)
    draft = DFlashDraft(
        tiny_config(
            vocab_size=vocab,
            dflash_config={
                "mask_token_id": 5,
                "target_layer_ids": [0],
                "selector_top_k": k,
                "selector_rank": 4,
            },
        )
    )
    selector = draft.candidate_selector
    selector.predecessor_codebook = mx.random.normal((vocab, 4))
    selector.successor_codebook = mx.random.normal((vocab, 4))
    hidden, logits = mx.random.normal((steps, 32)), mx.random.normal((steps, vocab))
    rng = np.random.default_rng(0)
    p1 = rng.dirichlet(np.ones(vocab))
    p2 = rng.dirichlet(np.ones(vocab), size=vocab)  # the target's next token given the first
    verifier = make_verifier(temperature=1.0, acceptance="speculative")
    pairs = []
    for _ in range(4000):
        tokens, logq = selector.walk(hidden, logits, mx.array(2), verifier.propose)
        first = int(tokens[0].item())
        target = mx.log(mx.array(np.stack([p1, p2[first], p2[first]]), dtype=mx.float32))
        verdict: Verdict = verifier.verify(tokens, logq, target)
        m = verdict.matches.tolist()
        n = 0 if not m[0] else 1 if not m[1] else 2
        assert verdict.accepted.item() == n
        emitted = tokens.tolist()[:n] + [verdict.token.item()]
        if n == 0:  # the second token would come from the next cycle: draw it from p
            emitted.append(int(rng.choice(vocab, p=p2[emitted[0]])))
        pairs.append(emitted[:2])
    pairs = np.array(pairs)
    assert chi2_pvalue(pairs[:, 0] * vocab + pairs[:, 1], (p1[:, None] * p2).ravel()) > SIGNIFICANCE


@pytest.mark.parametrize("is_causal", [None, False])
def test_training_forward_equals_inference_for_dflash2_layers(is_causal):
    """The all-blocks training forward (`BlockContext`) applies the convolutions per block and
    the sliding/causal rule per query exactly as the cached inference forward does."""
    from dflash_mlx.train.blocks import block_hidden, sample_anchors

    fields = {
        "layer_types": ["sliding_attention", "full_attention"],
        "num_hidden_layers": 2,
        "sliding_window": 5,
        "is_causal": is_causal,
        "dflash_config": {
            "mask_token_id": 49,
            "target_layer_ids": [0],
            "block_size": 6,
            "input_embedding_scale": 0.5,
            "conv_kernel_size": 2,
            "conv_group_size": 8,
        },
    }
    mx.random.seed(4)
    draft = DFlashDraft(tiny_config(**fields))
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.random.normal(conv.base_kernel.shape)
    embed = nn.Embedding(50, 32)
    ids = np.random.default_rng(0).integers(0, 49, size=30)
    features = mx.random.normal((30, 32))
    anchors = sample_anchors(np.arange(3, 29), 8, np.random.default_rng(1))
    hidden = block_hidden(draft, embed, features, ids, anchors)
    for i, p in enumerate(anchors):
        cache = draft.make_cache()
        draft.append_context(features[None, :p], [cache])
        block = mx.array([int(ids[p])] + [49] * 5)
        expected = draft(embed(block[None]) * 0.5, cache)[0]
        assert mx.abs(expected - hidden[i]).max().item() < 1e-4
