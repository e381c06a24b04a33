"""The training loop: AdamW with warm-up + cosine, clipping, checkpoints, eval by real decoding.

Step s draws its sequences and anchors from (seed, epoch, sequence) alone, so a
run resumed from a checkpoint (drafter, optimizer state, step) continues
exactly as if it had not stopped, and every epoch sees fresh anchors.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from ..generate import stream_generate
from ..models.checkpoint import draft_config, init_draft, new_draft, replace_dir, save_weights
from ..models.draft import DFlashConfig, DFlashDraft
from ..models.target import TargetAdapter
from .blocks import (
    block_hidden,
    block_labels,
    block_loss,
    block_predecessors,
    drafting_slots,
    position_weights,
    sample_anchors,
    selector_loss,
    soft_labels,
    target_path,
)


@dataclass
class TrainConfig:
    steps: int = 2000
    seqs_per_step: int = 4
    blocks_per_seq: int = 32
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float = 7.0
    soft_weight: float = 0.0
    selector_weight: float = 0.3
    ce_weight: float = 0.1  # DSpark's loss weights, as DeepSpec's published drafters
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    seed: int = 0
    save_every: int = 100
    eval_every: int = 0
    log_every: int = 10


@dataclass
class Sequence:
    """Prompt + reply token ids (reply from `start`), cached target features, soft labels and
    the target's final hidden states (`features.sequence_features`).

    `greedy`: the reply is the target's own greedy output. Otherwise (text it did not write,
    a sampled reply) blocks are anchored and labelled on the target's greedy path through it
    (`blocks.target_path`), which its soft labels give.
    """

    ids: np.ndarray
    start: int
    features: mx.array
    top_ids: mx.array | None = None
    top_logp: mx.array | None = None
    last_hidden: mx.array | None = None
    greedy: bool = True
    path: tuple[np.ndarray, np.ndarray] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.greedy:
            if self.top_ids is None:
                raise ValueError("a reply the target did not write greedily needs its soft labels")
            top_logp = np.array(self.top_logp.astype(mx.float32))
            self.path = target_path(self.ids, np.array(self.top_ids), top_logp)

    def anchors(self) -> np.ndarray:
        """The positions a block can be anchored at: in the reply, with a label after it, and
        (text the target did not write) on its greedy path."""
        positions = np.arange(self.start, len(self.ids) - 1)
        return positions if self.path is None else positions[self.path[1][positions]]


class DraftShape(Protocol):
    """What `--arch` makes of a DFlash 1 drafter's config (`DFlash2Shape`,
    `dspark.DSparkShape`), and how its added parts start."""

    def apply(self, cfg: DFlashConfig) -> DFlashConfig: ...

    def start(self, draft: DFlashDraft) -> None: ...


@dataclass
class DFlash2Shape:
    """What `--arch dflash2` adds to a drafter: the published drafters' convolution and
    selector sizes (z-lab's dflash2-config.json: kernel 2, group 16, top-16; its rank 256
    scaled down for small targets), optionally sliding-window layers as published."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_top_k: int = 16
    selector_rank: int = 64
    sliding_window: int | None = None

    def apply(self, cfg: DFlashConfig) -> DFlashConfig:
        """`cfg` with these fields (every layer sliding if a window is set), checked."""
        for flag, value in asdict(self).items():
            if value is not None and value < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
        if cfg.hidden_size % self.conv_group_size:
            raise ValueError(
                f"--conv-group-size {self.conv_group_size} must divide the target's hidden size "
                f"{cfg.hidden_size}"
            )
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return replace(
            cfg,
            **asdict(self),
            layer_types=[kind] * cfg.num_hidden_layers,
            is_causal=False,  # as published: sliding layers see the whole block too
        )

    def start(self, draft: DFlashDraft) -> None:
        start_dflash2_parts(draft)


def start_dflash2_parts(draft: DFlashDraft, layers: list | None = None) -> None:
    """Start `layers`' convolutions (default: all) and the selector so that `draft` computes
    what its DFlash 1 backbone would and walks the per-position argmax.

    A convolution starts as the identity (tap 0 weight 1, no dynamic correction; vLLM's
    speculators #1006 and NVIDIA Model-Optimizer #2216 start theirs so: a random
    correction perturbs every sublayer at step 0). The successor codebook starts at zero
    and the predecessor one random (LoRA-style): every edge score is 0 at first, yet the
    gradient of the successor codebook is not (both at zero would never move).
    """
    for layer in draft.layers if layers is None else layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    if "candidate_selector" in draft:
        selector = draft.candidate_selector
        selector.predecessor_codebook = mx.random.normal(selector.predecessor_codebook.shape)
        selector.successor_codebook = mx.zeros_like(selector.successor_codebook)


