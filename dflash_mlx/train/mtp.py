"""`train fit --arch mtp`: a multi-token-prediction layer for the target, by DeepSeek-V3's recipe.

At position p the layer reads the target's final hidden state h_p (the features' `last_hidden`)
and the embedding of the token after it, x_{p+1}, each RMS-normed, concatenated and projected,
through one decoder layer of the target's own family (causal over the sequence) and a norm;
the target's frozen LM head on the result predicts x_{p+2}. That is `MTPDraft.step` run without
caches, so what is trained is what `--draft mtp` runs; decoding runs it k times, each step on
the last one's output (`models/mtp.py`), which training does not see.

Every reply position is a label: one forward over the sequence computes them all (DFlash's
random blocks each need a forward of their own). The loss is `Trainer`'s cross-entropy, mixed
with the target's top-K (`--soft-weight`), over the loss vocabulary. Validation walks each
held-out reply as greedy decoding would, with the layer's own chains (`MTPDraft.chain`) of
block size - 1 drafts from every position. `export_mtp` writes the target's checkpoint with
the layer beside its weights, as DeepSeek-V3 carries its nextn layer.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from ..models.checkpoint import save_weights, write_config
from ..models.loading import read_config
from ..models.mtp import (
    LAYOUTS,
    NEXTN_NAMES,
    VOCAB_KEY,
    MTPConfig,
    MTPDraft,
    MTPRow,
    mtp_args,
    mtp_layout,
)
from ..models.target import TargetAdapter
from .blocks import block_labels, block_loss
from .trainer import Sequence, Trainer

MTP_FILE = "mtp.safetensors"  # beside the target's model*.safetensors, which mlx-lm reads alone
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def make_mtp(
    target_path: Path,
    model: nn.Module,
    seed: int = 0,
    init_layer: int | None = None,
    block_size: int = 4,
    output_scale: float = 0.1,
) -> MTPDraft:
    """A float32 MTP layer for the target at `target_path` (`model`, loaded): random, or its
    decoder layer a copy of the target's layer `init_layer`; its copy of the target's final
    norm, its own final norm the target's times `output_scale` (`make_draft`'s reason:
    a random hidden state through the frozen head gives confidently wrong logits)."""
    config = read_config(target_path)
    model_type, text = mtp_layout(config)
    if not LAYOUTS[model_type].nextn:
        raise ValueError(
            f"{model_type} checkpoints name their MTP layers mtp.*: train one for a family "
            "whose layers follow DeepSeek-V3's nextn names"
        )
    args = mtp_args(model_type, text)
    mtp = MTPConfig.for_target(model_type, args, block_size=block_size)
    mx.random.seed(seed)
    draft = MTPDraft(mtp, args)
    target = TargetAdapter(model)
    norm = target.backbone.norm.weight
    if init_layer is not None:
        own = dict(tree_flatten(draft.layers[0].parameters()))
        theirs = tree_flatten(target.layers[init_layer].parameters())
        draft.layers[0].load_weights([(k, v) for k, v in theirs if k in own], strict=False)
    draft.target_norm.weight = norm
    draft.norm.weight = norm * output_scale
    draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return draft


def last_hidden(seq: Sequence) -> mx.array:
    if seq.last_hidden is None:
        raise ValueError(
            "the cached features lack the target's final hidden states, which an MTP layer "
            "reads: run `train features` into a new work dir"
        )
    return seq.last_hidden.astype(mx.float32)


def layer_outputs(
    draft: MTPDraft,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    ids: np.ndarray,
    anchors: np.ndarray,
) -> mx.array:
    """The MTP layer's outputs (N, 1, hidden; before its norm) that predict the token after
    each anchor: at position anchor - 1, from its final hidden state and the anchor's token,
    in one causal forward over the sequence."""
    end = int(anchors.max())
    tokens = mx.array(ids[1 : end + 1])[None]
    out = draft.step(tokens, hidden[None, :end], embed, [[None] * len(draft.layers)])
    return out[0, mx.array(anchors - 1)][:, None]


def chain_accepted(
    draft: MTPDraft,
    embed: Callable[[mx.array], mx.array],
    lm_head: Callable[[mx.array], mx.array],
    seq: Sequence,
    anchors: np.ndarray,
) -> np.ndarray:
    """The drafts greedy decoding accepts (N,) from each anchor of a greedy reply: the layer's
    chain of block size - 1 drafts after the anchor's token, every anchor a row of one
    `MTPDraft.chain` whose cache holds the layer's entries of the positions before."""
    hidden, ids = last_hidden(seq), seq.ids
    shared = [KVCache() for _ in draft.layers]
    end = int(anchors.max()) - 1
    if end > 0:  # the layer's entries of positions 0 .. end - 1, which rows share a prefix of
        draft.step(mx.array(ids[1 : end + 1])[None], hidden[None, :end], embed, [shared])
    rows = []
    for a in anchors:
        cache = draft.make_cache()[0]
        for own, whole in zip(cache.layers, shared):
            if a > 1:
                own.keys, own.values = whole.keys[..., : a - 1, :], whole.values[..., : a - 1, :]
                own.offset = int(a) - 1
        cache.append(hidden[None, a - 1 : a])  # the last position before the root waits
        rows.append(MTPRow(SimpleNamespace(draft=[cache], tokens=ids.tolist())))
    steps = draft.config.block_size - 1
    drafted = []

    def pick(step: int, logits: mx.array) -> mx.array:
        drafted.append(mx.argmax(logits, axis=-1))
        return drafted[-1]

    draft.chain(mx.array(ids[anchors])[:, None], embed, lm_head, rows, steps, pick)
    labels, valid = block_labels(ids, anchors, steps + 1)
    hits = (np.array(mx.concatenate(drafted, axis=1)) == labels) & valid
    return np.cumprod(hits, axis=1).sum(1)


