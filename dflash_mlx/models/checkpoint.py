"""Reading and writing drafter checkpoints (published z-lab layout and ours).

Both layouts share one config schema (see `DFlashConfig`) and the same weight
names; ours adds an optional `quantization` entry and stores a single
`model.safetensors`. Hub ids are fetched with `huggingface_hub`.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..staging import remove_stale, staging_path
from .draft import DFlashConfig, DFlashDraft, default_target_layer_ids
from .dspark import DSparkConfig, DSparkDraft, dspark_config, is_dspark, own_weights
from .loading import (
    cast_model,
    default_dtype,
    load_checked,
    read_config,
    resolve_path,
    safetensors,
)
from .mtp import MTPDraft, load_mtp
from .target import TargetAdapter

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor of the *.safetensors files in `path`, named without "model.".

    A tensor in two files is an error: one of them is stale (an older conversion's
    file left beside a newer one), and which would win depends on file names alone.
    """
    weights: dict[str, mx.array] = {}
    origin: dict[str, Path] = {}
    for file, tensors in safetensors(path):
        for name, w in tensors.items():
            key = name.removeprefix("model.")
            if key.endswith(IGNORED_SUFFIXES):
                continue
            if key in origin:
                raise ValueError(
                    f"tensor {name} is in both {origin[key].name} and {file.name} in {path}: "
                    "remove the stale file"
                )
            weights[key], origin[key] = w, file
    return weights


MTP = "mtp"  # as a drafter's name: the target's own MTP layers

# Fields of which a DFlash drafter's config.json has at least one and a model's has none.
DRAFTER_FIELDS = ("dflash_config", "target_layer_ids", "num_target_layers", "mask_token_id")


def draft_config(raw: dict, where: str | Path = "it") -> DFlashConfig:
    """The config a drafter config.json (of `where`) describes: a `DSparkConfig` for DSpark's
    packagings. A model's config.json is refused as such: mlx-lm's `--draft-model` takes a
    small model, ours a drafter made for the target."""
    if is_dspark(raw):
        return dspark_config(raw)
    if not any(name in raw for name in DRAFTER_FIELDS):
        raise ValueError(
            f"{where} is a model, not a DFlash drafter: a drafter is made for one target "
            "model and reads its layers (its config.json has a dflash_config); mlx-lm's small "
            "draft models do not run here"
        )
    return DFlashConfig.from_dict(raw)


def new_draft(
    config: DFlashConfig, kernels: str = "auto", context_window: int | None = None
) -> DFlashDraft:
    """A freshly initialised drafter of `config`'s kind (DSpark or DFlash)."""
    kind = DSparkDraft if isinstance(config, DSparkConfig) else DFlashDraft
    return kind(config, kernels, context_window)


def load_draft(
    path_or_repo: str | Path,
    dtype: mx.Dtype | None = None,
    kernels: str = "auto",
    context_window: int | None = None,
    full_vocab: bool = False,
    target: str | Path | None = None,
    mtp_bits: int | None = None,
) -> DFlashDraft | MTPDraft:
    """Load a DFlash drafter from a local directory or a hub id, in either layout, or a
    DSpark drafter in any of its packagings (`dspark.py`); `"mtp"` loads the MTP layers of
    the checkpoint `target` (a directory or hub id) instead (`mtp.py`), quantized to
    `mtp_bits` if given.

    `dtype` defaults to float32 on the CPU and to the checkpoint's dtype on a GPU.
    `kernels` picks the block-attention backend ("auto", "metal" or "reference").
    `context_window` keeps the drafter's attention to the last W context positions; None
    takes the checkpoint's own (`dflash_config.context_window`: about the longest sequence
    it was trained on, past which its drafts get worse and dearer), 0 the whole context.
    `full_vocab` ignores the checkpoint's draft vocabulary and drafts over all tokens.
    """
    if str(path_or_repo) == MTP:
        if target is None:
            raise ValueError(
                "the 'mtp' drafter is the target's own MTP layers: load_draft('mtp', target=M); "
                "generate, chat and serve take --draft mtp"
            )
        return load_mtp(target, dtype, mtp_bits, full_vocab=full_vocab)
    if mtp_bits is not None:
        raise ValueError("mtp_bits (--mtp-bits) quantizes the 'mtp' drafter only")
    path = resolve_path(path_or_repo, "drafter", ["*.json", "*.safetensors", "*.md"])
    raw = read_config(path)
    config = draft_config(raw, path_or_repo)
    weights = read_weights(path)
    if isinstance(config, DSparkConfig):
        weights = own_weights(config, weights)
    if full_vocab:
        config.draft_vocab = None
    if context_window is None:
        context_window = (raw.get("dflash_config") or {}).get("context_window")
    model = new_draft(config, kernels, context_window or None)
    load_checked(model, weights, config.quantization, f"drafter weights in {path}")
    cast_model(model, dtype if dtype is not None else default_dtype())
    mx.eval(model.parameters())
    model.eval()
    return model


