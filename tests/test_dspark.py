"""DSpark drafters: every published packaging loads strictly and generates losslessly; the
Markov walk, the confidence truncation and the Markov trees follow DeepSpec's reference."""

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    layer_tensors,
    propose_one,
    read_config,
    reference_greedy,
    rows_equal_each_alone,
)
from mlx.utils import tree_flatten
from test_sampling import SIGNIFICANCE, chi2_pvalue, exact_marginals, sample_runs

from dflash_mlx import load_draft, make_prompt_cache, stream_generate
from dflash_mlx.cli.convert import convert_draft
from dflash_mlx.decode.sampling import make_logprobs_transform
from dflash_mlx.models.dspark import DSparkDraft, confident_length

GAMMA = 5  # drafts per block: 6 positions verified
RANK = 8
LAYOUTS = ("deepspec", "deepspec-dflash", "dspark", "speculators", "gated", "rnn")


def save_dspark(path: Path, target: dict, layout: str, seed: int = 2) -> Path:
    """A tiny random DSpark drafter for `target` (its config.json) in one packaging.

    "deepspec": DeepSpec's `Qwen3DSparkModel` / `Gemma4DSparkModel` (a copy of the target
    config plus its fields; frozen embedding and head copies; "deepspec-dflash" is its
    `markov_rank: 0` baseline, "gated"/"rnn" its other Markov heads); "dspark": the
    `DSparkDraftModel` layout (`dflash_config.projector_type`, heads under other runtimes'
    names, interleaved RoPE); "speculators": `speculators_model_type: dspark` with a draft
    vocabulary of 200 tokens by `d2t`/`t2d`.
    """
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    gemma4 = target["model_type"].startswith("gemma4")
    hidden, vocab, layers = target["hidden_size"], target["vocab_size"], 2
    heads = target["num_attention_heads"]
    head_dim = target.get("global_head_dim") if gemma4 else target.get("head_dim")
    head_dim = head_dim or hidden // heads
    k_eq_v = gemma4 and target.get("attention_k_eq_v", False)
    kv = (target.get("num_global_key_value_heads") if k_eq_v else None) or target[
        "num_key_value_heads"
    ]
    inter, ids = target["intermediate_size"], [1, 3]
    rank = 0 if layout == "deepspec-dflash" else RANK
    draft_ids = sorted(rng.choice(vocab, 200, replace=False).tolist())

    def mat(rows: int, cols: int, gain: float = 1.5) -> np.ndarray:
        return rng.normal(0, gain / math.sqrt(cols), (rows, cols))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.normal(size=n)

    w = {"fc.weight": mat(hidden, len(ids) * hidden), "hidden_norm.weight": norm(hidden)}
    w["norm.weight"] = norm(hidden)
    for i in range(layers):
        p = f"layers.{i}."
        w.update(layer_tensors(p, mat, norm, hidden, (heads, kv, head_dim), inter, not k_eq_v))
        if gemma4:
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "layer_scalar"] = np.array([0.9])
    out_vocab = len(draft_ids) if layout == "speculators" else vocab
    if layout != "dspark":
        w["embed_tokens.weight"] = mat(vocab, hidden)
        w["lm_head.weight"] = mat(out_vocab, hidden)
    kind = {"gated": "gated", "rnn": "rnn"}.get(layout, "vanilla")
    if rank:
        w["markov_head.markov_w1.weight"] = rng.normal(size=(vocab, rank))
        w["markov_head.markov_w2.weight"] = mat(out_vocab, rank, 2.0)
        w["confidence_head.proj.weight"] = mat(1, hidden + rank)
        w["confidence_head.proj.bias"] = np.array([2.0])
        if kind == "gated":
            w["markov_head.gate_proj.weight"] = mat(rank, hidden + rank)
            w["markov_head.gate_proj.bias"] = np.zeros(rank)
        if kind == "rnn":
            w["markov_head.joint_proj.weight"] = mat(3 * rank, 2 * rank + hidden)
            w["markov_head.joint_proj.bias"] = np.zeros(3 * rank)
    arrays = {k: mx.array(v.astype(np.float32)).astype(mx.bfloat16) for k, v in w.items()}
    mask = vocab - 1
    fields = dict(
        block_size=GAMMA,
        target_layer_ids=ids,
        mask_token_id=mask,
        num_anchors=512,
        markov_rank=rank,
        enable_confidence_head=bool(rank),
    )
    if rank:
        fields.update(markov_head_type=kind, confidence_head_with_markov=True)
    if layout == "dspark":
        arrays = {
            {
                "markov_head.markov_w1.weight": "markov_w1.weight",
                "markov_head.markov_w2.weight": "markov_w2.weight",
                "confidence_head.proj.weight": "confidence_proj.weight",
                "confidence_head.proj.bias": "confidence_proj.bias",
            }.get(k, k): v
            for k, v in arrays.items()
        }
        config = {
            **target,
            "architectures": ["DSparkDraftModel"],
            "num_hidden_layers": layers,
            "block_size": GAMMA,
            "num_target_layers": target["num_hidden_layers"],
            "rope_is_neox_style": False,
            "dflash_config": {
                "projector_type": "dspark",
                "target_layer_ids": ids,
                "mask_token_id": mask,
                "markov_rank": rank,
                "markov_head_type": kind,
                "use_confidence_head": True,
                "shift_label": True,
            },
        }
    elif layout == "speculators":
        arrays["d2t"] = mx.array(np.array(draft_ids) - np.arange(len(draft_ids)))
        t2d = np.zeros(vocab, dtype=bool)
        t2d[draft_ids] = True
        arrays["t2d"] = mx.array(t2d)
        layer = {k: v for k, v in target.items() if k not in ("eos_token_id", "bos_token_id")}
        config = {
            "speculators_model_type": "dspark",
            "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": {**layer, "num_hidden_layers": layers},
            "draft_vocab_size": len(draft_ids),
            "aux_hidden_state_layer_ids": [i + 1 for i in ids],
            "sample_from_anchor": True,
            **{k: v for k, v in fields.items() if k != "target_layer_ids"},
        }
    else:
        config = {
            **target,
            **fields,
            "architectures": ["Gemma4DSparkModel" if gemma4 else "Qwen3DSparkModel"],
            "num_target_layers": target["num_hidden_layers"],
            "num_hidden_layers": layers,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * layers,
        }
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), arrays)
    return path