def make_draft(
    model: nn.Module,
    num_layers: int,
    target_layer_ids: list[int],
    block_size: int = 16,
    init_layers: list[int] | None = None,
    seed: int = 0,
    output_scale: float = 0.1,
    shape: DraftShape | None = None,
) -> DFlashDraft:
    """A float32 drafter for `model` (DFlash 1, or what `shape` makes of it: DFlash 2, DSpark);
    `init_layers` copies those target layers into it.

    The final norm starts as the target's (or ones) times `output_scale`: the
    frozen LM head turns a full-scale random hidden state into confidently
    wrong logits (SmolLM2: loss ~20 at step 1, above uniform's ~10), and the
    first hundred steps would go into unlearning that; scaled down, training
    starts near uniform (measured: loss 4.9 instead of 11.8 after 5 steps).
    """
    base = init_draft(model, num_layers=num_layers, block_size=block_size, seed=seed)
    draft = shaped_draft(replace(base.config, target_layer_ids=list(target_layer_ids)), shape)
    if init_layers:
        if len(init_layers) != num_layers:
            raise ValueError(f"--init-layers needs {num_layers} target layer ids")
        layers = TargetAdapter(model).layers
        for layer, i in zip(draft.layers, init_layers):
            own = dict(tree_flatten(layer.parameters()))
            theirs = tree_flatten(layers[i].parameters())
            layer.load_weights([(k, v) for k, v in theirs if k in own], strict=False)
        for _, module in model.named_modules():
            if getattr(module, "layers", None) is layers and "norm" in module:
                draft.norm.load_weights(list(module.norm.parameters().items()))
    draft.norm.weight = draft.norm.weight * output_scale
    mx.eval(draft.parameters())
    return draft


def shaped_draft(config: DFlashConfig, shape: DraftShape | None) -> DFlashDraft:
    """A float32 drafter of `config` as `shape` makes it, its new parts started."""
    draft = new_draft(shape.apply(config) if shape else config)
    draft.set_dtype(mx.float32)
    if shape:
        shape.start(draft)
    return draft


def grow_draft(
    source: DFlashDraft, num_layers: int, shape: DraftShape | None = None
) -> DFlashDraft:
    """`source` (float32) with layers appended that start as the identity; with `shape`, a
    DFlash 1 `source` becomes a DFlash 2 or DSpark drafter whose new parts start as the
    identity (DFlash 2's convolutions; DSpark's Markov bias at zero).

    The new layers' output projections are zero, so the grown drafter computes
    exactly what `source` does and training continues from there instead of
    from scratch (a trained drafter gains depth without losing what it learned).
    """
    cfg = source.config
    added = num_layers - cfg.num_hidden_layers
    if added < 0:
        raise ValueError(
            f"cannot shrink a {cfg.num_hidden_layers}-layer drafter to {num_layers} layers"
        )
    layer_types = cfg.layer_types + cfg.layer_types[-1:] * added
    grown = replace(cfg, num_hidden_layers=num_layers, layer_types=layer_types)
    draft = shaped_draft(grown, shape)
    if not shape and cfg.conv_kernel_size:
        start_dflash2_parts(draft, draft.layers[cfg.num_hidden_layers :])
    draft.load_weights(tree_flatten(source.parameters()), strict=False)
    for layer in draft.layers[cfg.num_hidden_layers :]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(draft.parameters())
    return draft


def scale_fc_to_features(draft: DFlashDraft, features: list[mx.array]) -> None:
    """Divide each fc input column by that feature's typical magnitude.

    Target hidden states carry "massive activations": a few dimensions are
    hundreds to thousands of times larger than the rest (SmolLM2 layers 14-27:
    |x| up to ~25,000 against a median scale of ~10). Through a random fc they
    dominate the fused context, every position looks alike after hidden_norm,
    and the drafter's attention has nothing to tell positions apart by. Scaled,
    every feature dimension starts with an equal say. Rows of outlier norm
    (attention-sink positions) are left out of the statistics.
    """
    x = np.concatenate([np.asarray(f, dtype=np.float32) for f in features])
    norms = np.linalg.norm(x, axis=1)
    x = x[norms < 4 * np.median(norms)]
    scale = np.sqrt((x**2).mean(0)) + 1e-3
    draft.fc.weight = draft.fc.weight / mx.array(scale[None].astype(np.float32))
    mx.eval(draft.fc.weight)