def describe_draft(path_or_repo: str | Path) -> list[tuple[str, str]]:
    """What `load_draft` reads from a drafter, as (field, value) rows for `dflash-mlx info`."""
    draft = load_draft(path_or_repo)
    cfg = draft.config
    vocab = "all" if cfg.draft_vocab is None else f"{len(cfg.draft_vocab)} of {cfg.vocab_size}"
    quant = cfg.quantization
    rows = [
        (
            "drafter",
            "DSpark"
            if isinstance(draft, DSparkDraft)
            else "DFlash 2"
            if cfg.is_dflash2
            else "DFlash 1",
        )
    ]
    if isinstance(draft, DSparkDraft):
        markov = f"rank {cfg.markov_rank}, {cfg.markov_head_type}" if cfg.markov_rank else "none"
        confidence = "none"
        if cfg.confidence_head:
            confidence = "on h and W1[prev]" if cfg.confidence_with_markov else "on h"
        rows += [
            ("layout", cfg.layout),
            ("slots (γ)", f"{cfg.slots}, {cfg.block_size} positions verified"),
            ("markov head", markov),
            ("confidence head", confidence),
            ("layers", f"{cfg.num_hidden_layers} ({cfg.layer_kind})"),
        ]
    else:
        rows += [("block size", str(cfg.block_size)), ("layers", str(cfg.num_hidden_layers))]
    return rows + [
        ("target layers", str(cfg.target_layer_ids)),
        ("mask token", str(cfg.mask_token_id)),
        ("draft vocabulary", vocab),
        ("quantization", f"{quant['bits']}-bit, group {quant['group_size']}" if quant else "none"),
    ]


def init_draft(
    model: nn.Module,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    seed: int = 0,
    kernels: str = "auto",
    context_window: int | None = None,
    lazy: bool = False,
) -> DFlashDraft:
    """A randomly initialised drafter shaped for `model` (for training or cost measurements).

    Attention and MLP shapes follow the target's own layers; the tapped target
    layers are spread as in the published drafters. `lazy` leaves the weights unevaluated,
    for measurements that only build graphs (nothing allocated).
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
    if not lazy:
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


def save_weights(path: Path, weights: dict[str, mx.array], metadata: dict | None = None) -> None:
    """`mx.save_safetensors`, a failed write (a full disk) raised as the OSError it is:
    MLX raises RuntimeError, which the command line would show as a traceback."""
    mx.eval(list(weights.values()))  # a failed computation is not a failed write
    try:
        mx.save_safetensors(str(path), weights, metadata=metadata)
    except RuntimeError as exc:
        raise OSError(f"{path.name}: {exc}") from exc


def save_draft(model: DFlashDraft, out_dir: str | Path, card: str) -> Path:
    """Write our converted layout: config.json, model.safetensors, README.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_config(out / "config.json", model.config.to_dict())
    save_weights(
        out / "model.safetensors", dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (out / "README.md").write_text(card)
    return out


def check_out_dir(out: Path, force: bool) -> None:
    """Refuse an output path under or at a file, or a directory that holds files unless
    `force`: a conversion written into it would leave the older files (a stale shard) beside
    the new ones, and `load_draft` reads every *.safetensors file there."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"cannot write {out}: {existing} is a file")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty: pass --force to replace it")


def replace_dir(target: Path, new: Path, old: Path) -> None:
    """Put the complete directory `new` at `target`; a previous `target` stays whole at `old`
    until then (a rename replaces only an empty directory) and is removed after."""
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)  # left by a replacement cut short
        target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(out: Path, force: bool) -> Iterator[Path]:
    """A new directory beside `out` (the same file system) that becomes `out` only once the
    block completes: a failed write (a full disk) leaves no partial output and a previous
    `out` as it was. `force` replaces a non-empty `out` (see `check_out_dir`); write errors
    name `out`."""
    check_out_dir(out, force)
    target = out.resolve()
    remove_stale(target)  # what a killed conversion left
    tmp = staging_path(target, f"-{uuid.uuid4().hex[:12]}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        yield tmp
        replace_dir(target, tmp, tmp.with_name(tmp.name + "-old"))
    except OSError as exc:
        raise type(exc)(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