@pytest.fixture(scope="module")
def dspark_pair(make_pair, workdir):
    """(target dir, drafter dir) for a packaging, on the qwen3 tiny target."""
    built = {}

    def make(layout: str):
        if layout not in built:
            target, _ = make_pair("qwen3-untied-mha")
            built[layout] = (
                target,
                save_dspark(workdir / f"dspark-{layout}", read_config(target), layout),
            )
        return built[layout]

    return make


def run(model, draft, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kwargs))
    return [t for r in responses for t in r.tokens], responses


PROMPT = [5, 17, 260, 33, 90, 41, 7, 150, 12]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_packaging_loads_strictly(dspark_pair, layout, tmp_path):
    _, draft_dir = dspark_pair(layout)
    stored = mx.load(str(draft_dir / "model.safetensors"))
    draft = load_draft(draft_dir)
    cfg = draft.config
    assert isinstance(draft, DSparkDraft)
    assert (cfg.slots, cfg.block_size, cfg.target_layer_ids) == (GAMMA, GAMMA + 1, [1, 3])
    assert cfg.layout == {
        "deepspec-dflash": "deepspec",
        "gated": "deepspec",
        "rnn": "deepspec",
    }.get(layout, layout)
    assert cfg.markov_rank == (0 if layout == "deepspec-dflash" else RANK)
    assert cfg.confidence_head == (layout != "deepspec-dflash")
    assert cfg.rope_traditional == (layout == "dspark")
    if layout == "speculators":
        t2d = np.array(stored["t2d"])
        assert cfg.draft_vocab == np.flatnonzero(t2d).tolist() and len(cfg.draft_vocab) == 200
    params = dict(tree_flatten(draft.parameters()))
    dropped = {"embed_tokens.weight", "lm_head.weight", "d2t", "t2d"}
    renamed = {
        k.replace("markov_w", "markov_head.markov_w")
        if k.startswith("markov_w")
        else k.replace("confidence_proj", "confidence_head.proj"): v
        for k, v in stored.items()
        if k not in dropped
    }
    assert params.keys() == renamed.keys()
    for name, value in renamed.items():
        if layout == "speculators" and name == "markov_head.markov_w2.weight":
            assert mx.array_equal(params[name][mx.array(cfg.draft_vocab)], value.astype(mx.float32))
        else:
            assert mx.array_equal(params[name], value.astype(mx.float32)), name

    for broken, name in (
        ("missing", "layers.1.mlp.up_proj.weight"),
        ("unexpected", "layers.0.extra"),
    ):
        bad = tmp_path / broken
        bad.mkdir()
        (bad / "config.json").write_text((draft_dir / "config.json").read_text())
        weights = dict(stored)
        if broken == "missing":
            del weights[name]
        else:
            weights[name] = weights["norm.weight"]
        mx.save_safetensors(str(bad / "model.safetensors"), weights)
        with pytest.raises(ValueError, match=f"{broken}.*{name}"):
            load_draft(bad)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_chain_equals_mlx_lm(dspark_pair, loaded, layout):
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    draft = load_draft(dspark_pair(layout)[1])
    expected = reference_greedy(model, PROMPT, 60, set(tokenizer.eos_token_ids))
    # two drafts, and the adaptive chain up to the drafter's own γ + 1
    for setting, block_size in (({"block_size": 3}, 3), ({"adaptive": True}, GAMMA + 1)):
        tokens, responses = run(model, draft, tokenizer, PROMPT, max_tokens=60, **setting)
        assert tokens == expected
        assert max(r.proposed for r in responses) <= block_size - 1
    assert run(model, draft, tokenizer, PROMPT, max_tokens=60)[0] == expected  # chains or trees