def label_vocab(data: list[Sequence]) -> np.ndarray:
    """The tokens a label can be: every token of the data, and the target's greedy choices
    through what it did not write."""
    tokens = [s.ids for s in data] + [s.path[0] for s in data if s.path is not None]
    return np.unique(np.concatenate(tokens))


def lr_schedule(cfg: TrainConfig) -> optim.schedulers.Callable:
    warm = optim.linear_schedule(cfg.lr / cfg.warmup, cfg.lr, cfg.warmup)
    cosine = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), cfg.lr * cfg.min_lr_ratio)
    return optim.join_schedules([warm, cosine], [cfg.warmup])


def step_batch(
    data: list[Sequence], step: int, cfg: TrainConfig, block_size: int
) -> list[tuple[Sequence, np.ndarray]]:
    """The (sequence, anchors) pairs of `step`: a fresh permutation and fresh anchors per epoch."""
    out = []
    for j in range(cfg.seqs_per_step):
        g = step * cfg.seqs_per_step + j
        epoch, pos = divmod(g, len(data))
        index = int(np.random.default_rng([cfg.seed, epoch]).permutation(len(data))[pos])
        seq = data[index]
        rng = np.random.default_rng([cfg.seed, epoch, index])
        out.append((seq, sample_anchors(seq.anchors(), cfg.blocks_per_seq, rng)))
    return out


def head_weight(target: TargetAdapter) -> mx.array:
    """The frozen LM head's (vocab, hidden) matrix (the embedding when tied)."""
    head = target.lm_head
    owner = head if isinstance(head, nn.Module) else getattr(head, "__self__", None)
    if type(owner) not in (nn.Linear, nn.Embedding):
        raise ValueError("training needs an unquantized LM head (load the target in float32)")
    return owner.weight