class MTPTrainer(Trainer):
    """`Trainer` for an `MTPDraft` (module docstring): one label per position (the token two
    ahead), read from the target's final hidden states; its checkpoint's state names the MTP
    layer's config."""

    label_block = 2  # a label is the token after the root, as a DFlash block of 2 has

    def __init__(self, model: nn.Module, draft: MTPDraft, cfg, vocab: np.ndarray | None = None):
        draft.target_norm.freeze()  # the target's: no gradient reaches it, weight decay would
        super().__init__(model, draft, cfg, vocab)

    def loss_head(self, rows: mx.array) -> Callable[[mx.array], mx.array]:
        return lambda hidden: self.draft.norm(hidden) @ rows.T

    def draft_state(self) -> dict:
        return {"mtp": asdict(self.draft.config)}

    def _batch(self, pairs: list[tuple[Sequence, np.ndarray]]) -> tuple[list, list]:
        """Every reply position of each sequence (one forward computes them all), with the
        target's final hidden states in place of the tapped layers' features."""
        pairs = [(seq, seq.anchors()) for seq, _ in pairs]
        batch, valid = super()._batch(pairs)
        return [(last_hidden(seq), *inputs[1:]) for (seq, _), inputs in zip(pairs, batch)], valid

    def _loss(self, batch: list[tuple]) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
        total, hits = mx.array(0.0), []
        for hidden, ids, anchors, labels, weights, soft, _ in batch:
            out = layer_outputs(self.draft, self.target.embed_tokens, hidden, ids, anchors)
            loss, h = block_loss(self.head(out), labels, weights, soft, self.cfg.soft_weight)
            total = total + loss
            hits.append(h)
        return total, mx.concatenate(hits), {}

    def every_anchor(self, seq: Sequence) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
        """The loss and the first draft's hits from every reply anchor, and the drafts the
        layer's chains would get accepted there (`chain_accepted`)."""
        anchors = np.arange(seq.start, len(seq.ids) - 1)
        loss, hits, (valid,) = self.block_hits([(seq, anchors)])
        embed, head = self.target.embed_tokens, self.target.lm_head
        return loss, hits, valid, chain_accepted(self.draft, embed, head, seq, anchors)


def is_mtp_checkpoint(ckpt: Path) -> bool:
    state = ckpt / "state.json"
    return state.exists() and "mtp" in json.loads(state.read_text())


def checkpoint_mtp(ckpt: Path, target_path: Path) -> tuple[MTPDraft, int]:
    """The float32 MTP layer a `MTPTrainer.save` checkpoint holds, and its step."""
    state = json.loads((ckpt / "state.json").read_text())
    config = MTPConfig(**state["mtp"])
    _, text = mtp_layout(read_config(target_path))
    draft = MTPDraft(config, mtp_args(config.model_type, text))
    draft.set_dtype(mx.float32)
    draft.load_weights(str(ckpt / "draft.safetensors"))
    mx.eval(draft.parameters())
    return draft, state["step"]


def nextn_name(name: str, num_layers: int) -> str:
    """An `MTPDraft` tensor's name as DeepSeek-V3 checkpoints carry their nextn layer: layer
    index `num_layers`, with `eh_proj`, `enorm`, `hnorm` and `shared_head.norm`."""
    head, _, rest = name.partition(".")
    if head == "layers":
        index, _, rest = rest.partition(".")
        return f"model.layers.{num_layers + int(index)}.{rest}"
    published = {ours: theirs for theirs, ours in NEXTN_NAMES.items()}[head]
    return f"model.layers.{num_layers}.{published}.{rest}"


def export_mtp(draft: MTPDraft, target_path: Path, out: Path, card: str, dtype: str) -> Path:
    """The target's checkpoint carrying the MTP layer: its files as they are (weights hard-linked
    where the file system allows), `num_nextn_predict_layers` in its config (and the layer's
    draft vocabulary as `VOCAB_KEY`, if it has one), the layer in `MTP_FILE` under DeepSeek-V3's
    nextn names, and a model card."""
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in target_path.iterdir() if p.is_file()):
        dest = out / file.name
        if file.name in ("config.json", "README.md", MTP_FILE) or dest.exists():
            continue
        try:
            os.link(file, dest)
        except OSError:
            shutil.copy2(file, dest)
    config = read_config(target_path)
    _, text = mtp_layout(config)
    text[LAYOUTS[draft.config.model_type].count] = draft.config.num_hidden_layers
    config.pop(VOCAB_KEY, None)
    if draft.config.draft_vocab is not None:
        config[VOCAB_KEY] = list(draft.config.draft_vocab)
    write_config(out / "config.json", config)
    layers = draft.config.num_target_layers
    weights = {
        nextn_name(name, layers): w.astype(DTYPES[dtype])
        for name, w in tree_flatten(draft.parameters())
        if not name.startswith("target_norm.")  # the target's own final norm
    }
    save_weights(out / MTP_FILE, weights, {"format": "mlx"})
    (out / "README.md").write_text(card)
    return out
