"""Builders for tiny random targets, tokenizers and drafters saved to disk."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts a block of tokens and verifies it in one pass.",
    "How many positive whole-number divisors does 196 have?",
    "print('hello world')  # a comment",
    "Alice has 3 apples and buys 5 more; how many apples does she have now?",
] * 20
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A template that renders tools, assistant tool calls and a `style` keyword, with the
# markers mlx-lm's tool-parser inference looks for (its json_tools format).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.tool_calls %}{% for call in m.tool_calls %}{% set tool_call = call.function %}"
    "<tool_call>{{ {'name': tool_call.name, 'arguments': tool_call.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if style %}({{ style }}) {% endif %}{% endif %}"
)
# One added token holding a whole tool call, so a logit bias can make a random model call.
TOOL_CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
TOKENIZER_VOCAB = 300
EXTRA_ROWS = 20  # embedding rows beyond the tokenizer, like Qwen's padded vocab
# Loading casts to float32 only on the CPU; a GPU (Metal or CUDA) keeps the checkpoint's dtype.
cpu_default = pytest.mark.skipif(
    mx.default_device().type == mx.gpu, reason="float32 is the CPU's default"
)


def build_tokenizer(path: Path, bos: bool = True, tools: bool = False) -> int:
    """Train a byte-level BPE tokenizer and save it the way transformers reads it.

    With `tools`, the chat template is `TOOL_CHAT_TEMPLATE` and `TOOL_CALL` is
    one more token (id `TOKENIZER_VOCAB`, inside the model's padded vocabulary).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    vocab = tok.get_vocab_size()
    if tools:
        tok.add_tokens([AddedToken(TOOL_CALL, special=False, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>" if bos else None,
        "eos_token": "</s>",
        "chat_template": TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


def save_target(
    path: Path,
    family: str = "llama",
    *,
    hidden: int = 64,
    layers: int = 6,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = True,
    eos_token_id: int = 1,
    bos: bool = True,
    seed: int = 0,
    nested_rope: bool = False,
    tools: bool = False,
) -> Path:
    """A tiny random mlx-lm target (llama or qwen3) with tokenizer, saved to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path, bos=bos, tools=tools) + EXTRA_ROWS
    config = {
        "model_type": family,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "eos_token_id": eos_token_id,
        "bos_token_id": 0,
    }
    theta = 50000.0
    if nested_rope:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        config["rope_theta"] = theta
    module = {"llama": llama, "qwen3": qwen3}[family]
    args = module.ModelArgs.from_dict({**config, "rope_theta": theta})
    mx.random.seed(seed)
    model = module.Model(args)
    # Larger-than-default init so tiny random models have peaked, non-degenerate outputs.
    params = tree_flatten(model.parameters())
    scaled = [(k, v * 4.0 if v.ndim == 2 else v) for k, v in params]
    model.load_weights(scaled)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path


def set_eos(path: Path, eos_token_id: int) -> None:
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (path / "config.json").write_text(json.dumps(config))


def layer_tensors(
    p: str, mat, norm, hidden: int, shape: tuple[int, int, int], inter: int, values: bool = True
) -> dict[str, np.ndarray]:
    """A draft layer's attention, MLP and norm tensors under prefix `p`; `shape` is
    (heads, kv heads, head dim); `values` False leaves out `v_proj` (K = V attention)."""
    heads, kv_heads, head_dim = shape
    w = {
        p + "self_attn.q_proj.weight": mat(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, hidden),
    }
    if values:  # drawn in this order, so the random drafters stay as they were
        w[p + "self_attn.v_proj.weight"] = mat(kv_heads * head_dim, hidden)
    w[p + "self_attn.o_proj.weight"] = mat(hidden, heads * head_dim)
    w[p + "self_attn.q_norm.weight"] = norm(head_dim)
    w[p + "self_attn.k_norm.weight"] = norm(head_dim)
    w[p + "mlp.gate_proj.weight"] = mat(inter, hidden)
    w[p + "mlp.up_proj.weight"] = mat(inter, hidden)
    w[p + "mlp.down_proj.weight"] = mat(hidden, inter)
    w[p + "input_layernorm.weight"] = norm(hidden)
    w[p + "post_attention_layernorm.weight"] = norm(hidden)
    return w


def save_draft(
    path: Path,
    target_config: dict,
    *,
    layers: int = 2,
    target_layer_ids: list[int] | None = None,
    block_size: int = 16,
    seed: int = 1,
    shards: int = 1,
    nested_rope: bool = False,
    dtype: str = "bfloat16",
    heads: int | None = None,
    kv_heads: int | None = None,
    dflash2: dict | None = None,
) -> Path:
    """A tiny random drafter in the published (z-lab) layout: bf16 safetensors, Qwen3 config.

    `dflash2` (e.g. DFLASH2) makes it a DFlash 2 drafter with the names, shapes and
    config fields of z-lab/dflash's tests/fixtures/dflash2-{config,safetensors-header}.json:
    convolutions around every sublayer, a candidate selector, sliding layers.
    """
    path.mkdir(parents=True, exist_ok=True)
    hidden = target_config["hidden_size"]
    heads = heads or target_config["num_attention_heads"]
    kv_heads = kv_heads or target_config["num_key_value_heads"]
    head_dim = hidden // heads
    n_features = len(target_layer_ids) if target_layer_ids else layers
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 1.5 / math.sqrt(cols), (rows, cols))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.normal(size=n)

    w = {"fc.weight": mat(hidden, n_features * hidden), "hidden_norm.weight": norm(hidden)}
    w["norm.weight"] = norm(hidden)
    inter = hidden * 2
    for i in range(layers):
        p = f"layers.{i}."
        w.update(layer_tensors(p, mat, norm, hidden, (heads, kv_heads, head_dim), inter))
        if dflash2:
            taps, groups = dflash2["conv_kernel_size"], hidden // dflash2["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.3 * rng.normal(size=(2, taps, hidden))
                base[:, 0] += 1.0  # near an identity, so random activations stay tame
                w[f"{p}{conv}.base_kernel"] = base
                w[f"{p}{conv}.kernel_projection.weight"] = 0.3 * mat(2 * taps * groups, hidden)
    if dflash2:
        rank, vocab = dflash2["selector_rank"], target_config["vocab_size"]
        w["candidate_selector.hidden_projection.weight"] = mat(rank, hidden)
        w["candidate_selector.predecessor_codebook"] = rng.normal(size=(vocab, rank))
        w["candidate_selector.successor_codebook"] = rng.normal(size=(vocab, rank))
    arrays = {k: mx.array(v.astype(np.float32)).astype(getattr(mx, dtype)) for k, v in w.items()}

    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "vocab_size": target_config["vocab_size"],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "block_size": block_size,
        "num_target_layers": target_config["num_hidden_layers"],
        "dflash_config": {"mask_token_id": target_config["vocab_size"] - 1},
        "torch_dtype": dtype,
    }
    if target_layer_ids is not None:
        config["dflash_config"]["target_layer_ids"] = target_layer_ids
    if nested_rope or dflash2:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    else:
        config["rope_theta"] = 1e6
    if dflash2:
        config["architectures"] = ["DFlash2DraftModel"]
        config["is_causal"] = False
        config["layer_types"] = ["sliding_attention"] * layers
        config["sliding_window"] = dflash2["sliding_window"]
        config["use_sliding_window"] = True
        del config["block_size"]  # DFlash 2 keeps it in dflash_config
        fields = {k: v for k, v in dflash2.items() if k != "sliding_window"}
        config["dflash_config"].update(block_size=block_size, **fields)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(arrays)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), arrays)
    else:
        index = {}
        for s in range(shards):
            part = names[s::shards]
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(str(path / file), {k: arrays[k] for k in part})
            index.update({k: file for k in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return path


# DFlash 2 fields as published (Qwen3.8-27B-DFlash2), selector and window scaled down.
DFLASH2 = {
    "conv_group_size": 16,
    "conv_kernel_size": 2,
    "selector_rank": 8,
    "selector_top_k": 16,
    "output_multiplier": 0.5,
    "final_logit_softcapping": 20.0,
    "sliding_window": 12,
}


def copy_dir(source: Path, dest: Path) -> Path:
    """A copy of a model or drafter directory, to edit one of its files."""
    dest.mkdir(exist_ok=True)
    for f in source.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


TRAIN_TAPS = [1, 3, 4]  # the target layers the training tests' features are of


def train_work(data: Path, dest: Path, target: Path) -> tuple[Path, list[str]]:
    """A copy at `dest` of a training work dir's replies and features (conftest's
    `train_data`), without a checkpoint, and the `train` flags naming `target` and it."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "replies.jsonl").write_bytes((data / "replies.jsonl").read_bytes())
    copy_dir(data / "features", dest / "features")
    return dest, ["--model", str(target), "--work", str(dest)]


def fixed_blocks(work: Path) -> tuple[list, np.ndarray]:
    """Every block of the first four sequences of a `train` work dir, as (sequence, anchors)
    pairs, and the vocabulary of its data: the same batch to compare drafters on."""
    from dflash_mlx.train.data import read_records
    from dflash_mlx.train.features import load_features
    from dflash_mlx.train.trainer import Sequence

    records = read_records(work / "replies.jsonl")
    data = [
        Sequence(np.array(r["ids"]), r["start"], **f)
        for r, f in zip(records, load_features(work / "features", len(records)))
    ]
    vocab = np.unique(np.concatenate([s.ids for s in data]))
    return [(s, np.arange(s.start, len(s.ids) - 1)) for s in data[:4]], vocab


def chat_ids(
    tokenizer, messages: list[dict], tools: list | None = None, **template_kwargs
) -> list[int]:
    """Token ids of a conversation as mlx-lm's generate, chat and server encode it: the chat
    template's text, ready for the reply, with no special token added (the template writes
    those it wants)."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def mlx_lm_greedy(
    model: nn.Module, prompt: list[int], max_tokens: int, eos: set[int], **settings
) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's own greedy tokens with `make_logits_processors(**settings)`, stopped at EOS
    (included), and the logprobs vector of each."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(**settings)
    tokens, logprobs = [], []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors
    )
    for token, vector in steps:
        tokens.append(int(token))
        logprobs.append(vector)
        if token in eos:
            break
    return tokens, logprobs


def reference_greedy(model: nn.Module, prompt: list[int], max_tokens: int, eos: set[int]) -> list:
    """mlx-lm's own greedy decode, stopped at EOS (EOS included) or max_tokens."""
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(token))
        if token in eos:
            break
    return out


class BlockByBlock:
    """A test drafter whose draft logits are made for one block at a time
    (`block_logits(block (L,), embed, lm_head, cache)`), each row's over its own cache."""

    def draft_logits(self, blocks, embed, lm_head, caches):
        rows = zip(blocks, caches)
        return mx.stack([self.block_logits(b, embed, lm_head, c) for b, c in rows])


def propose_one(draft, block, embed, head, cache, choose, context=None):
    """`draft.propose` for one block (L,) = [root, mask, ...] over `cache`: (its drafts,
    log q), as a lone reply's cycle asks for them."""
    from dflash_mlx.models.draft import DraftChain

    row = DraftChain(cache, choose, block.shape[0] - 1, context)
    return draft.propose(block[None], embed, head, [row])[0]


def rows_equal_each_alone(draft, model, tree_rows: bool = True) -> None:
    """A drafter's `append_context`, `propose` and `trees` over 3 rows (contexts of different
    lengths, different lengths and budgets wanted) give each row what it gets alone
    (R = 1): caches allclose 1e-6, drafts and trees equal, log q allclose 1e-5; and
    `proposers.trees` of prompt lookups over it grafts each row as alone."""
    from dflash_mlx.decode import proposers
    from dflash_mlx.decode.sampling import make_logprobs_transform
    from dflash_mlx.models.draft import DraftChain, DraftTree
    from dflash_mlx.models.target import TargetAdapter

    target = TargetAdapter(model)
    head = target.draft_head(draft.config.draft_vocab)
    width = len(draft.config.target_layer_ids) * target.hidden_size
    contexts = [5, 9, 2]
    features = mx.random.normal((3, max(contexts), width), key=mx.random.key(3))
    alone, together = [draft.make_cache() for _ in contexts], [draft.make_cache() for _ in contexts]
    for i, (cache, n) in enumerate(zip(alone, contexts)):
        draft.append_context(features[i : i + 1, :n], [cache])
    draft.append_context(features, together, contexts)
    for a, t in zip(alone, together):
        assert [c.offset for c in a] == [c.offset for c in t]
        for x, y in zip(a, t):
            assert mx.allclose(x.keys[..., : x.offset, :], y.keys[..., : y.offset, :], atol=1e-6)
            assert mx.allclose(
                x.values[..., : x.offset, :], y.values[..., : y.offset, :], atol=1e-6
            )

    transform = make_logprobs_transform(1.0)

    def choose(logits, context=None):  # greedy, with the log q sampling would verify
        return mx.argmax(logits, axis=-1), transform(logits)

    mask, roots, lengths = draft.config.mask_token_id, [7, 19, 3], [4, 2, 3]
    blocks = mx.array([[root] + [mask] * 4 for root in roots])
    chains = [DraftChain(cache, choose, n) for cache, n in zip(together, lengths)]
    rows = draft.propose(blocks, target.embed_tokens, head, chains)
    for i, (tokens, logq) in enumerate(rows):
        own = draft.propose(blocks[i : i + 1], target.embed_tokens, head, chains[i : i + 1])
        own_tokens, own_logq = own[0]
        assert tokens.tolist() == own_tokens.tolist() and tokens.size <= lengths[i]
        assert mx.allclose(logq, own_logq, atol=1e-5)
    if not tree_rows:
        return

    budgets = [5, 2, 7]
    scores = [None, lambda logits, token_ids: logits / 2, None]
    root_arrays = [mx.array([root]) for root in roots]
    asked = [DraftTree(*row) for row in zip(root_arrays, together, budgets, scores)]
    trees = [tree.read() for tree in draft.trees(3, target.embed_tokens, head, asked)]
    for i, tree in enumerate(trees):
        own = draft.trees(3, target.embed_tokens, head, asked[i : i + 1])[0].read()
        assert (tree.tokens, tree.parents, tree.depths) == (own.tokens, own.parents, own.depths)
        assert len(tree) <= budgets[i] + 1

    def lookups():
        """Each row's prompt lookup over the drafter, its context ending on a repeat."""
        prompts = [[4, 8, 15, 16, 23, 42, 8], [1, 2, 3, 1], [9, 9, 5, 6, 9]]
        return [
            proposers.LookupProposer(
                prompt, proposers.DrafterProposer(draft, target, cache, choose)
            )
            for prompt, cache in zip(prompts, together)
        ]

    def requests(proposers_):
        return [
            proposers.TreeRequest(p, root, depth, budget)
            for p, root, depth, budget in zip(proposers_, root_arrays, depths, budgets)
        ]

    shared, depths = lookups(), [3, 3, 2]
    grafted = [tree.read() for tree in proposers.trees(requests(shared))]
    for i, (tree, own_lookup) in enumerate(zip(grafted, lookups())):
        own = proposers.trees(requests([None] * i + [own_lookup])[i:])[0].read()
        assert (tree.tokens, tree.parents, tree.depths) == (own.tokens, own.parents, own.depths)
        assert tree.chain == own.chain
    assert any(node >= 0 for tree in grafted for node in tree.chain)  # the lookups grafted


# mlx_lm.generate's verbose output, in its own wording: the reply between two rules, then
# its three stats lines; whatever follows is left in "rest".
MLX_LM_VERBOSE = re.compile(
    r"==========\n(?P<reply>.*)\n==========\n"
    r"Prompt: (?P<prompt_tokens>\d+) tokens, (?P<prompt_tps>\d+\.\d{3}) tokens-per-sec\n"
    r"Generation: (?P<generation_tokens>\d+) tokens, "
    r"(?P<generation_tps>\d+\.\d{3}) tokens-per-sec\n"
    r"Peak memory: (?P<peak_memory>\d+\.\d{3}) GB\n(?P<rest>.*)",
    re.S,
)


def parse_mlx_lm_verbose(output: str) -> dict:
    """The reply and stats of what mlx_lm.generate prints when verbose, parsed as a script
    that reads its output would; fails where the output does not have its shape."""
    match = MLX_LM_VERBOSE.fullmatch(output)
    assert match, f"not mlx_lm.generate's verbose output:\n{output}"
    found = match.groupdict()
    numbers = {k: float(v) for k, v in found.items() if k not in ("reply", "rest")}
    return {**found, **numbers}