@pytest.mark.parametrize("layout", ["deepspec", "deepspec-dflash", "gated", "speculators"])
def test_markov_trees_are_lossless(dspark_pair, loaded, layout):
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    draft = load_draft(dspark_pair(layout)[1])
    expected = reference_greedy(model, PROMPT, 60, set(tokenizer.eos_token_ids))
    tokens, responses = run(model, draft, tokenizer, PROMPT, tree_budget=12, max_tokens=60)
    assert tokens == expected
    assert max(r.proposed for r in responses) > GAMMA  # a tree, wider than a chain


def test_rnn_head_refuses_trees_in_one_line(dspark_pair, loaded):
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    draft = load_draft(dspark_pair("rnn")[1])
    with pytest.raises(ValueError, match="rnn Markov head drafts chains"):
        run(model, draft, tokenizer, PROMPT, tree_budget=8, max_tokens=8)
    cache = make_prompt_cache(model, draft)  # the default: chains from its refused first tree
    tokens, _ = run(model, draft, tokenizer, PROMPT, max_tokens=24, prompt_cache=cache)
    assert tokens == reference_greedy(model, PROMPT, 24, set(tokenizer.eos_token_ids))
    assert cache.block_policy.tree_budget == 0


def numpy_walk(draft: DSparkDraft, hidden: mx.array, head: mx.array, root: int):
    """DeepSpec's greedy Markov walk and confidence, in numpy from the tensors alone."""
    p = {
        k: np.array(v.astype(mx.float32), dtype=np.float64)
        for k, v in tree_flatten(draft.parameters())
    }
    h = np.array(hidden.astype(mx.float32), dtype=np.float64)
    base = h @ np.array(head.astype(mx.float32), dtype=np.float64).T
    w1, w2 = p["markov_head.markov_w1.weight"], p["markov_head.markov_w2.weight"]
    kind, rank = draft.config.markov_head_type, draft.config.markov_rank
    prev, state, tokens, confidence = root, np.zeros(rank), [], []
    for k in range(h.shape[0]):
        e = w1[prev]
        features = np.concatenate([h[k], e])
        z = features @ p["confidence_head.proj.weight"][0] + p["confidence_head.proj.bias"][0]
        confidence.append(1 / (1 + np.exp(-z)))
        if kind == "vanilla":
            bias = w2 @ e
        elif kind == "gated":
            gate = 1 / (
                1
                + np.exp(
                    -(
                        p["markov_head.gate_proj.weight"] @ features
                        + p["markov_head.gate_proj.bias"]
                    )
                )
            )
            bias = w2 @ (gate * e)
        else:
            joint = (
                p["markov_head.joint_proj.weight"] @ np.concatenate([state, e, h[k]])
                + p["markov_head.joint_proj.bias"]
            )
            g, c, o = np.split(joint, 3)
            g = 1 / (1 + np.exp(-g))
            state = g * state + (1 - g) * np.tanh(c)
            bias = w2 @ np.tanh(o)
        prev = int(np.argmax(base[k] + bias))
        tokens.append(prev)
    return tokens, confidence