class Trainer:
    """Owns the drafter, optimizer and step counter; `save`/`load` make runs resumable.

    With `vocab` (sorted token ids, e.g. every token of the training data) the
    loss is a softmax over those rows of the frozen LM head only: the head is
    most of a step's cost, and a label can only be a token of the data.
    Decoding still uses the full head.

    A DFlash 2 drafter's loss is the token loss plus `selector_weight` times the
    selector loss (`blocks.selector_loss`), as in the published trainers
    (NeMo Automodel's DFlash2TrainerModule, SpecForge #772); both gradients
    reach the backbone. Weight 0.3: on a tiny target, weight 1.0 held the token
    loss back against training without the selector loss, while 0.3 kept it
    there and still lowered the selector loss. Its hits are the
    selector's, which is what decoding accepts. With a `vocab`, the selector's
    top-K are taken among those tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        draft: DFlashDraft,
        cfg: TrainConfig,
        vocab: np.ndarray | None = None,
    ):
        self.target = TargetAdapter(model)
        self.model, self.draft, self.cfg = model, draft, cfg
        weight = head_weight(self.target)
        if vocab is None:
            vocab = np.arange(weight.shape[0])
        self.to_vocab = np.full(weight.shape[0], -1, dtype=np.int32)
        self.to_vocab[vocab] = np.arange(len(vocab))
        self.vocab = mx.array(vocab.astype(np.int32))
        rows = weight[self.vocab]
        mx.eval(rows)
        self.head = self.loss_head(rows)
        self.optimizer = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=cfg.weight_decay)
        self.optimizer.init(draft.trainable_parameters())
        self.step = 0
        self.weights = position_weights(self.label_block, cfg.gamma)
        self._grad = nn.value_and_grad(draft, self._loss)

    @property
    def label_block(self) -> int:
        """The positions a training block covers: the anchor and its labels."""
        return self.draft.config.block_size

    def loss_head(self, rows: mx.array) -> Callable[[mx.array], mx.array]:
        """The drafter's logits over the loss vocabulary (`rows` of the LM head)."""
        return partial(self.draft.head_logits, lm_head=lambda h: h @ rows.T)

    def draft_state(self) -> dict:
        """What a checkpoint's state.json says of the drafter (`checkpoint_draft` reads it)."""
        return {"draft": self.draft.config.to_dict()}

    def _loss(self, batch: list[tuple]) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
        """(loss, hits, its parts): a DFlash 2 drafter's token and selector losses, none for
        DFlash 1."""
        selector = self.draft.get("candidate_selector")
        token, choice, hits = mx.array(0.0), mx.array(0.0), []
        for features, ids, anchors, labels, weights, soft, predecessors in batch:
            hidden = block_hidden(self.draft, self.target.embed_tokens, features, ids, anchors)
            hidden = drafting_slots(hidden, self.draft.config.block_size)
            logits = self.head(hidden)
            loss, h = block_loss(logits, labels, weights, soft, self.cfg.soft_weight)
            token = token + loss
            if selector is not None:
                loss, h = selector_loss(
                    selector, hidden, logits, predecessors, labels, weights, self.vocab
                )
                choice = choice + loss
            hits.append(h)
        total = token + self.cfg.selector_weight * choice
        parts = {"token_loss": token, "selector_loss": choice} if selector is not None else {}
        return total, mx.concatenate(hits), parts

    def _soft(self, seq: Sequence, anchors: np.ndarray) -> tuple[mx.array, mx.array] | None:
        """Soft targets mapped into the loss vocabulary (tokens outside it get probability 0)."""
        if not self.cfg.soft_weight or seq.top_ids is None:
            return None
        top_ids, top_logp = soft_labels(
            np.array(seq.top_ids),
            np.array(seq.top_logp, dtype=np.float32),
            anchors,
            self.label_block,
        )
        index = self.to_vocab[top_ids]
        probs = np.exp(top_logp) * (index >= 0)
        probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-9)
        return mx.array(np.maximum(index, 0)), mx.array(probs)

    def _batch(self, pairs: list[tuple[Sequence, np.ndarray]]) -> tuple[list, list]:
        """The loss inputs of all blocks of `pairs`, and each block's label-validity mask."""
        labelled = [
            (seq, anchors, *block_labels(seq.ids, anchors, self.label_block, seq.path))
            for seq, anchors in pairs
        ]
        norm = sum((self.weights * ok).sum() for *_, ok in labelled)
        batch = [
            (
                seq.features,
                seq.ids,
                anchors,
                mx.array(self.to_vocab[labels]),
                mx.array(self.weights * ok / norm),
                self._soft(seq, anchors),
                mx.array(block_predecessors(seq.ids, anchors, self.label_block)),
            )
            for seq, anchors, labels, ok in labelled
        ]
        return batch, [ok for *_, ok in labelled]

    def train_step(self, pairs: list[tuple[Sequence, np.ndarray]]) -> dict:
        """One AdamW step on the weighted mean cross-entropy of all blocks of `pairs`."""
        batch, valid = self._batch(pairs)
        (loss, hits, parts), grads = self._grad(batch)
        grads, grad_norm = optim.clip_grad_norm(grads, self.cfg.clip)
        self.optimizer.update(self.draft, grads)
        mx.eval(self.draft.parameters(), self.optimizer.state, loss, hits, parts)
        self.step += 1
        losses = {"loss": loss.item(), **{k: v.item() for k, v in parts.items()}}
        return {**losses, "grad_norm": grad_norm.item(), **hit_stats(hits, valid)}

    def validate(self, data: list[Sequence]) -> dict:
        """Loss, accuracy and tau on held-out sequences from an anchor at every reply position.

        The replies are the target's own greedy output, so the accepted prefix
        of a block here is exactly what decoding would accept from that anchor;
        "tau_decode" follows the path decoding takes through them (tokens per
        cycle, as the bench counts), "tau_est" is the mean over all anchors,
        which is higher: a long easy run is one cycle but many anchors.
        """
        losses, hits, valid, walks = [], [], [], []
        for seq in data:
            if len(seq.ids) - seq.start < 2:  # a one-token reply: nothing to draft
                continue
            loss, h, ok, accepted = self.every_anchor(seq)
            losses.append(loss)
            hits.append(h)
            valid.append(ok)
            walks.append(decode_walk(accepted))
        tokens, cycles = np.sum(walks, axis=0)
        stats = hit_stats(np.concatenate(hits), valid)
        means = {k: float(np.mean([loss[k] for loss in losses])) for k in losses[0]}
        return {**means, **stats, "tau_decode": float(tokens / cycles)}

    def every_anchor(self, seq: Sequence) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
        """Losses, hits and label-validity (N, B-1), and drafts accepted, from every reply
        anchor.

        On a greedy reply the accepted counts are what decoding would accept at
        each anchor (`decode_walk` turns them into decoding's tau).
        """
        loss, hits, (valid,) = self.block_hits([(seq, np.arange(seq.start, len(seq.ids) - 1))])
        return loss, hits, valid, np.cumprod(hits & valid, axis=1).sum(1)

    def block_hits(
        self, pairs: list[tuple[Sequence, np.ndarray]]
    ) -> tuple[dict[str, float], np.ndarray, list]:
        """The loss and its parts (`_loss`), per-block hits (N, B-1) of the drafter's greedy
        choice (the argmax; DFlash 2: the selector's, DSpark: the Markov walk's, given the
        true prefix), label-validity masks."""
        batch, valid = self._batch(pairs)
        loss, hits, parts = self._loss(batch)
        losses = {"loss": loss.item(), **{k: v.item() for k, v in parts.items()}}
        return losses, np.array(hits), valid

    def save(self, path: Path) -> None:
        """Drafter weights, optimizer state and step, written to a temp dir then swapped in
        (`finish_save` completes a swap cut short)."""
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_weights(tmp / "draft.safetensors", dict(tree_flatten(self.draft.parameters())))
        save_weights(tmp / "optimizer.safetensors", dict(tree_flatten(self.optimizer.state)))
        state = {"step": self.step, "train": asdict(self.cfg), **self.draft_state()}
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
        replace_dir(path, tmp, previous_checkpoint(path))

    def load(self, path: Path) -> None:
        self.draft.load_weights(str(path / "draft.safetensors"))
        self.optimizer.state = tree_unflatten(
            list(mx.load(str(path / "optimizer.safetensors")).items())
        )
        self.step = json.loads((path / "state.json").read_text())["step"]
        mx.eval(self.draft.parameters(), self.optimizer.state)


