"""Random anchored blocks and the block-sparse training forward.

A training sequence (prompt + reply, with cached target features) yields N
blocks, each [anchor token] + mask tokens at positions anchor..anchor+B-1,
labelled with the next B-1 tokens. This mirrors one drafting cycle: the anchor
is the last committed token, whose own features the target has not produced
yet, so block i sees the context of positions < anchor_i and its own block,
never another block. The blocks are the batch rows of one drafter forward
(`BlockContext` replaces the caches), which is the paper's sparse mask without
computing the zero blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..models.draft import BlockContext, CandidateSelector, DFlashDraft


def sample_anchors(candidates: np.ndarray, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `num_blocks` distinct sorted anchors among `candidates` (`Sequence.anchors`)."""
    if len(candidates) <= num_blocks:
        return candidates
    return np.sort(rng.choice(candidates, size=num_blocks, replace=False))


def target_path(
    ids: np.ndarray, top_ids: np.ndarray, top_logp: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Of text the target did not write: its greedy next token after every position (T,), and
    whether each token of `ids` is the one it would have chosen there (T,; the first: true)."""
    greedy = np.take_along_axis(top_ids, top_logp.argmax(-1, keepdims=True), -1)[:, 0]
    chosen = np.ones(len(ids), dtype=bool)
    chosen[1:] = ids[1:] == greedy[:-1]
    return greedy, chosen


def block_labels(
    ids: np.ndarray,
    anchors: np.ndarray,
    block_size: int,
    path: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple:
    """Labels (N, B-1) = tokens anchor+1..anchor+B-1 and a validity mask (past the end: 0).

    Given the `target_path` of text the target did not write, label k is the target's own
    choice after the block's first k tokens, valid only while the tokens before it (the
    anchor's successors) were its choices too: only then is it what decoding would ask the
    drafter for, so such text teaches the target's greedy path and nothing else.
    """
    pos = anchors[:, None] + np.arange(1, block_size)[None]
    valid = pos < len(ids)
    clipped = np.minimum(pos, len(ids) - 1)
    if path is None:
        return ids[clipped], valid
    greedy, chosen = path
    valid[:, 1:] &= np.cumprod(chosen[clipped[:, :-1]], axis=1).astype(bool)
    return greedy[clipped - 1], valid


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """The paper's loss decay w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1."""
    return np.exp(-np.arange(block_size - 1) / gamma)


def context_mask(anchors: np.ndarray, length: int, window: int | None = None) -> mx.array:
    """(N, 1, 1, T): block i sees context positions t < anchor_i (and >= anchor_i - window)."""
    t = np.arange(length)[None]
    a = anchors[:, None]
    visible = t < a
    if window is not None:
        visible &= t >= a - window
    return mx.array(visible[:, None, None, :])


def block_hidden(
    draft: DFlashDraft,
    embed: Callable[[mx.array], mx.array],
    features: mx.array,
    ids: np.ndarray,
    anchors: np.ndarray,
) -> mx.array:
    """Final drafter hidden states (N, slots, hidden) of all blocks of one sequence in one
    forward (`DFlashConfig.slots`: B for DFlash, γ = B - 1 for DSpark)."""
    cfg = draft.config
    context = draft.fuse(features[None].astype(mx.float32))
    offsets = mx.array(anchors.astype(np.int32))
    contexts = []
    for layer in draft.layers:
        keys, values = layer.self_attn.keys_values(context, 0)
        mask = context_mask(anchors, features.shape[0], layer.self_attn.window)
        contexts.append(BlockContext(keys, values, offsets, mask))
    block = np.full((len(anchors), cfg.slots), cfg.mask_token_id, dtype=np.int32)
    block[:, 0] = ids[anchors]
    return draft(draft.embed_blocks(embed, mx.array(block)), contexts)


def drafting_slots(hidden: mx.array, block_size: int) -> mx.array:
    """Of `block_hidden`'s output, the slots (N, B-1, hidden) that draft the B-1 labels:
    DFlash's mask slots, or every slot of a DSpark block (each predicts the token after it)."""
    return hidden[:, hidden.shape[1] - (block_size - 1) :]


def block_loss(
    logits: mx.array,
    labels: mx.array,
    weights: mx.array,
    soft: tuple[mx.array, mx.array] | None = None,
    soft_weight: float = 0.5,
) -> tuple[mx.array, mx.array]:
    """Weighted cross-entropy sum over the mask positions' `logits` (N, B-1, vocab), and the
    per-label hits (N, B-1) of their argmax.

    `soft` = (ids, probs), each (N, B-1, K): the target's own top-K next-token
    distribution at each label's position; the loss then mixes the hard-label
    cross-entropy with the cross-entropy against it (`soft_weight`), which
    says how close the runners-up were, not just which token won.
    """
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if soft is not None:
        ids, probs = soft
        soft_ce = -(mx.take_along_axis(logp, ids, axis=-1) * probs).sum(-1)
        ce = (1 - soft_weight) * ce + soft_weight * soft_ce
    hits = mx.stop_gradient(mx.argmax(logits, axis=-1) == labels)
    return (ce * weights).sum(), hits


def predicting_positions(anchors: np.ndarray, block_size: int, length: int) -> np.ndarray:
    """Positions anchor..anchor+B-2 (N, B-1), clipped to the sequence: the target's output
    at each predicts the next label, and its token is the true token before that label."""
    return np.minimum(anchors[:, None] + np.arange(block_size - 1)[None], length - 1)


def block_predecessors(ids: np.ndarray, anchors: np.ndarray, block_size: int) -> np.ndarray:
    """The true token before each label (N, B-1): the anchor, then labels 1..B-2."""
    return ids[predicting_positions(anchors, block_size, len(ids))]


def selector_loss(
    selector: CandidateSelector,
    hidden: mx.array,
    logits: mx.array,
    predecessors: mx.array,
    labels: mx.array,
    weights: mx.array,
    vocab: mx.array,
) -> tuple[mx.array, mx.array]:
    """DFlash 2's path-selector loss, teacher-forced: the weighted CE sum and the hits (N, B-1).

    At each mask position the candidates are the top-K of the drafter's `logits`
    (rows of the loss vocabulary; `vocab` maps them to token ids) and candidate
    b scores `U_t(b) + <A[a] * (W h_t), B[b]>` with a the TRUE previous token
    (`predecessors`): the decoding walk scores it so whenever every earlier
    choice was right, the only case in which a later choice can be accepted.
    The loss is the cross-entropy of the label among the K scores, so it trains
    exactly the comparison the walk makes. A label outside the top-K replaces
    the weakest candidate in the loss only (as SpecForge #772 and vLLM
    speculators #1006 do; NeMo's trainer drops such positions instead): the loss
    is then defined at every labelled position with the token loss's weights, so
    it is comparable from step to step (dropping them, it rises as the drafter
    brings harder labels into the top-K), and it lifts the label's own logit.
    A hit keeps the serving rule: the label is a real candidate and the walk,
    given the true prefix, picks it, which is what decoding accepts.
    """
    k = min(selector.top_k, logits.shape[-1])
    candidates = mx.argpartition(mx.stop_gradient(logits), -k, axis=-1)[..., -k:]
    present = (candidates == labels[..., None]).any(axis=-1)
    weakest = mx.arange(k) == 0  # argpartition puts the K-th largest first
    candidates = mx.where(present[..., None] | ~weakest, candidates, labels[..., None])
    unary = mx.take_along_axis(logits, candidates, axis=-1)
    context = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden)
    successors = selector.successor_codebook[vocab[candidates]]
    scores = unary + (successors @ context[..., None])[..., 0]
    target = mx.argmax(candidates == labels[..., None], axis=-1, keepdims=True)
    ce = mx.logsumexp(scores, axis=-1) - mx.take_along_axis(scores, target, axis=-1)[..., 0]
    hits = mx.stop_gradient(present & (mx.argmax(scores, axis=-1) == target[..., 0]))
    return (ce * weights).sum(), hits


def soft_labels(
    top_ids: np.ndarray, top_logp: np.ndarray, anchors: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-K at positions anchor..anchor+B-2 (each predicts the next label)."""
    pos = predicting_positions(anchors, block_size, len(top_ids))
    return top_ids[pos], top_logp[pos]