@pytest.mark.parametrize("layout", ["deepspec", "gated", "rnn"])
def test_markov_walk_and_confidence_follow_the_reference(dspark_pair, loaded, layout):
    from dflash_mlx.decode.sampling import make_verifier
    from dflash_mlx.models.target import TargetAdapter

    model, _, _ = loaded("qwen3-untied-mha")
    target = TargetAdapter(model)
    draft = load_draft(dspark_pair(layout)[1])
    draft.verify_cost = None
    cache = draft.make_cache()
    features = mx.random.normal((1, 7, 2 * target.hidden_size), key=mx.random.key(0))
    draft.append_context(features, [cache])
    block = mx.array([42] + [draft.config.mask_token_id] * GAMMA)
    hidden = draft.slot_hidden(block[None], target.embed_tokens, [cache])[0]
    tokens, _ = propose_one(
        draft, block, target.embed_tokens, target.lm_head, cache, make_verifier().propose
    )
    expected, confidence = numpy_walk(draft, hidden, target.head.weight, 42)
    assert tokens.tolist() == expected
    prev = mx.array([42, *expected[:-1]])
    np.testing.assert_allclose(draft.confidence(hidden, prev), confidence, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ["deepspec", "gated", "deepspec-dflash", "rnn"])
def test_rows_equal_each_alone(dspark_pair, loaded, layout):
    """One drafter forward over rows: each row's Markov walk, confidence cut and Markov tree
    are its own (an rnn head drafts chains alone; `deepspec-dflash`: no heads)."""
    model, _, _ = loaded("qwen3-untied-mha")
    draft = load_draft(dspark_pair(layout)[1])
    assert draft.verify_cost is not None or layout == "deepspec-dflash"  # the cut runs
    rows_equal_each_alone(draft, model, tree_rows=layout != "rnn")


class OracleDSpark(DSparkDraft):
    """Base logits that put the target's true greedy continuation first, whatever the Markov
    bias: every draft must be accepted."""

    def __init__(self, draft: DSparkDraft, sequence: list[int]):
        super().__init__(draft.config)
        self.update(draft.parameters())
        self.verify_cost = None
        object.__setattr__(self, "sequence", sequence)

    def slot_hidden(self, blocks, embed, caches):
        object.__setattr__(self, "starts", [cache[0].offset for cache in caches])
        return super().slot_hidden(blocks, embed, caches)

    def head_logits(self, hidden, lm_head):
        n, eye = hidden.shape[1], mx.eye(self.config.vocab_size)
        truths = [self.sequence[start + 1 : start + 1 + n] for start in self.starts]
        return 1000.0 * eye[mx.array(truths)]


def test_oracle_dspark_is_fully_accepted_at_its_own_width(dspark_pair, loaded):
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    max_tokens = 61
    expected = reference_greedy(model, PROMPT, max_tokens, set())
    oracle = OracleDSpark(load_draft(dspark_pair("deepspec")[1]), PROMPT + expected)
    width = oracle.config.block_size  # γ drafts, γ + 1 verified
    tokens, responses = run(
        model, oracle, tokenizer, PROMPT, block_size=width, max_tokens=max_tokens
    )
    assert tokens == expected and width == GAMMA + 1
    cycles = responses[1:]
    assert all(r.accepted == r.proposed for r in cycles)
    assert [r.proposed for r in cycles[:-1]] == [GAMMA] * (len(cycles) - 1)


