"""Reading and writing drafter checkpoints (published z-lab layout and ours).

Both layouts share one config schema (see `DFlashConfig`) and the same weight
names; ours adds an optional `quantization` entry and stores a single
`model.safetensors`. Hub ids are fetched with `huggingface_hub`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .draft import DFlashConfig, DFlashDraft, default_target_layer_ids
from .loading import cast_model, default_dtype, read_config, resolve_path
from .target import TargetAdapter

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {path}")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from None
    return {
        name.removeprefix("model."): w
        for name, w in weights.items()
        if not name.endswith(IGNORED_SUFFIXES)
    }


def load_draft(
    path_or_repo: str | Path,
    dtype: mx.Dtype | None = None,
    kernels: str = "auto",
    context_window: int | None = None,
    full_vocab: bool = False,
) -> DFlashDraft:
    """Load a DFlash drafter from a local directory or a hub id, in either layout.

    `dtype` defaults to float32 on the CPU and to the checkpoint's dtype on a GPU.
    `kernels` picks the block-attention backend ("auto", "metal" or "reference").
    `context_window` keeps the drafter's attention to the last W context positions.
    `full_vocab` ignores the checkpoint's draft vocabulary and drafts over all tokens.
    """
    path = resolve_path(path_or_repo, "drafter", ["*.json", "*.safetensors", "*.md"])
    config = DFlashConfig.from_dict(read_config(path))
    if full_vocab:
        config.draft_vocab = None
    weights = read_weights(path)
    model = DFlashDraft(config, kernels, context_window)
    if config.quantization:
        q = config.quantization
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda name, m: f"{name}.scales" in weights,
        )
    expected = {name for name, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"drafter weights in {path} do not match its config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, param in tree_flatten(model.parameters()):
        if param.shape != weights[name].shape:
            raise ValueError(
                f"drafter weight {name} has shape {weights[name].shape}, "
                f"config implies {param.shape}"
            )
    model.load_weights(list(weights.items()))
    cast_model(model, dtype if dtype is not None else default_dtype())
    mx.eval(model.parameters())
    model.eval()
    return model


def init_draft(
    model: nn.Module,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    seed: int = 0,
    kernels: str = "auto",
    context_window: int | None = None,
) -> DFlashDraft:
    """A randomly initialised drafter shaped for `model` (for training or cost measurements).

    Attention and MLP shapes follow the target's own layers; the tapped target
    layers are spread as in the published drafters.
    """
    target = TargetAdapter(model)
    args = getattr(model, "args", None)
    hidden = target.hidden_size
    heads = getattr(args, "num_attention_heads", max(1, hidden // 64))
    n_target = len(target.layers)
    config = DFlashConfig.from_dict(
        {
            "hidden_size": hidden,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(args, "num_key_value_heads", None) or heads,
            "head_dim": getattr(args, "head_dim", None) or hidden // heads,
            "intermediate_size": getattr(args, "intermediate_size", 4 * hidden),
            "vocab_size": target.vocab_size,
            "rms_norm_eps": getattr(args, "rms_norm_eps", 1e-6),
            "rope_theta": getattr(args, "rope_theta", 10000.0),
            "block_size": block_size,
            "num_target_layers": n_target,
            "dflash_config": {
                "target_layer_ids": default_target_layer_ids(n_target, num_layers),
                "mask_token_id": target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            },
        }
    )
    mx.random.seed(seed)
    draft = DFlashDraft(config, kernels, context_window)
    draft.set_dtype(default_dtype() or mx.bfloat16)
    mx.eval(draft.parameters())
    return draft


def write_config(path: Path, config: dict) -> None:
    """Indented JSON with lists of numbers on one line each: a draft vocabulary is
    thousands of ids, one per line would make config.json unreadable."""
    text = json.dumps(config, indent=2)
    text = re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda m: f"[{' '.join(m.group(1).split())}]", text)
    path.write_text(text + "\n")


def set_draft_vocab(path: str | Path, token_ids: list[int] | None) -> None:
    """Let the drafter saved at `path` propose only `token_ids` (None: every token again).

    Only config.json changes: the weights do not depend on the draft vocabulary.
    """
    config_file = Path(path) / "config.json"
    config = read_config(Path(path))
    config.pop("draft_vocab", None)
    dflash = config.setdefault("dflash_config", {})
    dflash.pop("draft_vocab", None)
    if token_ids is not None:
        dflash["draft_vocab"] = list(token_ids)
        dflash["draft_vocab"] = DFlashConfig.from_dict(config).draft_vocab  # checked, sorted
    write_config(config_file, config)


def save_draft(model: DFlashDraft, out_dir: str | Path, card: str) -> Path:
    """Write our converted layout: config.json, model.safetensors, README.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_config(out / "config.json", model.config.to_dict())
    mx.save_safetensors(
        str(out / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (out / "README.md").write_text(card)
    return out
