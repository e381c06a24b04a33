"""The target's own MTP layers as the drafter (`--draft mtp`): tiny random Qwen3.5, Qwen3.5-MoE
and Qwen3-Next checkpoints with `mtp.*` tensors, and GLM-4.5, DeepSeek-V3 and GLM-5 ones with
a nextn layer, in the published names, loaded from the target's own safetensors; greedy
replies equal to mlx-lm's at several block sizes; every chain equal to the MTP layer run from
scratch over the whole sequence; shared cycles with per-row acceptance, each reply equal to
its solo reply; drafts through a draft vocabulary; refusals in one line."""

import copy
import json
import re
import shutil
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import build_tokenizer, chat_ids, reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3, glm4_moe, glm_moe_dsa, qwen3_5, qwen3_5_moe, qwen3_next
from mlx_lm.models.base import create_attention_mask
from test_cli import decode_greedy, detokenized, dflash_in_process
from test_families import (
    BASE,
    DEEPSEEK_V3,
    DEEPSEEK_V41,
    FAMILIES,
    GLM_DSA,
    PROMPT,
    VOCAB,
    build,
    first_difference,
    prompt_of,
)
from test_sampling import SIGNIFICANCE, chi2_pvalue, exact_marginals, sample_runs
from test_server import serving
from test_server_batch import answer, burst

from dflash_mlx import (
    GenerationSettings,
    load,
    load_draft,
    make_prompt_cache,
    stream_generate,
)
from dflash_mlx.decode import cycle
from dflash_mlx.decode.adaptive import Plan
from dflash_mlx.decode.plan import FixedPlan
from dflash_mlx.decode.sampling import make_logprobs_transform
from dflash_mlx.models import mtp
from dflash_mlx.models.draft import DraftChain, DraftTree
from dflash_mlx.models.mtp import MTPConfig, MTPDraft, MTPRow, mtp_args
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.serve import Worker