class ParityConfidence(DSparkDraft):
    """c_k from x_{k-1} alone: high after an even token, low after an odd one, so where a
    chain stops depends on the drafts themselves."""

    def __init__(self, draft: DSparkDraft):
        super().__init__(draft.config)
        self.update(draft.parameters())
        self.verify_cost = lambda n: 1.0 + 0.1 * (n - 1)

    def confidence(self, hidden, prev):
        return mx.where(prev % 2 == 0, 0.95, 0.02)


def test_confidence_truncation_is_lossless_and_verifies_less(dspark_pair, loaded):
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    draft = ParityConfidence(load_draft(dspark_pair("deepspec")[1]))
    expected = reference_greedy(model, PROMPT, 80, set(tokenizer.eos_token_ids))
    tokens, responses = run(model, draft, tokenizer, PROMPT, block_size=GAMMA + 1, max_tokens=80)
    assert tokens == expected
    proposed = [r.proposed for r in responses[1:]]
    assert 0 in proposed and sum(proposed) < GAMMA * len(proposed) / 2


def test_truncation_stops_at_the_first_fall_of_the_throughput():
    cost = {1: 1.0, 2: 2.0, 3: 1 / 0.45}.__getitem__  # the paper's appendix A example
    assert confident_length([0.8, 0.9], cost) == 0  # not 2, the global best
    linear = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    assert confident_length([0.95, 0.9, 0.1, 0.9], linear) == 2
    assert confident_length([0.99] * 5, linear) == 5
    assert confident_length([0.05], linear) == 0


class NoisyOracleDSpark(ParityConfidence):
    """First cycle after `prompt`: base logits are the target's along its greedy path plus
    fixed noise, so the Markov head's q_k overlaps p without equalling it; later cycles draft
    from the Markov bias alone. `truncated`: the verify length follows the parity rule."""

    def __init__(self, draft: DSparkDraft, model, prompt: list[int], truncated: bool):
        super().__init__(draft)
        if not truncated:
            self.verify_cost = None
        noise = mx.random.normal((8, draft.config.vocab_size), key=mx.random.key(1))
        for name, value in dict(target=model, prompt=prompt, noise=noise, rows={}, at=None).items():
            object.__setattr__(self, name, value)

    def slot_hidden(self, blocks, embed, caches):
        (cache,) = caches  # the replies of this test decode alone
        object.__setattr__(self, "at", (cache[0].offset, blocks[0, 0].item()))
        return super().slot_hidden(blocks, embed, caches)

    def head_logits(self, hidden, lm_head):
        n, (offset, root) = hidden.shape[1], self.at
        if offset != len(self.prompt):
            return mx.zeros((1, n, self.config.vocab_size))
        if (root, n) not in self.rows:
            path = self.prompt + [root]
            for _ in range(n - 1):
                path.append(int(mx.argmax(self.target(mx.array([path]))[0, -1])))
            rows = self.target(mx.array([path]))[0, -n:] + 1.5 * self.noise[:n]
            self.rows[root, n] = mx.eval(rows) or rows
        return self.rows[root, n][None]


@pytest.mark.slow
@pytest.mark.parametrize("truncated", [False, True])
def test_sampling_at_temperature_one_is_exact(dspark_pair, loaded, truncated):
    """Tokens 3 and 4 come from accepted Markov drafts, resamples or bonus tokens: each
    marginal must be the target's own, also when the verify length follows the drafts."""
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    setting = dict(temperature=1.0, top_k=5)
    prompt = [0, 39, 259, 28]
    expected = exact_marginals(model, prompt, make_logprobs_transform(**setting), 4)
    drafter = NoisyOracleDSpark(load_draft(dspark_pair("deepspec")[1]), model, prompt, truncated)
    mx.random.seed(4)
    tokens, accepted = sample_runs(model, drafter, tokenizer, prompt, 4, **setting)
    counts = np.bincount(accepted, minlength=4)
    assert counts[0] > 0 and counts[1:].sum() > 0
    for k in (2, 3):
        assert chi2_pvalue(np.array([t[k] for t in tokens]), expected[k]) > SIGNIFICANCE


