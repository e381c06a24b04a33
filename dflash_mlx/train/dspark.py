"""`train fit --arch dspark`: DSpark's Markov and confidence heads on the DFlash backbone,
trained with DeepSpec's loss.

As the public reference `deepseek-ai/DeepSpec` trains them (`deepspec/modeling/dspark/loss.py`,
`qwen3/modeling.py`, `markov_head.py`, the published `config/dspark/*.py`):

- Slot k of a block [anchor, mask × (γ - 1)] predicts the token after it (label k = token
  anchor + k + 1), and its logits are the base logits plus the Markov bias of the TRUE
  previous token (teacher forcing: the anchor for slot 0, then the labels); the rnn head's
  state runs along the block from zeros, as when drafting.
- Each label has weight w_k = exp(-k / decay) (k = 0 … γ - 1) while it lies inside the
  sequence; every term is the weighted mean over the step's labels.
- loss = α_ce · CE(labels) + α_l1 · Σ_v |p_draft - p_target| + α_conf · BCE(logit c_k, a_k),
  where p_target is the target's own next-token distribution at the label's position
  (its final hidden state through the frozen LM head) and a_k = clip(1 - ½ Σ_v |p_draft -
  p_target|, 0, 1), held constant: the probability that speculative sampling accepts draft
  k. The confidence head reads [h_k ; W1[x_{k-1}]] (or h_k alone).
- Published drafters: α = 0.1 / 0.9 / 1.0, decay 4, rank 256, `vanilla`; DeepSpec's DFlash
  baselines are the same drafter with rank 0, no confidence head and CE alone.

The target's distribution is computed over the loss vocabulary (`Trainer`'s `vocab`): with
the default vocabulary of the training data it is the target's renormalised over those
tokens; `--full-vocab` makes the L1 term and a_k DeepSpec's exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.draft import DFlashConfig, DFlashDraft
from ..models.dspark import MARKOV_HEAD_TYPES, DSparkConfig, MarkovHead
from .blocks import block_hidden, block_loss, drafting_slots, predicting_positions
from .trainer import Sequence, Trainer

CONFIDENCE_INPUTS = ("markov", "hidden", "off")


@dataclass
class DSparkShape:
    """What `--arch dspark` adds to a drafter. DeepSpec publishes rank 256 for 151k-token
    vocabularies; 64 here, scaled down as `DFlash2Shape`'s selector rank (W1 and W2 then
    hold 6.3 M weights for SmolLM2's 49k tokens). `from_anchor` off keeps DFlash's slots
    (`shift_label: false`): a DFlash 1 drafter grown into a DSpark one then starts by
    drafting exactly what it did."""

    markov_rank: int = 64
    markov_head: str = "vanilla"
    confidence_head: str = "markov"  # its input: [h; W1[prev]], h alone, or no head
    from_anchor: bool = True

    @classmethod
    def of(cls, cfg: DSparkConfig) -> DSparkShape:
        confidence = "off"
        if cfg.confidence_head:
            confidence = "markov" if cfg.confidence_with_markov else "hidden"
        return cls(cfg.markov_rank, cfg.markov_head_type, confidence, cfg.from_anchor)

    def apply(self, cfg: DFlashConfig) -> DSparkConfig:
        """`cfg` (a DFlash 1 drafter's) as a DSpark drafter with these heads, checked."""
        if self.markov_rank < 0 or self.markov_head not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"--markov-rank must be at least 0 and --markov-head one of "
                f"{MARKOV_HEAD_TYPES}, got {self.markov_rank} and {self.markov_head!r}"
            )
        if self.confidence_head not in CONFIDENCE_INPUTS:
            raise ValueError(f"--confidence-head must be one of {CONFIDENCE_INPUTS}")
        if self.confidence_head == "markov" and not self.markov_rank:
            raise ValueError("--confidence-head markov reads W1[prev]: it needs --markov-rank > 0")
        if cfg.block_size < 2:
            raise ValueError(f"--block-size must be at least 2, got {cfg.block_size}")
        return DSparkConfig(
            **asdict(cfg),
            markov_rank=self.markov_rank,
            markov_head_type=self.markov_head,
            confidence_head=self.confidence_head != "off",
            confidence_with_markov=self.confidence_head == "markov",
            from_anchor=self.from_anchor,
        )

    def start(self, draft: DFlashDraft) -> None:
        """W2 at zero, W1 random (as DFlash 2's selector codebooks start): the Markov bias is
        zero at first, so the drafter drafts what its backbone does, yet W2's gradient is not."""
        if "markov_head" in draft:
            w2 = draft.markov_head.markov_w2
            w2.weight = mx.zeros_like(w2.weight)