TOKENS = 120
GLM4_MOE = dict(  # GLM-4.5 to 4.7: MoE from layer 1, its nextn layer after the last
    BASE,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    n_routed_experts=4,
    routed_scaling_factor=1.0,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    use_qk_norm=True,
    attention_bias=False,
    partial_rotary_factor=0.5,
    rope_scaling=None,
)
MTP_FAMILIES = {
    "qwen3_5": FAMILIES["qwen3_5"],
    "qwen3_5_moe": FAMILIES["qwen3_5_moe"],
    "qwen3_next": FAMILIES["qwen3_next"],
    "glm4_moe": (glm4_moe, GLM4_MOE),
    # mlx-lm drops DeepSeek-V3's nextn layer by its published index, 61: as many dense layers
    "deepseek_v3": (deepseek_v3, dict(DEEPSEEK_V3, num_hidden_layers=61, first_k_dense_replace=61)),
    # GLM-5: DeepSeek-V3.2's sparse attention (an indexer picks 48 keys a query) in its nextn
    # layer too, whose cache holds the indexer's keys beside the MLA latents
    "glm_moe_dsa": (glm_moe_dsa, GLM_DSA),
}
NEXTN_FAMILIES = ("glm4_moe", "deepseek_v3", "glm_moe_dsa")
NEXTN = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm"}
MODULES = {"qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next}


def mtp_tensors(model_type: str, config: dict, seed: int, model) -> dict[str, mx.array]:
    """`mtp.*` tensors of one MTP layer for `model` (a target of this config) in the published
    names: an mlx-lm decoder layer of the target's own kind, with full attention, briefly
    trained on the target's greedy continuations, so that its drafts are often accepted."""
    text = config.get("text_config") or config
    args = mtp_args(model_type, text)
    mx.random.seed(seed)
    draft = MTPDraft(MTPConfig.for_target(model_type, args), args)
    for name, w in tree_flatten(draft.parameters()):
        if w.ndim == 1:  # norms away from 1, so that they matter
            w = mx.random.uniform(0.5, 1.5, w.shape)
        elif w.any().item():
            w = w * 2.0
        else:
            w = mx.random.normal(w.shape) / w.shape[-1] ** 0.5
        draft.load_weights([(name, w)], strict=False)
    train(draft, model)
    return {
        published(model_type, name, args.num_hidden_layers): w
        for name, w in tree_flatten(draft.parameters())
        if not name.startswith("target_norm")
    }


def published(model_type: str, name: str, num_layers: int) -> str:
    """A tensor's name in the published checkpoints: Qwen's `mtp.*`, or the nextn layer
    after the target's last (GLM, DeepSeek-V3)."""
    if model_type not in NEXTN_FAMILIES:
        return f"mtp.{name}"
    head, _, rest = name.partition(".")
    if head == "layers":
        return f"model.layers.{num_layers}.{rest.partition('.')[2]}"
    if head == "norm":
        return f"model.layers.{num_layers}.shared_head.norm.{rest}"
    return f"model.layers.{num_layers}.{NEXTN[head]}.{rest}"


def mtp_forward(draft, target, tokens: mx.array, hidden: mx.array) -> mx.array:
    """The MTP layer over whole sequences without a cache: its output at each position of
    `tokens` (the token after each position of the target's final hidden states `hidden`)."""
    h = mx.concatenate(
        [
            draft.pre_fc_norm_embedding(target.embed_tokens(tokens)),
            draft.pre_fc_norm_hidden(hidden),
        ],
        axis=-1,
    )
    h = draft.fc(h)
    for layer in draft.layers:
        h = layer(h, create_attention_mask(h, None, return_array=True), None)
    return h


def train(draft, model, steps: int = 60) -> None:
    """Fit the MTP layer to the target's greedy continuations of a few prompts: from the
    target's final hidden state at p and the token at p + 1, the token at p + 2."""
    target = TargetAdapter(model)
    sequences = [  # the tests' own prompt among them: its replies' drafts are often accepted
        prompt + reference_greedy(model, prompt, TOKENS, set())
        for prompt in [PROMPT, *(prompt_of(len(PROMPT), seed) for seed in range(1, 4))]
    ]
    batch = mx.array(sequences)
    hidden = target.backbone(batch[:, :-2])
    tokens, labels = batch[:, 1:-1], batch[:, 2:]

    def loss(module):
        logits = target.lm_head(module.norm(mtp_forward(module, target, tokens, hidden)))
        return nn.losses.cross_entropy(logits, labels).mean()

    step = nn.value_and_grad(draft, loss)
    optimizer = optim.Adam(learning_rate=3e-3)
    draft.target_norm.freeze()
    for _ in range(steps):
        _, grads = step(draft)
        optimizer.update(draft, grads)
        mx.eval(draft.parameters(), optimizer.state)
    draft.unfreeze()


CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
    "mtp.norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def hugging_face_layout(weights: dict[str, mx.array], fused: bool = False) -> dict:
    """A Qwen checkpoint as published: one tensor per expert (Qwen3-Next) or the gate and up
    projections of all experts fused (Qwen3.5, `fused`, its names `model.language_model.*`),
    convolutions (C, 1, K), the norms zero-centred (mlx-lm's sanitize undoes each)."""
    out = {}
    for name, w in weights.items():
        if fused:
            name = name.replace("language_model.model.", "model.language_model.")
            name = name.replace("language_model.lm_head.", "lm_head.")
        if ".switch_mlp." in name:
            prefix, _, proj = name.rpartition(".switch_mlp.")
            if not fused:
                for e in range(w.shape[0]):
                    out[f"{prefix}.experts.{e}.{proj}"] = w[e]
            elif proj.startswith("down_proj"):
                out[f"{prefix}.experts.down_proj"] = w
            elif proj.startswith("gate_proj"):
                up = weights[
                    name.replace("gate_proj", "up_proj").replace(
                        "model.language_model.", "language_model.model."
                    )
                ]
                out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([w, up], axis=-2)
            continue
        if "conv1d.weight" in name:
            w = w.moveaxis(2, 1)
        elif name.endswith(CENTRED):
            w = w - 1.0
        out[name] = w
    return out


def published_mla(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """DeepSeek-V3's `kv_b_proj` of the nextn layer from mlx-lm's split of it (its sanitize
    splits the published one into `embed_q` and `unembed_out`)."""
    prefix = f"model.layers.{config['num_hidden_layers']}.self_attn"
    embed_q = weights.pop(f"{prefix}.embed_q.weight")  # (heads, rank, nope)
    unembed = weights.pop(f"{prefix}.unembed_out.weight")  # (heads, v, rank)
    joined = mx.concatenate([embed_q.swapaxes(-1, -2), unembed], axis=1)
    weights[f"{prefix}.kv_b_proj.weight"] = joined.reshape(-1, joined.shape[-1])
    return weights


def save_mtp_target(path, name: str, seed: int = 0):
    """A tiny random target of `MTP_FAMILIES[name]` with a tokenizer and `mtp.*` tensors,
    saved as a checkpoint mlx-lm loads (its own layout: mlx-lm's sanitize drops `mtp.*`)."""
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    module, fields = MTP_FAMILIES[name]
    model_type = name
    model = build(model_type, seed=seed, fields=fields, families={model_type: (module, fields)})
    config = {"model_type": model_type, **json.loads(json.dumps(fields))}
    text = config.get("text_config") or config
    nextn = model_type in NEXTN_FAMILIES
    text["num_nextn_predict_layers" if nextn else "mtp_num_hidden_layers"] = 1
    if text is not config:  # as Qwen3.5's published configs name it
        text["model_type"] = f"{model_type}_text"
    weights = dict(tree_flatten(model.parameters()))
    mx.random.seed(seed + 2)
    for key, w in weights.items():  # norms away from 1, the final one read by the MTP layer
        if key.endswith("norm.weight"):
            weights[key] = mx.random.uniform(0.5, 1.5, w.shape)
    model.load_weights(list(weights.items()))
    weights.update(mtp_tensors(model_type, config, seed + 1, model))
    if model_type == "qwen3_next":  # mlx-lm loads it with mtp.* in the published layout only
        weights = hugging_face_layout(weights)
    if model_type == "qwen3_5_moe":  # and Qwen3.5 MoE as published, beside Qwen3.5 as converted
        weights = hugging_face_layout(weights, fused=True)
    if model_type in ("deepseek_v3", "glm_moe_dsa"):  # their nextn layers' MLA as published
        weights = published_mla(weights, config)
    if model_type in NEXTN_FAMILIES:  # the nextn layer's experts one by one, as published
        weights = {
            **{k: v for k, v in weights.items() if ".switch_mlp." not in k},
            **hugging_face_layout({k: v for k, v in weights.items() if ".switch_mlp." in k}),
        }
        num_layers = config["num_hidden_layers"]  # and its copies of the embedding and head
        weights[f"model.layers.{num_layers}.embed_tokens.weight"] = weights[
            "model.embed_tokens.weight"
        ]
        weights[f"model.layers.{num_layers}.shared_head.head.weight"] = weights["lm_head.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    built = {}

    def get(name: str):
        if name not in built:
            path = save_mtp_target(root / name, name)
            model, tokenizer = load(path)
            tokenizer.eos_token_ids = []
            draft = load_draft("mtp", target=path)
            expected = reference_greedy(model, PROMPT, TOKENS, set())
            assert len(set(expected)) > 20, "a degenerate random model proves little"
            built[name] = path, model, tokenizer, draft, expected
        return built[name]

    return get


def generated(model, draft, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kwargs))
    return [t for r in responses for t in r.tokens], responses


@pytest.mark.parametrize("block_size", [3, 5, 8])
@pytest.mark.parametrize(
    "name", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "glm4_moe", "glm_moe_dsa"]
)
def test_greedy_equals_mlx_lm(checkpoints, name, block_size):
    _, model, tokenizer, draft, expected = checkpoints(name)
    tokens, responses = generated(
        model, draft, tokenizer, PROMPT, block_size=block_size, max_tokens=TOKENS
    )
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    accepted = [r.accepted for r in responses[1:-1]]
    assert sum(r.proposed for r in responses) >= (TOKENS - 1) // block_size
    assert len(set(accepted)) > 1  # drafts accepted and rejected: rollbacks of several depths


def chain_from_scratch(
    model, draft, name: str, sequence: list[int], length: int, vocab: list[int] | None = None
) -> tuple[list[int], np.ndarray]:
    """The greedy chain after `sequence` (its last token the root), the MTP layer run over the
    whole sequence without a cache at every step: the target's final hidden states from
    mlx-lm's own backbone (after its norm), each with the embedding of the token after it.
    With a draft vocabulary `vocab`, each step's best of the full head's logits at those
    columns, mapped back to its id. Also each step's log-probabilities over the columns."""
    target = TargetAdapter(model)
    hidden = target.backbone(mx.array(sequence[:-1])[None])
    tokens = mx.array(sequence[1:])[None]
    columns = np.arange(VOCAB) if vocab is None else np.array(vocab)
    chain, logprobs = [], []
    for _ in range(length):
        out = mtp_forward(draft, target, tokens, hidden)[:, -1:]
        normed = draft.norm(out)
        logits = np.array(target.lm_head(normed[0, -1]), dtype=np.float64)[columns]
        chain.append(int(columns[logits.argmax()]))
        logprobs.append(logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
        carried = out if name in NEXTN_FAMILIES else normed  # as vLLM runs each family's
        hidden = mx.concatenate([hidden, carried], axis=1)
        tokens = mx.concatenate([tokens, mx.array([[chain[-1]]])], axis=1)
    return chain, np.stack(logprobs)


@pytest.mark.parametrize(
    "name", ["qwen3_5", "qwen3_next", "glm4_moe", "deepseek_v3", "glm_moe_dsa"]
)
def test_every_chain_equals_the_mtp_layer_run_from_scratch(checkpoints, name, monkeypatch):
    """The cache bookkeeping (waiting features, entries of the target's hidden states only,
    the steps' entries trimmed, a long prompt run ahead in chunks) drafts what the layer drafts
    over the whole sequence."""
    _, model, tokenizer, draft, expected = checkpoints(name)
    calls = []
    propose = MTPDraft.propose

    def recorded(self, blocks, embed, lm_head, rows):
        before = [row.cache.tokens + [blocks[0, 0].item()] for row in rows]
        out = propose(self, blocks, embed, lm_head, rows)
        calls.append((before[0], out[0][0].tolist()))
        return out

    monkeypatch.setattr(MTPDraft, "propose", recorded)
    monkeypatch.setattr(mtp, "CATCH_UP_STEP", 8)  # the prompt's positions run in chunks
    tokens, _ = generated(model, draft, tokenizer, PROMPT, block_size=4, max_tokens=32)
    assert tokens == expected[:32]
    assert len(calls) > 10
    if name == "glm_moe_dsa":  # the later chains' queries see more keys than the indexer keeps
        assert max(len(sequence) for sequence, _ in calls) > GLM_DSA["index_topk"]
    for sequence, chain in calls[::2]:  # each check reruns the whole sequence
        scratch, _ = chain_from_scratch(model, draft, name, sequence, len(chain))
        assert chain == scratch, len(sequence)


def with_vocab(path, vocab: list[int], out):
    """A copy of the checkpoint at `path` whose config.json lists its MTP layers' draft
    vocabulary, in any order, with repeats (`train export --draft-vocab` writes it sorted)."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config[mtp.VOCAB_KEY] = [vocab[-1], *vocab]
    (out / "config.json").write_text(json.dumps(config))
    return out


def row_after(draft, target, sequence: list[int], length: int) -> MTPRow:
    """A reply holding `sequence[:length]`, its features waiting for the next chain."""
    state = SimpleNamespace(draft=draft.make_cache(), tokens=sequence[:length])
    taps = draft.config.target_layer_ids
    features = target.forward(mx.array(state.tokens)[None], None, taps=taps).features
    draft.append_context(features, [MTPRow(state)])
    return MTPRow(state)


def best_prefixes(logprobs: np.ndarray, vocab: list[int], budget: int) -> dict[tuple, float]:
    """The `budget` most likely prefixes (as id tuples) of positions independent given the
    root, each position's `logprobs` over the columns `vocab`: every prefix of each
    position's `budget` best columns, scored."""
    best = [np.argsort(-row)[:budget] for row in logprobs]
    prefixes = {(): 0.0}
    for depth, columns in enumerate(best):
        longest = [p for p in prefixes if len(p) == depth]
        for prefix in longest:
            for c in columns:
                prefixes[(*prefix, vocab[c])] = prefixes[prefix] + logprobs[depth, c]
    del prefixes[()]
    return dict(sorted(prefixes.items(), key=lambda item: -item[1])[:budget])


def tree_prefixes(tree) -> dict[tuple, float]:
    """A drafted tree's nodes below the root, as their prefixes' ids, with their scores."""
    tokens, parents = np.array(tree.tokens).tolist(), np.array(tree.parents).tolist()
    out = {}
    for node in range(1, len(tokens)):
        path, at = [], node
        while at > 0:
            path.append(tokens[at])
            at = parents[at]
        out[tuple(reversed(path))] = float(tree.logprobs[node].item())
    return out


@pytest.mark.parametrize("name", ["qwen3_5", "glm4_moe"])
def test_chains_and_trees_through_a_draft_vocabulary_equal_the_restricted_layer(checkpoints, name):
    """Through a draft vocabulary's head the MTP layer's chain is the greedy chain over those
    columns of the full head's logits, mapped back to their ids (the layer run from scratch
    over the whole sequence), its q 0 outside them and their log-softmax inside; its tree
    holds the best prefixes of each step's top columns along that chain."""
    _, model, _, draft, expected = checkpoints(name)
    target = TargetAdapter(model)
    sequence, n = PROMPT + expected, len(PROMPT) + 9
    unrestricted, _ = chain_from_scratch(model, draft, name, sequence[: n + 1], 4)
    vocab = sorted((set(range(0, VOCAB, 2)) | set(expected[::3])) - {unrestricted[0]})
    head = target.draft_head(vocab)
    root = mx.array([sequence[n]])

    [(chain, logq)] = draft.propose(
        root[None],
        target.embed_tokens,
        head,
        requests([row_after(draft, target, sequence, n)], [greedy_choose], [4]),
    )
    reference, logprobs = chain_from_scratch(model, draft, name, sequence[: n + 1], 4, vocab)
    assert chain.tolist() == reference and reference[0] != unrestricted[0]
    logq = np.array(logq)
    assert (logq[:, np.setdiff1d(np.arange(VOCAB), vocab)] == -np.inf).all()
    np.testing.assert_allclose(logq[:, vocab], logprobs, atol=1e-4)

    budget = 6
    [tree] = draft.trees(
        3,
        target.embed_tokens,
        head,
        [DraftTree(root, row_after(draft, target, sequence, n), budget)],
    )
    drafted, best = tree_prefixes(tree), best_prefixes(logprobs[:3], vocab, budget)
    assert drafted.keys() == best.keys()
    assert all(abs(drafted[k] - best[k]) < 1e-4 for k in best)


@pytest.mark.parametrize(
    "name, setting", [("qwen3_5", dict(block_size=4)), ("glm4_moe", dict(tree_budget=6))]
)
def test_greedy_with_a_draft_vocabulary_equals_mlx_lm(
    checkpoints, tmp_path, monkeypatch, name, setting
):
    """MTP layers whose checkpoint lists a draft vocabulary draft inside it, in chains (Qwen3.5)
    and in trees (GLM-4.5), and the reply is mlx-lm's; `full_vocab` ignores the list, and a
    list outside the vocabulary is refused in one line."""
    path, model, tokenizer, _, expected = checkpoints(name)
    vocab = sorted(set(range(0, VOCAB, 2)) | set(expected[::3]))
    draft = load_draft("mtp", target=with_vocab(path, vocab, tmp_path / "vocab"))
    assert draft.config.draft_vocab == vocab
    assert load_draft("mtp", target=tmp_path / "vocab", full_vocab=True).config.draft_vocab is None
    drafted = []
    propose, trees = MTPDraft.propose, MTPDraft.trees

    def proposed(self, *args):
        out = propose(self, *args)
        drafted.extend(t for tokens, _ in out for t in tokens.tolist())
        return out

    def grown(self, *args):
        out = trees(self, *args)
        for tree in out:  # not the root, nor the prompt lookup's grafted chain
            grafted = set(np.array(tree.chain).tolist())
            nodes = np.array(tree.tokens).tolist()
            drafted.extend(t for i, t in enumerate(nodes) if i and i not in grafted)
        return out

    monkeypatch.setattr(MTPDraft, "propose", proposed)
    monkeypatch.setattr(MTPDraft, "trees", grown)
    tokens, responses = generated(model, draft, tokenizer, PROMPT, max_tokens=TOKENS, **setting)
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.accepted for r in responses) > 0
    assert len(drafted) > TOKENS // 4 and set(drafted) <= set(vocab)

    config = json.loads((tmp_path / "vocab" / "config.json").read_text())
    config[mtp.VOCAB_KEY] = [1, VOCAB]
    (tmp_path / "vocab" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"mtp_draft_vocab must be .* in \\[0, {VOCAB}\\)"):
        load_draft("mtp", target=tmp_path / "vocab")


def requests(rows, chooses, lengths) -> list[DraftChain]:
    return [DraftChain(row, choose, n) for row, choose, n in zip(rows, chooses, lengths)]


def greedy_choose(logits, context=None):
    """Greedy drafts with the log q sampling would verify."""
    return mx.argmax(logits, axis=-1), logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_rows_drafted_together_equal_each_drafted_alone(checkpoints):
    """Replies that share a cycle draft in one MTP forward per step, each row over its own
    caches and waiting positions (padded to the longest): their chains and log q are each
    reply's own."""
    _, model, _, draft, expected = checkpoints("qwen3_5")
    target = TargetAdapter(model)
    sequence = PROMPT + expected

    def features(tokens):
        taps = draft.config.target_layer_ids
        return target.forward(mx.array(tokens)[None], None, taps=taps).features

    def row(length, consumed):
        """A reply holding `length` positions, the first `consumed` run through the layer."""
        state = SimpleNamespace(draft=draft.make_cache(), tokens=sequence[:consumed])
        rows = [MTPRow(state)]
        draft.append_context(features(sequence[:consumed]), rows)
        draft.propose(
            mx.array([[sequence[consumed]]]),
            target.embed_tokens,
            target.lm_head,
            requests(rows, [greedy_choose], [2]),
        )
        state.tokens = sequence[:length]
        draft.append_context(features(sequence[:length])[:, consumed:], rows)
        return state

    states = [row(30, 22), row(26, 25), row(41, 33)]
    roots = mx.array([[sequence[len(s.tokens)]] for s in states])
    lengths = [3, 5, 1]
    alone = [
        draft.propose(
            roots[i : i + 1],
            target.embed_tokens,
            target.lm_head,
            requests([MTPRow(copy.deepcopy(s))], [greedy_choose], [n]),
        )[0]
        for i, (s, n) in enumerate(zip(states, lengths))
    ]
    together = draft.propose(
        roots,
        target.embed_tokens,
        target.lm_head,
        requests([MTPRow(s) for s in states], [greedy_choose] * 3, lengths),
    )
    for (tokens, logq), (solo_tokens, solo_logq) in zip(together, alone):
        assert tokens.tolist() == solo_tokens.tolist()
        assert mx.allclose(logq, solo_logq, atol=1e-4).item()
    assert [s.draft[0].offset for s in states] == [30, 26, 41]


def test_cli_generates_with_mtp_and_info_says_which_checkpoints_have_it(
    checkpoints, make_pair, tmp_path
):
    path, model, _, _, _ = checkpoints("qwen3_next")
    _, tokenizer = load(path)
    prompt = "def add(a, b):"
    ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    expected, _ = decode_greedy(model, tokenizer, ids, 40)
    out = dflash_in_process(
        f"generate --model {path} --draft mtp --max-tokens 40 --block-size 3 --json -p '{prompt}'"
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["text"] == expected
    assert reply["proposed"] > 0

    llama, _ = make_pair("llama-tied-gqa")
    qwen3, _ = make_pair("qwen3-tied-gqa")
    bare = tmp_path / "no-mtp"
    shutil.copytree(path, bare)
    weights = mx.load(str(bare / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(bare / "model.safetensors"), kept)
    refusals = {
        qwen3: "target model type 'qwen3' has no MTP layers dflash-mlx can run",
        llama: "no published llama checkpoint has one; `dflash-mlx train fit --arch mtp` does",
        bare: "has no MTP tensors: mlx-lm's conversion drops them",
    }
    for target, why in refusals.items():
        out = dflash_in_process(f"generate --model {target} --draft mtp -p x")
        assert out.returncode == 1 and "Traceback" not in out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("dflash-mlx generate: error: ") and why in last, out.stderr
    out = dflash_in_process(f"generate --model {llama} --draft {llama} --mtp-bits 4 -p x")
    assert out.returncode == 1 and "quantizes the 'mtp' drafter only" in out.stderr
    cached = f"generate --model {path} --draft mtp --prompt-cache-file {tmp_path / 'c'} -p x"
    out = dflash_in_process(cached)
    assert out.returncode == 1 and "do not keep the MTP layers' caches" in out.stderr

    answers = {
        path: "yes: 1 MTP layer(s), unquantized (qwen3_next; --draft mtp)",
        qwen3: "no: target model type 'qwen3' has no MTP layers",
        llama: "no: no MTP tensors in this llama checkpoint (no published llama checkpoint",
        bare: "no: no MTP tensors in this qwen3_next checkpoint",
    }
    for target, said in answers.items():
        out = dflash_in_process(f"info --model {target}")
        assert out.returncode == 0, out.stderr
        rows = dict(re.split(r"  +", line, maxsplit=1) for line in out.stdout.splitlines())
        assert rows["MTP layers"].startswith(said), rows


def test_a_family_whose_mtp_block_cannot_run_is_refused_in_one_line(tmp_path):
    """DeepSeek-V4.1's checkpoints carry `mtp.*` stages this drafter cannot run (a DSpark stack,
    configured as the published one): generate refuses them in one line naming why, and info
    says so."""
    build_tokenizer(tmp_path)
    model = build("deepseek_v41")
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    last_layers = list(range(DEEPSEEK_V41["num_hidden_layers"])[-3:])
    dspark = {"num_nextn_predict_layers": 3, "dspark_target_layer_ids": last_layers}
    config = {"model_type": "deepseek_v41", **DEEPSEEK_V41, **dspark, "dspark_block_size": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    why = "target model type 'deepseek_v41' has no MTP drafter here: its checkpoints' `mtp.0-2.*`"
    out = dflash_in_process(f"generate --model {tmp_path} --draft mtp -p x")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("dflash-mlx generate: error: ") and why in last, out.stderr
    assert "not DeepSeek-V4's MTP block" in last and "3-stage DSpark drafter" in last
    out = dflash_in_process(f"info --model {tmp_path}")
    assert out.returncode == 0 and f"no: {why}" in out.stdout, out.stdout


def test_bench_measures_the_mtp_layers_and_says_so(checkpoints, tmp_path):
    """`bench --draft mtp` runs the target's MTP layers beside mlx-lm's decoding, equal to it,
    times their drafts in the cycle split, and names MTP in what it prints."""
    path, _, _, _, _ = checkpoints("qwen3_next")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def add(a, b):", "The quick brown fox"]))
    out = tmp_path / "bench.json"
    command = (
        f"bench --model {path} --draft mtp --max-tokens 24 --block-size 3 --prompts {prompts} "
        f"--out {out} --plot {tmp_path / 'bench.png'}"
    )
    run = dflash_in_process(command)
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())
    assert results["config"]["system"] == "MTP"
    assert results["config"]["draft"] == "the target's MTP layers"
    overall = results["overall"]
    assert overall["identical"] == overall["prompts"] == 2
    assert overall["acceptance"]["per_position"] and overall["split_ms"]["draft"] > 0
    assert overall["split_ms"]["context"] > 0
    assert "MTP tok/s" in run.stdout and "MTP cycles" in run.stdout and "DFlash" not in run.stdout


@pytest.mark.parametrize("setting", [dict(tree_budget=6), dict()])
def test_trees_from_the_top_k_and_the_default_strategy_are_lossless(checkpoints, setting):
    """A target that verifies trees (glm4_moe: plain KV caches) takes trees of the MTP layers'
    top-k at each step of their greedy chain, with a tree budget or by the default's choice."""
    _, model, tokenizer, draft, expected = checkpoints("glm4_moe")
    tokens, responses = generated(model, draft, tokenizer, PROMPT, max_tokens=TOKENS, **setting)
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    drafting = responses[-1].drafting
    assert drafting.trees > 0 and sum(r.accepted for r in responses) > 0
    if setting:
        assert drafting.chains == 0


@pytest.mark.parametrize("name", ["glm4_moe", "qwen3_5", "qwen3_next"])
def test_server_shares_mtp_cycles_with_per_row_acceptance(checkpoints, monkeypatch, name):
    """Four concurrent requests verify in shared cycles, each row accepting its own drafts
    (no uniform acceptance across the batch), and each reply is the one it gets alone: on
    plain KV caches (glm4_moe) and on recurrent ones (Qwen3.5, Qwen3-Next: each row's state
    rolled back as far as that row rejected)."""
    _, model, tokenizer, draft, _ = checkpoints(name)
    settled = []
    settle = cycle.settle

    def recorded(pending, *args, **kwargs):
        commits = settle(pending, *args, **kwargs)
        settled.append([commit.accepted for _, commit in commits])
        return commits

    monkeypatch.setattr(cycle, "settle", recorded)
    prompts = [PROMPT, *(prompt_of(len(PROMPT), seed) for seed in range(1, 4))]
    requests = [{"prompt": p, "max_tokens": 40} for p in prompts]
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=40), max_batch=4)
    worker.batch.widths.policy = lambda reply, rows: FixedPlan(Plan(3))  # shared: 3 drafts a row
    with serving(worker) as port:
        alone = [answer(port, **r) for r in requests]
        together = burst(worker, port, requests, send=answer)
    texts = [a["choices"][0]["text"] for a in together]
    assert texts == [a["choices"][0]["text"] for a in alone]
    assert texts[0] == detokenized(tokenizer, reference_greedy(model, PROMPT, 40, set()))
    assert all(a["dflash"]["shared_cycles"] > 0 for a in together)
    assert any(len(set(accepted)) > 1 for accepted in settled if len(accepted) > 1)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_drafts_equal_mlx_vlms_mtp_drafter(checkpoints, name):
    """An independent reference: mlx-vlm's Qwen3.5 MTP drafter (in the test extra only)
    on the same `mtp.*` tensors and target drafts the same chain after a prompt."""
    drafters = pytest.importorskip("mlx_vlm.speculative.drafters.qwen3_5_mtp")
    path, model, _, draft, expected = checkpoints(name)
    config = json.loads((path / "config.json").read_text())
    reference = drafters.Model(drafters.ModelConfig.from_dict(config))
    published_layout = name == "qwen3_5_moe"  # the test's qwen3_5 is as mlx-lm converts it
    tensors = {  # its splitter strips the prefix of an MLX checkpoint's, whose norms are whole
        k if published_layout else k.removeprefix("mtp."): v
        for k, v in mx.load(str(path / "model.safetensors")).items()
        if k.startswith("mtp.")
    }
    reference.load_weights(list(reference.sanitize(tensors).items()))
    reference.set_dtype(mx.float32)
    reference.reset(model)

    target = TargetAdapter(model)
    prompt, root = PROMPT, expected[0]
    hidden = target.backbone(mx.array(prompt)[None])
    reference.prefill_from_target_hidden(mx.array(prompt)[None], hidden, root, None, greedy=True)
    theirs = reference.draft_block(root, hidden[:, -1:], None, 6, None, greedy=True)

    state = SimpleNamespace(draft=draft.make_cache(), tokens=list(prompt))
    taps = draft.config.target_layer_ids
    draft.append_context(
        target.forward(mx.array(prompt)[None], None, taps=taps).features, [MTPRow(state)]
    )
    [(ours, _)] = draft.propose(
        mx.array([[root]]),
        target.embed_tokens,
        target.lm_head,
        requests([MTPRow(state)], [greedy_choose], [5]),
    )
    assert ours.tolist() == theirs[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, vocab",
    [
        (dict(temperature=0.8, top_k=5), False),
        (dict(temperature=0.8, top_k=5, acceptance="coupled"), False),
        (dict(temperature=0.8, top_k=5), True),
    ],
)
def test_sampled_replies_follow_the_targets_distribution(checkpoints, tmp_path, setting, vocab):
    """Tokens 3 and 4 of 600 sampled replies (drafts accepted, resampled or the target's
    own) follow the target's exact marginals, under the speculative and the coupled rule,
    and with a draft vocabulary that lacks the greedy reply's third token (q 0 there)."""
    path, model, tokenizer, draft, expected = checkpoints("qwen3_5")
    if vocab:
        ids = sorted((set(range(0, VOCAB, 2)) | set(expected[:10])) - {expected[2]})
        draft = load_draft("mtp", target=with_vocab(path, ids, tmp_path / "vocab"))
    transform = make_logprobs_transform(**{k: v for k, v in setting.items() if k != "acceptance"})
    expected = exact_marginals(model, PROMPT, transform, 4)
    mx.random.seed(4)
    tokens, accepted = sample_runs(model, draft, tokenizer, PROMPT, 4, **setting)
    counts = np.bincount(accepted, minlength=4)
    assert counts[0] > 0 and counts[1:].sum() > 0  # both accepted drafts and resamples ran
    for k in (2, 3):
        assert chi2_pvalue(np.array([t[k] for t in tokens]), expected[k]) > SIGNIFICANCE


@pytest.mark.parametrize("name", ["qwen3_5", "glm4_moe", "glm_moe_dsa"])
def test_a_prompt_cache_carries_the_mtp_layers_across_turns(checkpoints, name):
    """A turn that extends the cached one goes on from the MTP layer's entries; one that
    parts from it inside them starts afresh (an entry holds the token after its position);
    either reply is mlx-lm's."""
    _, model, tokenizer, draft, _ = checkpoints(name)
    cache = make_prompt_cache(model, draft)
    first, _ = generated(model, draft, tokenizer, PROMPT, max_tokens=20, prompt_cache=cache)
    extended = PROMPT + first + [5, 6, 7]
    parted = extended[: len(PROMPT) + 10] + [9]
    for turn in (extended, parted):
        tokens, _ = generated(model, draft, tokenizer, turn, max_tokens=20, prompt_cache=cache)
        assert tokens == reference_greedy(model, turn, 20, set())
        assert cache.draft[0].offset == cache.target[0].offset == len(cache.tokens)


def test_quantized_mtp_layers_load_and_stay_lossless(checkpoints, tmp_path):
    """`--mtp-bits` quantizes the MTP layers; a checkpoint that stores them quantized (as
    mlx-lm's and mlx-vlm's conversions quantize a whole checkpoint) loads them so."""
    path, _, tokenizer, _, expected = checkpoints("qwen3_5")
    model, _ = load(path)  # fresh copies: they are quantized below
    draft = load_draft("mtp", target=path)
    quantized = load_draft("mtp", target=path, mtp_bits=8)
    assert quantized.config.quantization == {"group_size": 64, "bits": 8}
    assert any(isinstance(m, nn.QuantizedLinear) for m in quantized.modules())
    tokens, _ = generated(model, quantized, tokenizer, PROMPT, block_size=4, max_tokens=TOKENS)
    assert tokens == expected

    stored = tmp_path / "quantized"
    shutil.copytree(path, stored)
    q = {"group_size": 32, "bits": 8}

    def quantizable(name, module):
        return hasattr(module, "to_quantized") and module.weight.shape[-1] % 32 == 0

    nn.quantize(model, **q, class_predicate=quantizable)
    nn.quantize(draft, **q, class_predicate=quantizable)
    weights = dict(tree_flatten(model.parameters()))
    weights.update(
        (f"mtp.{k}", v)
        for k, v in tree_flatten(draft.parameters())
        if not k.startswith("target_norm")
    )
    mx.save_safetensors(str(stored / "model.safetensors"), weights)
    config = json.loads((stored / "config.json").read_text())
    (stored / "config.json").write_text(json.dumps({**config, "quantization": q}))
    model, _ = load(stored)
    kept = load_draft("mtp", target=stored)
    assert kept.config.quantization == q
    tokens, _ = generated(model, kept, tokenizer, PROMPT, block_size=4, max_tokens=TOKENS)
    assert tokens == reference_greedy(model, PROMPT, TOKENS, set())
    out = dflash_in_process(f"info --model {stored}")
    assert "yes: 1 MTP layer(s), quantized (qwen3_5; --draft mtp)" in out.stdout


def test_a_failed_choice_leaves_every_rows_cache_as_it_was(checkpoints):
    """A row whose choice fails (a logits processor raising) leaves the MTP caches where they
    stood, so the cycle's rows can be put back and run again alone."""
    _, model, _, draft, expected = checkpoints("qwen3_5")
    target = TargetAdapter(model)
    sequence = PROMPT + expected
    state = SimpleNamespace(draft=draft.make_cache(), tokens=sequence[:30])
    rows = [MTPRow(state)]
    taps = draft.config.target_layer_ids
    features = target.forward(mx.array(state.tokens)[None], None, taps=taps).features
    draft.append_context(features, rows)
    before = copy.deepcopy(state)

    def failing(logits, context=None):
        raise ValueError("a processor failed")

    args = (mx.array([[sequence[30]]]), target.embed_tokens, target.lm_head)
    with pytest.raises(ValueError, match="a processor failed"):
        draft.propose(*args, requests(rows, [failing], [4]))
    assert state.draft[0].offset == 30 and state.draft[0].layers[0].offset == 0
    again = draft.propose(*args, requests(rows, [greedy_choose], [4]))[0][0]
    fresh = draft.propose(*args, requests([MTPRow(before)], [greedy_choose], [4]))[0][0]
    assert again.tolist() == fresh.tolist()
