"""DSpark drafters (DeepSeek's DeepSpec): the DFlash 1 backbone, every slot predicting the next
token, a Markov head that chains the drafts and a confidence head that sizes the verify.

Read from the public reference `deepseek-ai/DeepSpec` (`deepspec/modeling/dspark/`,
`deepspec/eval/dspark/draft_ops.py` and the paper's Algorithm 1 and appendix A):

- The block is γ slots [anchor, mask × (γ - 1)] at the positions after the committed
  context, and slot k's output predicts the token after it: γ drafts, γ + 1 positions
  verified (DFlash reads slots 1…B-1 of a block of B). `sample_from_anchor: false`
  (speculators) or `shift_label: false` keeps the DFlash convention instead.
- Base logits U_k = head(h_k) with h_k the final-normed slot output, soft-capped where the
  target soft-caps, then the Markov head walks left to right from prev = anchor:
  logits_k = U_k + W2·W1[prev] (`vanilla`), W2·(σ(gate([h_k; W1[prev]])) ⊙ W1[prev])
  (`gated`), or through a recurrent state (`rnn`); x_k is chosen from logits_k and becomes
  prev. q_k = softmax(logits_k / T) is exact, so speculative sampling stays exact.
  `markov_rank: 0` (DeepSpec's DFlash baselines) drafts every slot independently.
- The confidence head c_k = σ(proj([h_k ; W1[x_{k-1}]])) (or of h_k alone) estimates the
  chance that x_k survives once the drafts before it did. The verify keeps drafts while the
  expected throughput (1 + Σ_i Π_{j≤i} c_j) / cost(k + 1) rises and stops at its first
  fall: c_k depends on x_{<k} only, so admitting x_k never depends on x_k itself, which
  keeps the output exact (a search past the first fall would not: the paper's appendix A).
- Gemma-4 drafters use the target's global-attention shapes: K = V when `attention_k_eq_v`
  (no `v_proj`), a scale-free RMS norm on V, attention scale 1, four norms and a
  `layer_scalar` per layer, a GeGLU MLP and the full-attention RoPE.

Four packagings load (`dspark_config`, `own_weights`): DeepSpec's own
(`Qwen3DSparkModel` / `Gemma4DSparkModel`, a target config copy plus the DSpark fields), the
`DSparkDraftModel` layout (`dflash_config.projector_type: "dspark"`, also LFM2.5's),
speculators' (`speculators_model_type: "dspark"`, `aux_hidden_state_layer_ids` one above
the target layer ids, a reduced draft vocabulary by `d2t`/`t2d`) and the Gemma-4 one.
Our converted layout is the `DSparkDraftModel` one. The drafter keeps using the target's
embedding and LM head: the checkpoints' frozen copies of them are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from .cycle_costs import FIXED_CYCLE_COSTS, backend, interpolated_cost
from .draft import (
    MLP,
    BlockContext,
    DFlashConfig,
    DFlashDraft,
    DraftAttention,
    DraftChain,
    DraftHead,
    DraftTree,
    block_rows,
    rank_tree,
)
from .tree import Drafted, search

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
TREE_WIDTH = 16  # candidates per depth a Markov tree scores
# Frozen copies of the target's embedding and head (and speculators' verifier parts):
# the drafter proposes through the target's own.
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")
DROPPED = (*TARGET_COPIES, "verifier_norm.weight", "d2t", "t2d")
ALIASES = {  # names other runtimes save the heads under -> ours (DeepSpec's)
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "confidence_proj.weight": "confidence_head.proj.weight",
    "confidence_proj.bias": "confidence_head.proj.bias",
}


@dataclass
class DSparkConfig(DFlashConfig):
    """A DFlash config plus DSpark's heads. `block_size` is, as for DFlash, the positions a
    full cycle verifies: γ + 1 for γ slots that each draft (the checkpoint's `block_size` is
    γ); with DFlash's slots (`from_anchor` off) the two agree."""

    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = False
    from_anchor: bool = True  # slot k predicts the token after it (False: DFlash's slots)
    rope_traditional: bool = False
    layer_kind: str = "qwen3"  # or "gemma4"
    attention_k_eq_v: bool = False
    layout: str = "dspark"  # the packaging it was read from

    @property
    def slots(self) -> int:
        """γ, the checkpoint's `block_size`: the slots of a full block."""
        return self.block_size - 1 if self.from_anchor else self.block_size

    def to_dict(self) -> dict[str, Any]:
        """Our layout: the `DSparkDraftModel` one with every field explicit."""
        out = super().to_dict()
        out["architectures"] = ["DSparkDraftModel"]
        out["block_size"] = self.slots
        out["dflash_config"].update(
            projector_type="dspark",
            markov_rank=self.markov_rank,
            markov_head_type=self.markov_head_type,
            enable_confidence_head=self.confidence_head,
            confidence_head_with_markov=self.confidence_with_markov,
            shift_label=self.from_anchor,
        )
        out["rope_is_neox_style"] = not self.rope_traditional
        if self.layer_kind == "gemma4":
            out.update(model_type="gemma4_text", attention_k_eq_v=self.attention_k_eq_v)
        return out