@pytest.fixture(scope="module")
def gemma4_pair(loaded, workdir):
    """(gemma4_text target, its Gemma-4 DSpark drafter in DeepSpec's layout, a tokenizer)."""
    from mlx_lm.models import gemma4_text
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from test_families import FAMILIES, build

    model = build("gemma4_text")
    # the target's whole text config, as DeepSpec copies it (softcap and RoPE included)
    fields = vars(
        gemma4_text.ModelArgs.from_dict({"model_type": "gemma4_text", **FAMILIES["gemma4_text"][1]})
    )
    draft = load_draft(save_dspark(workdir / "dspark-gemma4", fields, "deepspec"))
    tokenizer = TokenizerWrapper(loaded("llama-tied-gqa")[1]._tokenizer)
    tokenizer.eos_token_ids = []
    return model, draft, tokenizer


def test_gemma4_dspark_loads_its_own_shapes_and_is_lossless(gemma4_pair):
    model, draft, tokenizer = gemma4_pair
    cfg, attention = draft.config, draft.layers[0].self_attn
    assert (cfg.layout, cfg.layer_kind, cfg.attention_k_eq_v) == ("deepspec", "gemma4", True)
    assert (cfg.head_dim, attention.scale, "v_proj" in attention) == (32, 1.0, False)
    assert cfg.final_logit_softcapping == 30.0
    expected = reference_greedy(model, PROMPT, 60, set())
    for kwargs in (dict(block_size=GAMMA + 1), dict(block_size=3), dict(tree_budget=10)):
        tokens, _ = run(model, draft, tokenizer, PROMPT, max_tokens=60, **kwargs)
        assert tokens == expected, kwargs


@pytest.mark.parametrize("bits", [None, 4])
def test_converted_dspark_keeps_its_heads_and_generates_like_mlx_lm(
    dspark_pair, loaded, tmp_path, bits
):
    model, tokenizer, _ = loaded("qwen3-untied-mha")
    out = convert_draft(dspark_pair("speculators")[1], tmp_path / "ours", q_bits=bits)
    config = read_config(out)
    assert config["architectures"] == ["DSparkDraftModel"] and config["block_size"] == GAMMA
    assert config["dflash_config"]["projector_type"] == "dspark"
    draft = load_draft(out)
    assert (draft.config.layout, draft.config.slots, draft.config.markov_rank) == (
        "dspark",
        GAMMA,
        RANK,
    )
    assert len(draft.config.draft_vocab) == 200
    expected = reference_greedy(model, PROMPT, 60, set(tokenizer.eos_token_ids))
    tokens, _ = run(model, draft, tokenizer, PROMPT, block_size=GAMMA + 1, max_tokens=60)
    assert tokens == expected


def test_info_says_what_the_dspark_drafter_is(dspark_pair, capsys):
    from dflash_mlx import cli

    cli.main(["info", str(dspark_pair("speculators")[1])])
    out = capsys.readouterr().out
    for line in ("drafter", "DSpark"), ("layout", "speculators"), ("slots (γ)", "5, 6 positions"):
        assert any(row.startswith(line[0]) and line[1] in row for row in out.splitlines()), line
    assert "rank 8, vanilla" in out and "on h and W1[prev]" in out and "200 of 320" in out


def test_drafters_benchmark_compares_dflash_and_dspark_in_one_run(dspark_pair, make_pair, tmp_path):
    """benchmarks/drafters.py, a real run: both drafters on the same prompts, each reply
    equal to mlx-lm's, per-category and overall rows."""
    target, dspark = dspark_pair("dspark")
    _, dflash = make_pair("qwen3-untied-mha")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "drafters.py"
    out = tmp_path / "drafters.json"
    args = [str(dflash), str(dspark), "--model", str(target), "--limit", "3"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--max-tokens", "12", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["drafters"]
    assert list(results) == [str(dflash), str(dspark)]
    for rows in results.values():
        assert rows["all"]["prompts"] == 3 and rows["all"]["identical"] == 3
        assert rows["all"]["tau"] >= 1 and rows["all"]["decode_tps"] > 0
        assert sum(r["prompts"] for c, r in rows.items() if c != "all") == 3