def previous_checkpoint(path: Path) -> Path:
    """Where `Trainer.save` keeps the checkpoint it replaces until the new one is in place."""
    return path.with_name(path.name + ".old")


def finish_save(path: Path) -> None:
    """Complete a `Trainer.save` cut short between its two renames: the last whole checkpoint
    is then `previous_checkpoint(path)` and `path` is missing, and a run that did not look
    there would restart at step 0."""
    old = previous_checkpoint(path)
    if old.exists() and not path.exists():
        old.rename(path)


def checkpoint_draft(ckpt: Path) -> tuple[DFlashDraft, int]:
    """The float32 drafter a `Trainer.save` checkpoint holds, built from its own config, and
    its step."""
    finish_save(ckpt)
    if not (ckpt / "state.json").exists():
        raise FileNotFoundError(f"no training checkpoint in {ckpt} (run `train fit` first)")
    state = json.loads((ckpt / "state.json").read_text())
    draft = new_draft(draft_config(state["draft"]))
    draft.set_dtype(mx.float32)
    draft.load_weights(str(ckpt / "draft.safetensors"))
    mx.eval(draft.parameters())
    return draft, state["step"]


def hit_stats(hits: mx.array | np.ndarray, valid: list[np.ndarray]) -> dict:
    """Per-position accuracy and the acceptance length the hits imply (1 + accepted prefix)."""
    hits = np.array(hits) & np.concatenate(valid)
    ok = np.concatenate(valid)
    acc = hits.sum(0) / np.maximum(ok.sum(0), 1)
    tau = 1.0 + np.cumprod(hits, axis=1).sum(1).mean()
    return {"acc": acc.round(3).tolist(), "tau_est": float(tau)}


def decode_walk(accepted: np.ndarray) -> tuple[int, int]:
    """(tokens, cycles) of decoding a greedy reply whose anchor i would get `accepted[i]` drafts.

    Decoding starts at reply token 0 and each cycle commits accepted + 1 tokens.
    """
    pos, tokens, cycles = 0, 0, 0
    while pos < len(accepted):
        step = min(int(accepted[pos]) + 1, len(accepted) - pos)
        pos, tokens, cycles = pos + step, tokens + step, cycles + 1
    return tokens, cycles