def is_dspark(cfg: dict[str, Any]) -> bool:
    """Whether a drafter config.json is one of DSpark's packagings."""
    dflash = cfg.get("dflash_config") or {}
    archs = " ".join(cfg.get("architectures") or [])
    return (
        cfg.get("speculators_model_type") == "dspark"
        or "DSpark" in archs
        or dflash.get("projector_type") == "dspark"
        or "markov_rank" in cfg
        or "markov_rank" in dflash
    )


def _flatten(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(the backbone fields `DFlashConfig.from_dict` reads, the DSpark fields, the layout)."""
    if cfg.get("speculators_model_type") == "dspark":
        layer = cfg.get("transformer_layer_config")
        aux = cfg.get("aux_hidden_state_layer_ids")
        if not isinstance(layer, dict) or not aux:
            raise ValueError(
                "speculators DSpark config.json lacks transformer_layer_config or "
                "aux_hidden_state_layer_ids"
            )
        flat = dict(layer)
        flat.update(
            block_size=cfg.get("block_size"),
            mask_token_id=cfg.get("mask_token_id"),
            target_layer_ids=[int(i) - 1 for i in aux],  # speculators count the embedding
        )
        heads = dict(cfg, shift_label=cfg.get("sample_from_anchor", True))
        return flat, heads, "speculators"
    archs = cfg.get("architectures") or []
    if any(a in ("Qwen3DSparkModel", "Gemma4DSparkModel") for a in archs):
        return dict(cfg), dict(cfg), "deepspec"
    heads = {**cfg, **(cfg.get("dflash_config") or {})}
    return dict(cfg), heads, "dspark"


def _gemma4_backbone(flat: dict[str, Any]) -> bool:
    """Gemma-4's global-attention shapes in the fields `DFlashConfig` reads; True if Gemma-4."""
    if not str(flat.get("model_type", "")).startswith("gemma4"):
        return False
    k_eq_v = bool(flat.get("attention_k_eq_v"))
    flat["head_dim"] = flat.get("global_head_dim") or flat.get("head_dim")
    if k_eq_v and flat.get("num_global_key_value_heads"):
        flat["num_key_value_heads"] = flat["num_global_key_value_heads"]
    rope = flat.get("rope_parameters") or {}
    if "full_attention" in rope:
        flat["rope_parameters"] = rope["full_attention"]
    flat["layer_types"] = ["full_attention"] * int(flat["num_hidden_layers"])
    return True


def dspark_config(cfg: dict[str, Any]) -> DSparkConfig:
    """Read any of the four DSpark packagings (see the module docstring)."""
    flat, heads, layout = _flatten(cfg)
    gemma4 = _gemma4_backbone(flat)
    if flat.get("block_size") is None and not (flat.get("dflash_config") or {}).get("block_size"):
        raise ValueError("DSpark config.json lacks block_size (the number of drafts, γ)")
    base = DFlashConfig.from_dict(flat)
    rank = int(heads.get("markov_rank") or 0)
    kind = str(heads.get("markov_head_type") or "vanilla").lower()
    if rank < 0 or kind not in MARKOV_HEAD_TYPES:
        raise ValueError(
            f"DSpark config.json: markov_rank must be >= 0 and markov_head_type one of "
            f"{MARKOV_HEAD_TYPES}, got {rank} and {kind!r}"
        )
    from_anchor = bool(heads.get("shift_label", True))
    if from_anchor:
        base.block_size += 1  # γ drafts: γ + 1 positions verified
    confidence = bool(heads.get("enable_confidence_head", heads.get("use_confidence_head")))
    with_markov = confidence and bool(heads.get("confidence_head_with_markov", rank > 0))
    if with_markov and not rank:
        raise ValueError("DSpark config.json: confidence_head_with_markov needs markov_rank > 0")
    return DSparkConfig(
        **asdict(base),
        markov_rank=rank,
        markov_head_type=kind,
        confidence_head=confidence,
        confidence_with_markov=with_markov,
        from_anchor=from_anchor,
        rope_traditional=not bool(cfg.get("rope_is_neox_style", True)),
        layer_kind="gemma4" if gemma4 else "qwen3",
        attention_k_eq_v=gemma4 and bool(flat.get("attention_k_eq_v")),
        layout=layout,
    )


def own_weights(config: DSparkConfig, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The checkpoint's tensors under our names, the target copies dropped.

    A speculators draft vocabulary (`d2t`, draft index i -> token i + d2t[i]; `t2d`, a mask
    over the target's tokens) becomes `config.draft_vocab`, and its Markov W2 (one row per
    draft token) a full-vocabulary one with zero rows elsewhere.
    """
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        name = ALIASES.get(name, name)
        if name in out:
            raise ValueError(f"drafter tensor {name} is stored twice (under two names)")
        if name not in DROPPED:
            out[name] = value
    if "d2t" not in weights:
        return out
    d2t = np.array(weights["d2t"]).astype(np.int64)
    ids = (np.arange(d2t.size) + d2t).tolist()
    if "t2d" in weights and np.flatnonzero(np.array(weights["t2d"])).tolist() != sorted(ids):
        raise ValueError("drafter d2t and t2d name different draft vocabularies")
    if sorted(ids) != ids or not 0 <= ids[0] <= ids[-1] < config.vocab_size:
        raise ValueError(f"drafter d2t maps to token ids outside [0, {config.vocab_size})")
    if len(ids) < config.vocab_size:
        config.draft_vocab = ids
        w2 = out.get("markov_head.markov_w2.weight")
        if w2 is not None and w2.shape[0] == len(ids):
            full = mx.zeros((config.vocab_size, w2.shape[1]), dtype=w2.dtype)
            full[mx.array(ids)] = w2
            out["markov_head.markov_w2.weight"] = full
    return out


class MarkovHead(nn.Module):
    """The bias of draft k from the token before it: W2·W1[prev] and its variants."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def latent(
        self, prev: mx.array, hidden: mx.array, state: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """(the rank-r vector W2 projects, the next state) for previous tokens `prev` (...,)
        and slot outputs `hidden` (..., hidden); `state` is the rnn's (zeros at the block
        start). Training projects it on the loss vocabulary's rows of W2 only."""
        embedded = self.markov_w1(prev)
        hidden = mx.broadcast_to(hidden, (*embedded.shape[:-1], hidden.shape[-1]))
        if self.kind == "vanilla":
            return embedded, None
        if self.kind == "gated":
            gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, embedded], axis=-1)))
            return gate * embedded, None
        state = mx.zeros_like(embedded) if state is None else state
        joint = self.joint_proj(mx.concatenate([state, embedded, hidden], axis=-1))
        gate, candidate, output = mx.split(joint, 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1.0 - gate) * mx.tanh(candidate)
        return mx.tanh(output), state

    def step(
        self, prev: mx.array, hidden: mx.array, state: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """(bias over the vocabulary, the next state): W2 times `latent`."""
        latent, state = self.latent(prev, hidden, state)
        return self.markov_w2(latent), state


class ConfidenceHead(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.proj = nn.Linear(features, 1)

    def logits(self, features: mx.array) -> mx.array:
        """The logit of c_k (what training's binary cross-entropy reads)."""
        return self.proj(features)[..., 0].astype(mx.float32)

    def __call__(self, features: mx.array) -> mx.array:
        return mx.sigmoid(self.logits(features))


def confident_length(confidence: list[float], cost: Callable[[int], float]) -> int:
    """How many drafts to verify: admit draft k while the expected throughput
    (1 + Σ_{i≤k} Π_{j≤i} c_j) / cost(k + 1) rises, stop at its first fall (Algorithm 1
    for one request; stopping there, not at the global best, keeps the output exact)."""
    best, expected, survival, keep = 1.0 / cost(1), 1.0, 1.0, 0
    for k, c in enumerate(confidence, 1):
        survival *= c
        expected += survival
        rate = expected / cost(k + 1)
        if rate <= best:
            break
        best, keep = rate, k
    return keep


def geglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * x


class Gemma4Attention(DraftAttention):
    """Gemma-4 global attention: K = V without `v_proj` when `attention_k_eq_v`, a scale-free
    RMS norm on V, attention scale 1."""

    def __init__(self, cfg: DSparkConfig, window: int | None, kernels: str):
        super().__init__(cfg, window, kernels)
        self.scale = 1.0
        if cfg.attention_k_eq_v:
            self.pop("v_proj")
        self.eps = cfg.rms_norm_eps

    def keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        projected = self.k_proj(x)
        keys = self.rope(self.k_norm(self._heads(projected, self.n_kv_heads)), offset=offset)
        raw = self.v_proj(x) if "v_proj" in self else projected
        values = mx.fast.rms_norm(self._heads(raw, self.n_kv_heads), None, self.eps)
        return keys, values


class GeGLU(MLP):
    """The draft MLP with Gemma's tanh-approximated GELU gate."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Gemma4Layer(nn.Module):
    """Gemma-4's draft layer: norms before and after each sublayer, scaled by `layer_scalar`."""

    def __init__(self, cfg: DSparkConfig, window: int | None, kernels: str):
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, window, kernels)
        self.mlp = GeGLU(dim, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache: KVCache | BlockContext) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class DSparkDraft(DFlashDraft):
    """A DSpark drafter: `propose` walks the Markov head along the slots and truncates the
    chain by the confidence head; `trees` grows the tree the Markov walk would sample.

    `verify_cost(n)`, a cycle's cost when it verifies n positions (by default this
    backend's `cycle_costs.FIXED_CYCLE_COSTS`), drives the confidence truncation; None
    verifies every draft asked for.
    """

    def __init__(
        self, config: DSparkConfig, kernels: str = "auto", context_window: int | None = None
    ):
        super().__init__(config, kernels, context_window)
        cfg = config
        if cfg.layer_kind == "gemma4":
            self.layers = [
                Gemma4Layer(cfg, context_window, kernels) for _ in range(cfg.num_hidden_layers)
            ]
        if cfg.rope_traditional:
            for layer in self.layers:
                attention = layer.self_attn
                attention.rope = initialize_rope(
                    attention.head_dim,
                    cfg.rope_theta,
                    True,
                    cfg.rope_scaling,
                    cfg.max_position_embeddings,
                )
        if cfg.markov_rank:
            self.markov_head = MarkovHead(
                cfg.vocab_size, cfg.markov_rank, cfg.hidden_size, cfg.markov_head_type
            )
        if cfg.confidence_head:
            features = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(features)
        self.verify_cost: Callable[[int], float] | None = None
        if cfg.confidence_head:
            self.verify_cost = partial(interpolated_cost, FIXED_CYCLE_COSTS[backend()])

    def slot_hidden(
        self, blocks: mx.array, embed: Callable[[mx.array], mx.array], caches: list
    ) -> mx.array:
        """Final hidden states (rows, L - 1, hidden) of the slots that predict the L - 1
        tokens after each row's root, for `blocks` (rows, L) = [root, mask, ...]."""
        if self.config.from_anchor:
            return self.block_hidden(blocks[:, :-1], embed, caches)
        return self.mask_hidden(blocks, embed, caches)

    def propose(
        self,
        blocks: mx.array,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        rows: list[DraftChain],
    ) -> list[tuple[mx.array, mx.array | None]]:
        """Up to `length` drafts after each row's root and their log q, as
        `DFlashDraft.propose`: one drafter forward, then per row the Markov walk's choices,
        cut where the confidence head says to stop verifying."""
        hidden = self.slot_hidden(blocks, embed, [row.cache for row in rows])
        logits = self.head_logits(hidden, lm_head)
        cut = "confidence_head" in self and self.verify_cost is not None
        proposed, confidences = [], []
        for i, row in enumerate(rows):
            root, n, choose, context = blocks[i, :1], row.length, row.choose, row.context
            if "markov_head" not in self:
                tokens, logq = choose(logits[i, :n], context)
            else:
                tokens, logq = self.walk(hidden[i, :n], logits[i, :n], root, choose, context)
            proposed.append((tokens, logq))
            if cut:
                prev = mx.concatenate([root, tokens[:-1].astype(root.dtype)])
                confidences.append(self.confidence(hidden[i, :n], prev))
        if not cut:
            return proposed
        mx.eval(confidences)  # one read for every row
        keeps = [confident_length(c.tolist(), self.verify_cost) for c in confidences]
        return [
            (tokens[:keep], None if logq is None else logq[:keep])
            for (tokens, logq), keep in zip(proposed, keeps)
        ]

    def walk(
        self,
        hidden: mx.array,
        logits: mx.array,
        root: mx.array,
        choose: Callable[..., tuple[mx.array, mx.array | None]],
        context: list[int] | None,
    ) -> tuple[mx.array, mx.array | None]:
        """The Markov chain from prev = `root`: each slot's logits plus the bias of the token
        chosen before it. With logits processors (`context` given) each step sees the drafts
        before it, which reads them from the device; otherwise nothing syncs."""
        prev, state, tokens, logqs = root[0], None, [], []
        for k in range(hidden.shape[0]):
            bias, state = self.markov_head.step(prev, hidden[k], state)
            seen = None if context is None else context + [int(t) for t in tokens]
            token, logq = choose((logits[k] + bias.astype(logits.dtype))[None], seen)
            prev = token[0]
            tokens.append(prev)
            logqs.append(logq)
        q = None if logqs[0] is None else mx.concatenate(logqs)
        return mx.stack(tokens), q

    def confidence_features(self, hidden: mx.array, prev: mx.array) -> mx.array:
        """The confidence head's input for slot outputs `hidden` whose previous tokens are
        `prev`: `hidden`, with W1[prev] beside it where the head reads the Markov embedding."""
        if not self.config.confidence_with_markov:
            return hidden
        embedded = self.markov_head.markov_w1(prev).astype(hidden.dtype)
        return mx.concatenate([hidden, embedded], axis=-1)

    def confidence(self, hidden: mx.array, prev: mx.array) -> mx.array:
        """c_k (len,) for slot outputs `hidden` whose previous tokens are `prev`."""
        return self.confidence_head(self.confidence_features(hidden, prev))

    def trees(
        self,
        depth: int,
        embed: Callable[[mx.array], mx.array],
        head: DraftHead,
        rows: list[DraftTree],
    ) -> list[Drafted]:
        """Each row's `budget` best continuations of its root as the Markov walk scores them,
        from one drafter forward, built on the device: a node's children from its slot's
        logits plus the bias of the node's own token. Without a Markov head the slots' logits
        rank apart, by the row's `scores` of them if given (`DFlashDraft.trees`); with one,
        each node's children are ranked by the walk's own."""
        blocks = block_rows([row.root for row in rows], depth, self.config.mask_token_id)
        hidden = self.slot_hidden(blocks, embed, [row.cache for row in rows])
        if "markov_head" not in self:
            logits = self.head_logits(hidden, head.rows)
            return [rank_tree(row, logits[i], head) for i, row in enumerate(rows)]
        if self.config.markov_head_type == "rnn":
            raise ValueError("a DSpark drafter with an rnn Markov head drafts chains, not trees")
        logits = self.head_logits(hidden, head).astype(mx.float32)
        return [self.markov_tree(row, hidden[i], logits[i]) for i, row in enumerate(rows)]

    def markov_tree(self, row: DraftTree, hidden: mx.array, logits: mx.array) -> Drafted:
        """One row's Markov tree from its slots' outputs and logits (depth, ...)."""
        width = min(row.budget, TREE_WIDTH, logits.shape[-1])
        prev, candidates, edges = row.root, [], []
        for t in range(hidden.shape[0]):
            bias, _ = self.markov_head.step(prev, hidden[t])
            scores = logits[t] + bias.astype(mx.float32)  # (parents, vocab)
            logprobs = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
            best = mx.argpartition(-logprobs.max(axis=0), width - 1)[:width]
            edge = mx.take(logprobs, best, axis=1)
            edges.append(mx.broadcast_to(edge, (width, width)))
            candidates.append(best)
            prev = best
        return search(row.root, mx.stack(candidates), mx.stack(edges), row.budget, row.chain)