def markov_latents(head: MarkovHead, prev: mx.array, hidden: mx.array) -> mx.array:
    """The Markov head's latents (N, γ, rank) of every slot given the true previous tokens
    `prev` (N, γ) and slot outputs `hidden` (N, γ, hidden); the rnn's state runs along the
    block from zeros as when drafting."""
    if head.kind != "rnn":
        return head.latent(prev, hidden)[0]
    state, latents = None, []
    for k in range(prev.shape[1]):
        latent, state = head.latent(prev[:, k], hidden[:, k], state)
        latents.append(latent)
    return mx.stack(latents, axis=1)


def dspark_loss(
    logits: mx.array,
    labels: mx.array,
    weights: mx.array,
    target_logits: mx.array | None = None,
    confidence_logits: mx.array | None = None,
) -> tuple[dict[str, mx.array], mx.array]:
    """DeepSpec's terms as `weights`-weighted sums over the labels (N, γ) (the weights sum to
    1 over a step), and the hits of the argmax. `target_logits` (N, γ, vocab) give the L1
    term and the confidence head's target; `confidence_logits` (N, γ) its loss."""
    ce, hits = block_loss(logits, labels, weights)
    parts = {"ce_loss": ce}
    if target_logits is None:
        return parts, hits
    draft_probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    target_probs = mx.softmax(target_logits.astype(mx.float32), axis=-1)
    distance = mx.abs(draft_probs - target_probs).sum(-1)
    parts["l1_loss"] = (distance * weights).sum()
    if confidence_logits is not None:
        accepted = mx.stop_gradient(mx.clip(1.0 - 0.5 * distance, 0.0, 1.0))
        bce = nn.losses.binary_cross_entropy(confidence_logits, accepted, reduction="none")
        parts["confidence_loss"] = (bce * weights).sum()
    return parts, hits


class DSparkTrainer(Trainer):
    """`Trainer` with DeepSpec's loss (module docstring) for a `DSparkDraft`: the loss is
    `ce_weight`, `l1_weight` and `confidence_weight` times its three terms. Its hits are
    the Markov walk's greedy choices given the true prefix, which is what greedy decoding
    accepts (before the confidence head shortens a verify)."""

    def __init__(
        self,
        model: nn.Module,
        draft: DFlashDraft,
        cfg,
        vocab: np.ndarray | None = None,
    ):
        super().__init__(model, draft, cfg, vocab)
        self.needs_target = cfg.l1_weight > 0 or "confidence_head" in draft

    def _target_hidden(self, seq: Sequence, anchors: np.ndarray) -> mx.array | None:
        """The target's final hidden states (N, γ, hidden) that predict each block's labels."""
        if not self.needs_target:
            return None
        if seq.last_hidden is None:
            raise ValueError(
                "the cached features lack the target's final hidden states, which DSpark's "
                "L1 and confidence losses read: run `train features` into a new work dir"
            )
        positions = predicting_positions(anchors, self.draft.config.block_size, len(seq.ids))
        return seq.last_hidden[mx.array(positions)].astype(mx.float32)

    def _batch(self, pairs: list[tuple[Sequence, np.ndarray]]) -> tuple[list, list]:
        batch, valid = super()._batch(pairs)
        targets = [self._target_hidden(seq, anchors) for seq, anchors in pairs]
        return [(*inputs, target) for inputs, target in zip(batch, targets)], valid

    def _loss(self, batch: list[tuple]) -> tuple[mx.array, mx.array, dict[str, mx.array]]:
        """(loss, hits, its parts: ce_loss, l1_loss and confidence_loss where computed)."""
        draft, cfg = self.draft, self.cfg
        markov = draft.get("markov_head")
        w2 = None if markov is None else markov.markov_w2.weight[self.vocab]
        sums: dict[str, mx.array] = {}
        hits = []
        for features, ids, anchors, labels, weights, _, prev, target_hidden in batch:
            hidden = block_hidden(draft, self.target.embed_tokens, features, ids, anchors)
            hidden = drafting_slots(hidden, draft.config.block_size)
            logits = self.head(hidden)
            if markov is not None:
                logits = logits + markov_latents(markov, prev, hidden) @ w2.T
            target = None if target_hidden is None else self.head(target_hidden)
            confidence = None
            if "confidence_head" in draft:
                features = draft.confidence_features(hidden, prev)
                confidence = draft.confidence_head.logits(features)
            parts, h = dspark_loss(logits, labels, weights, target, confidence)
            sums = {k: sums.get(k, 0.0) + v for k, v in parts.items()}
            hits.append(h)
        alphas = {
            "ce_loss": cfg.ce_weight,
            "l1_loss": cfg.l1_weight,
            "confidence_loss": cfg.confidence_weight,
        }
        total = sum(alphas[k] * v for k, v in sums.items())
        return total, mx.concatenate(hits), sums