def decode_tau(
    model: nn.Module, draft: DFlashDraft, tokenizer, prompts: list[list[int]], max_tokens: int
) -> float:
    """Mean acceptance length of real greedy speculative decoding over `prompts`, at the
    drafter's block size: a block chosen by measured cost would make it follow the clock."""
    taus, block = [], draft.config.block_size
    for ids in prompts:
        tokens, cycles = 0, 0
        for r in stream_generate(
            model, draft, tokenizer, ids, block_size=block, max_tokens=max_tokens
        ):
            tokens, cycles = r.generation_tokens, cycles + 1
        taus.append((tokens - 1) / max(cycles - 1, 1))
    return float(np.mean(taus))


PARTS = ("token_loss", "selector_loss", "ce_loss", "l1_loss", "confidence_loss")
LOGGED = ("loss", *PARTS, "tau_est")


def trim_log(log: Path, step: int) -> bool:
    """Where a run resumes at `step`, drop the log lines of later steps (it redoes them: they
    would be logged twice) and a torn last line; whether `step` itself is logged."""
    if not step or not log.exists():
        return False
    lines = log.read_text().splitlines(keepends=True)
    entries = [(json.loads(line)["step"], line) for line in lines if line.endswith("\n")]
    tmp = log.with_name(log.name + ".tmp")
    tmp.write_text("".join(line for s, line in entries if s <= step))
    tmp.replace(log)
    return any(s == step for s, _ in entries)


def fit(
    trainer: Trainer,
    data: list[Sequence],
    ckpt: Path,
    log: Path,
    eval_fn=None,
    val: list[Sequence] | None = None,
) -> None:
    """Train to `cfg.steps`, checkpointing every `save_every` steps and at the end.

    The bar and the JSONL log show means over the last `log_every` steps (one
    step's 64 blocks are too few to read a trend from).
    """
    cfg = trainer.cfg
    bar = tqdm(total=cfg.steps, initial=trainer.step, dynamic_ncols=True)
    window: list[dict] = []

    def validate(step: int) -> dict:
        scores = trainer.validate(val)
        bar.write(
            f"step {step}: validation loss {scores['loss']:.3f} "
            f"acc@1 {scores['acc'][0]:.2f} tau {scores['tau_decode']:.2f} "
            f"(mean over anchors {scores['tau_est']:.2f})"
        )
        return scores

    logged = trim_log(log, trainer.step)
    with log.open("a") as f:
        # where this run starts from, unless a resumed run's log has that step already
        if val and cfg.eval_every and trainer.step < cfg.steps and not logged:
            f.write(json.dumps({"step": trainer.step, "val": validate(trainer.step)}) + "\n")
        while trainer.step < cfg.steps:
            tic = time.perf_counter()
            pairs = step_batch(data, trainer.step, cfg, trainer.draft.config.block_size)
            window = [*window[-cfg.log_every + 1 :], trainer.train_step(pairs)]
            window[-1]["seconds"] = time.perf_counter() - tic
            step = trainer.step
            stats = {
                "step": step,
                "lr": float(trainer.optimizer.learning_rate),
                **{k: float(np.mean([w[k] for w in window])) for k in LOGGED if k in window[-1]},
                "acc": np.mean([w["acc"] for w in window], axis=0).round(3).tolist(),
                "seconds": round(float(np.mean([w["seconds"] for w in window])), 3),
            }
            bar.update(1)
            parts = "".join(
                f"{k.removesuffix('_loss')} {stats[k]:.3f} "
                for k in PARTS
                if k in stats and k != "token_loss"
            )
            bar.set_postfix_str(
                f"loss {stats['loss']:.3f} {parts}"
                f"acc@1-4 {' '.join(f'{a:.2f}' for a in stats['acc'][:4])} "
                f"tau~{stats['tau_est']:.2f}"
            )
            evaluate = cfg.eval_every and step % cfg.eval_every == 0
            if evaluate and eval_fn:
                stats["eval_tau"] = eval_fn(trainer.draft)
                bar.write(f"step {step}: eval tau {stats['eval_tau']:.2f}")
            if evaluate and val:
                stats["val"] = validate(step)
            if step % cfg.log_every == 0 or "eval_tau" in stats or "val" in stats:
                f.write(json.dumps(stats) + "\n")
                f.flush()
            if step % cfg.save_every == 0 or step == cfg.steps:
                trainer.save(ckpt)
    bar.close()
