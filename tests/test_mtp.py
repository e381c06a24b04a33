"""The target's own MTP layers as the drafter (`--draft mtp`): tiny random Qwen3.5, Qwen3.5-MoE
and Qwen3-Next checkpoints with `mtp.*` tensors in the published names, loaded from the
target's own safetensors; greedy replies equal to mlx-lm's at several block sizes; every chain
equal to the MTP layer run from scratch over the whole sequence; shared cycles with per-row
acceptance, each reply equal to its solo reply; refusals in one line."""

import json

import mlx.core as mx
import pytest
from helpers import build_tokenizer, reference_greedy
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5, qwen3_5_moe, qwen3_next
from test_families import FAMILIES, PROMPT, build, first_difference

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.models.mtp import MTPDraft, mtp_args

TOKENS = 120
MTP_FAMILIES = {
    "qwen3_5": FAMILIES["qwen3_5"],
    "qwen3_5_moe": FAMILIES["qwen3_5_moe"],
    "qwen3_next": FAMILIES["qwen3_next"],
}
MODULES = {"qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "qwen3_next": qwen3_next}


def mtp_tensors(model_type: str, config: dict, seed: int) -> dict[str, mx.array]:
    """Random `mtp.*` tensors of one MTP layer for a target of this config: an mlx-lm
    decoder layer of the target's own kind, with full attention, in the published names."""
    text = config.get("text_config") or config
    args = mtp_args(model_type, text)
    mx.random.seed(seed)
    draft = MTPDraft(_config(model_type, args), args)
    out = {}
    for name, w in tree_flatten(draft.parameters()):
        if name.startswith("target_norm"):
            continue
        if w.ndim == 1:  # norms away from 1, so that they matter
            w = mx.random.uniform(0.5, 1.5, w.shape)
        else:
            w = w * 4.0 if w.any().item() else mx.random.normal(w.shape) / w.shape[-1] ** 0.5
        out[f"mtp.{name}"] = w
    return out


def _config(model_type, args):
    from dflash_mlx.models.mtp import MTPConfig

    return MTPConfig(
        model_type=model_type,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        num_target_layers=args.num_hidden_layers,
        num_hidden_layers=1,
        rms_norm_eps=args.rms_norm_eps,
    )


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


def hugging_face_layout(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A Qwen3-Next checkpoint as published: one tensor per expert, convolutions (C, 1, K),
    the norms zero-centred (mlx-lm's sanitize undoes each)."""
    out = {}
    for name, w in weights.items():
        if ".switch_mlp." in name:
            prefix, _, proj = name.rpartition(".switch_mlp.")
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}"] = w[e]
            continue
        if "conv1d.weight" in name:
            w = w.moveaxis(2, 1)
        elif name.endswith(CENTRED):
            w = w - 1.0
        out[name] = w
    return out


def save_mtp_target(path, name: str, seed: int = 0):
    """A tiny random target of `MTP_FAMILIES[name]` with a tokenizer and `mtp.*` tensors,
    saved as a checkpoint mlx-lm loads (its own layout: mlx-lm's sanitize drops `mtp.*`)."""
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    module, fields = MTP_FAMILIES[name]
    model_type = name.removesuffix("_shared")
    model = build(model_type, seed=seed, fields=fields, families={model_type: (module, fields)})
    config = {"model_type": model_type, **json.loads(json.dumps(fields))}
    text = config.get("text_config") or config
    text["mtp_num_hidden_layers"] = 1
    weights = dict(tree_flatten(model.parameters()))
    weights.update(mtp_tensors(model_type, config, seed + 1))
    if model_type == "qwen3_next":  # mlx-lm loads it with mtp.* in the published layout only
        weights = hugging_face_layout(weights)
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


@pytest.mark.parametrize("block_size", [2, 3, 5])
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_greedy_equals_mlx_lm(checkpoints, name, block_size):
    _, model, tokenizer, draft, expected = checkpoints(name)
    tokens, responses = generated(
        model, draft, tokenizer, PROMPT, block_size=block_size, max_tokens=TOKENS
    )
    assert tokens == expected, f"first difference at token {first_difference(tokens, expected)}"
    assert sum(r.proposed for r in responses) >= (TOKENS - 1) // block_size
