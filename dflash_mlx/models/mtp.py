"""The multi-token-prediction (MTP) layers a checkpoint ships beside its target, as a drafter.

Qwen3.5, Qwen3.6 and Qwen3-Next checkpoints carry `mtp.*` tensors, DeepSeek-V3, GLM-4.5 to
4.7 and GLM-5 a nextn layer after their last (`LAYOUTS`; GLM-5's attends sparsely, as its
target's layers, its indexer's keys cached beside the latents): DeepSeek-V3's recipe of one
more decoder layer of the target's own kind. DeepSeek-V4.1's `mtp.*` are refused (`REFUSED`):
they are not DeepSeek-V4's MTP block but a drafter of another kind.
At position p it reads the target's final hidden state h_p (after the target's last norm) and
the embedding of the token after it, x_{p+1}, each RMS-normed, concatenated and projected
(`fc`), through the layer (attention over its own KV cache of every position) and a norm; the
target's LM head on the result predicts x_{p+2}.
A chain runs it k times: each step reads the last step's output as its hidden state and the
token that step drafted. A tree takes each step's top-k along the greedy chain.
With a draft vocabulary (`mtp_draft_vocab` in the target's config.json, which `train export
--draft-vocab N` writes) every step's logits are the head's rows of those ids alone: each
sequential step of a chain pays for a few thousand rows of the LM head, not the whole
vocabulary's, as a DFlash drafter's block does.

`MTPDraft` drafts through the same proposer interface as the DFlash drafter (`propose`,
`trees`, `append_context`, `make_cache`), so the cycle, the samplers and shared cycles take
it as they are. It taps the target's last layer and applies the target's final norm itself
(a copy of that norm's weight, read with the MTP tensors). The features of the positions each
cycle kept wait in the reply's `MTPCache` until the next chain, whose root is the token after
the last of them; the tokens after the others are the reply's committed tokens (`MTPRow`).
Each chain first runs the MTP layer over the waiting positions, then k - 1 steps of its own,
whose entries leave the cache again: committed positions are always entries of the target's
hidden states, never of the layer's own guesses.

mlx-lm's `sanitize` drops these tensors when it loads the target, so `load_mtp` reads them
from the target's own safetensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from . import backends
from .draft import DraftChain, DraftHead, DraftTree, draft_vocabulary, rank_tree
from .loading import (
    cast_model,
    default_dtype,
    load_checked,
    read_config,
    resolve_path,
    safetensors,
)
from .rollback import CacheGroup, cache_parts
from .rows import attention as rows_attention
from .rows import row_caches
from .tree import Drafted


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its MTP layers: the mlx-lm module, decoder layer class and args
    class of its layers, the config field counting them, and how its checkpoints name them:
    Qwen's `mtp.*` (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.i`, `norm`)
    or DeepSeek-V3's nextn layers after the last (`model.layers.{N + i}.*`, with `eh_proj`,
    `enorm`, `hnorm` and `shared_head.norm`; their copies of the target's embedding and
    head, which they share, are not read). `layer_module` is the module of the layer class
    where the family's module borrows it; `layer_cache` makes one layer's cache (a sparse
    attention's MLA latents beside its indexer's keys)."""

    module: str
    layer: str
    args: str
    count: str
    nextn: bool = False
    layer_module: str | None = None
    layer_cache: Callable[[], Any] = KVCache
    published: bool = True  # its published checkpoints carry MTP layers


LAYOUTS = {
    "qwen3_5": Layout("qwen3_5", "DecoderLayer", "TextModelArgs", "mtp_num_hidden_layers"),
    "qwen3_5_moe": Layout("qwen3_5", "DecoderLayer", "TextModelArgs", "mtp_num_hidden_layers"),
    "qwen3_next": Layout(
        "qwen3_next", "Qwen3NextDecoderLayer", "ModelArgs", "mtp_num_hidden_layers"
    ),
    "glm4_moe": Layout("glm4_moe", "DecoderLayer", "ModelArgs", "num_nextn_predict_layers", True),
    "deepseek_v3": Layout(
        "deepseek_v3", "DeepseekV3DecoderLayer", "ModelArgs", "num_nextn_predict_layers", True
    ),
    "glm_moe_dsa": Layout(  # GLM-5: DeepSeek-V3.2's layer, its indexer's keys cached beside
        "glm_moe_dsa",
        "DeepseekV32DecoderLayer",
        "ModelArgs",
        "num_nextn_predict_layers",
        True,
        layer_module="deepseek_v32",
        layer_cache=lambda: CacheGroup(KVCache(), KVCache()),
    ),
    # no published llama checkpoint has one: a layer `train fit --arch mtp` trained, in
    # DeepSeek-V3's names (`train export` writes it beside the target's weights)
    "llama": Layout(
        "llama", "TransformerBlock", "ModelArgs", "num_nextn_predict_layers", True, published=False
    ),
}
# Families whose checkpoints carry MTP layers this drafter cannot run, and why.
REFUSED = {
    "deepseek_v41": "its checkpoints' `mtp.0-2.*` are not DeepSeek-V4's MTP block (`e_proj`, "
    "`h_proj` and a stream head over the last layer's 4 hyper-connection streams, as mlx-vlm's "
    "deepseek_v4_mtp runs it; V4.1 ships none of them) but a 3-stage DSpark drafter of V4.1 "
    "blocks (`mtp.0.main_proj` over the streams' mean at `dspark_target_layer_ids`, "
    "`mtp.2.markov_head` and `confidence_head`), which neither mlx-lm (its sanitize drops "
    "`mtp.*`) nor mlx-vlm runs",
}
PREFIX = "mtp."
NEXTN_NAMES = {
    "eh_proj": "fc",
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "shared_head.norm": "norm",
}
NEXTN_SHARED = ("embed_tokens.", "shared_head.head.")  # the target's own, not read
# The MTP norms a Hugging Face checkpoint stores zero-centred (the weight is 1 + w), as
# mlx-lm's sanitize adds 1 to the target's own.
CENTRED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)
# Where a checkpoint keeps the target's final norm (names without a leading "model.").
FINAL_NORM_NAMES = ("norm.weight", "language_model.norm.weight", "language_model.model.norm.weight")
# The target's config.json key listing the MTP layers' draft vocabulary (our extension:
# runtimes that do not know it ignore it and draft over every token, which costs speed only).
VOCAB_KEY = "mtp_draft_vocab"
CATCH_UP_STEP = 2048  # positions the layers run at a time before a chain (a prefill's step)
DEFAULT_BLOCK_SIZE = 4  # the root and 3 drafts; the adaptive policy verifies fewer where they pay


@dataclass
class MTPConfig:
    """What the proposer interface reads of a drafter's config, for the target's MTP layers:
    they tap the target's last layer, draft over its whole vocabulary or `draft_vocab`, and
    use no mask token."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    num_hidden_layers: int
    rms_norm_eps: float
    block_size: int = DEFAULT_BLOCK_SIZE
    quantization: dict | None = None
    mask_token_id: int = 0
    draft_vocab: list[int] | None = None

    @classmethod
    def for_target(cls, model_type: str, args: Any, **fields: Any) -> MTPConfig:
        """The config of MTP layers for a target of `args` (its family's ModelArgs)."""
        return cls(
            model_type=model_type,
            hidden_size=args.hidden_size,
            vocab_size=args.vocab_size,
            num_target_layers=args.num_hidden_layers,
            rms_norm_eps=args.rms_norm_eps,
            **{"num_hidden_layers": 1, **fields},
        )

    @property
    def target_layer_ids(self) -> list[int]:
        return [self.num_target_layers - 1]


class MTPCache:
    """One reply's MTP state: the MTP layers' KV caches and the target's features of the
    positions after them (`waiting`), run through the layer at the next chain, once the token
    after each is known. The last position run stays waiting too, so that a trim back to any
    waiting position keeps the feature it needs. Its `offset` is the target's: every position
    either has an entry or waits."""

    def __init__(self, num_layers: int, layer_cache: Callable[[], Any] = KVCache):
        self.make_layer = layer_cache
        self.layers = [layer_cache() for _ in range(num_layers)]
        self.features: mx.array | None = None  # (1, waiting, hidden)

    @property
    def waiting(self) -> int:
        return 0 if self.features is None else self.features.shape[1]

    @property
    def offset(self) -> int:
        return self.layers[0].offset + self.waiting

    def append(self, features: mx.array) -> None:
        """Features (1, n, hidden) of the next n positions."""
        wait = self.features
        self.features = features if wait is None else mx.concatenate([wait, features], axis=1)

    def can_trim(self, n: int) -> bool:
        """Whether the last n positions can go (an entry holds the token after its position,
        so only waiting positions can, and the last waiting one is needed for the next entry),
        or every position (a fresh start)."""
        return n < self.waiting or n >= self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n >= self.offset:
            n = self.offset
            self.layers = [self.make_layer() for _ in self.layers]
            self.features = None
            return n
        if not self.can_trim(n):
            raise ValueError(
                f"the MTP cache keeps the last {self.waiting - 1} positions, not {n}: its "
                "entries hold the token after each position"
            )
        if n:
            self.features = self.features[:, : self.waiting - n]
        return n

    @property
    def state(self) -> list[mx.array]:
        """What evaluating the cache evaluates."""
        arrays = [a for c in cache_parts(self.layers) if c.keys is not None for a in c.state]
        return arrays + ([] if self.features is None else [self.features])

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in cache_parts(self.layers)) + (
            0 if self.features is None else self.features.nbytes
        )


class PromptCacheLike(Protocol):
    """What `MTPRow` reads of a prompt cache: the drafter caches and the tokens they hold."""

    draft: list
    tokens: list[int]


class MTPRow:
    """A reply as the MTP drafter sees it: its `MTPCache` and the tokens its target caches
    hold (the token after each waiting position), read from its prompt cache when drafting."""

    def __init__(self, prompt_cache: PromptCacheLike):
        self.prompt_cache = prompt_cache

    @property
    def cache(self) -> MTPCache:
        return self.prompt_cache.draft[0]

    @property
    def tokens(self) -> list[int]:
        return self.prompt_cache.tokens


class MTPDraft(nn.Module):
    """The target's MTP layers (named as Qwen's `mtp.*`) and a copy of its final norm
    (`target_norm`), drafting through the target's embedding and LM head."""

    def __init__(self, config: MTPConfig, args: Any):
        super().__init__()
        self.config = config
        layout = LAYOUTS[config.model_type]
        module = importlib.import_module(f"mlx_lm.models.{layout.layer_module or layout.module}")
        layer = getattr(module, layout.layer)
        # the MTP layer attends over every position and is an MoE layer where the target's are
        # (a nextn layer by its own index: after the last, past the dense ones)
        index = args.num_hidden_layers if layout.nextn else 0
        full = {"full_attention_interval": 1, "mlp_only_layers": []}
        args = replace(args, **{k: v for k, v in full.items() if k in _fields(args)})
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.target_norm = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [layer(args, index) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    @property
    def carries_unnormed(self) -> bool:
        """Whether a chain's next step reads the last step's output before the final norm (a
        nextn layer, as vLLM's DeepSeek-V3 and GLM-4.5 MTP run it) or after (Qwen's)."""
        return LAYOUTS[self.config.model_type].nextn

    def make_cache(self) -> list[MTPCache]:
        return [MTPCache(len(self.layers), LAYOUTS[self.config.model_type].layer_cache)]

    def append_context(
        self, features: mx.array, rows: list[MTPRow], counts: list[int] | None = None
    ) -> None:
        """The target's last-layer features (rows, n, hidden) of the positions each row kept:
        row i's first `counts[i]` (all if None) wait for the next chain."""
        counts = counts or [features.shape[1]] * len(rows)
        normed = self.target_norm(features)  # the target's final hidden states
        for i, (row, n) in enumerate(zip(rows, counts)):
            row.cache.append(normed[i : i + 1, :n])

    def step(
        self,
        tokens: mx.array,
        hidden: mx.array,
        embed: Callable[[mx.array], mx.array],
        caches: list[list[KVCache]],
    ) -> mx.array:
        """The MTP layers' output (rows, n, hidden; before their final norm) at `tokens`
        (rows, n) after the hidden states `hidden` (rows, n, hidden), row i appended to its
        caches `caches[i]`."""
        h = mx.concatenate(
            [self.pre_fc_norm_embedding(embed(tokens)), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h = self.fc(h)
        if len(caches) == 1:
            for layer, cache in zip(self.layers, caches[0]):
                h = layer(h, _mask(h, cache), cache)
            return h
        with backends.building(self._row_swaps(tokens.shape[1])):
            for layer, cache in zip(self.layers, row_caches(caches)):
                h = layer(h, create_attention_mask(h, cache, return_array=True), cache)
        return h

    def _row_swaps(self, positions: int) -> list:
        """The swaps of a forward of several rows, each over its own caches (`rows.py`),
        found once per backend and kind (the lists live outside the parameter tree)."""
        found = self.__dict__.setdefault("_found_swaps", {})
        key = (backends.current(), positions > 1)
        if key not in found:
            found[key] = backends.verify_swaps(self.layers, key[0], positions, rows_attention)
        return found[key]

    def catch_up(
        self, roots: mx.array, embed: Callable[[mx.array], mx.array], rows: list[MTPRow]
    ) -> mx.array:
        """Run every row's waiting positions through the MTP layers (the token after the last
        is its root, `roots` (rows, 1)), in one forward padded to the longest. Returns each
        row's output at its last position (rows, 1, hidden; before the final norm)."""
        counts = [row.cache.waiting for row in rows]
        if min(counts) < 1:
            raise ValueError("the MTP drafter has no target features before the root")
        longest = max(counts)
        tokens, features = [], []
        for row, n, root in zip(rows, counts, roots):
            cache = row.cache
            start = cache.layers[0].offset
            after = mx.array(row.tokens[start + 1 : start + n], dtype=roots.dtype)
            pad = longest - n
            tokens.append(mx.concatenate([after, root, mx.zeros((pad,), dtype=roots.dtype)]))
            features.append(mx.pad(cache.features, [(0, 0), (0, pad), (0, 0)]))
        out = self.step(
            mx.stack(tokens),
            mx.concatenate(features),
            embed,
            [row.cache.layers for row in rows],
        )
        last = []
        for i, (row, n) in enumerate(zip(rows, counts)):
            for layer_cache in row.cache.layers:
                layer_cache.trim(longest - n)
            last.append(out[i : i + 1, n - 1 : n])
        return mx.concatenate(last)

    def _run_ahead(self, row: MTPRow, embed: Callable[[mx.array], mx.array]) -> None:
        """Run a row's waiting positions but the last `CATCH_UP_STEP` through the layers in
        chunks of that many, as a prompt is prefilled: a long prompt's first chain would
        otherwise attend over all of it at once."""
        cache = row.cache
        while cache.waiting > CATCH_UP_STEP:
            start = cache.layers[0].offset
            tokens = mx.array(row.tokens[start + 1 : start + 1 + CATCH_UP_STEP])[None]
            self.step(tokens, cache.features[:, :CATCH_UP_STEP], embed, [cache.layers])
            cache.features = cache.features[:, CATCH_UP_STEP:]
            mx.eval(cache.state)

    def chain(
        self,
        roots: mx.array,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        rows: list[MTPRow],
        steps: int,
        pick: Callable[[int, mx.array], mx.array],
    ) -> None:
        """The MTP layers over the waiting positions, then `steps` - 1 steps on their own
        output, every row in one forward per step; `pick(step, logits)` turns each step's
        logits (rows, 1, the head's columns) into the tokens (rows, 1) the next step reads.
        The steps' entries leave the caches again, and the last position waits again; where a
        pick fails, every row's cache is as it was."""
        for row in rows:
            self._run_ahead(row, embed)
        starts = [row.cache.layers[0].offset for row in rows]
        try:
            out = self.catch_up(roots, embed, rows)
            for step in range(steps):
                normed = self.norm(out)
                tokens = pick(step, lm_head(normed))
                if step + 1 < steps:
                    carried = out if self.carries_unnormed else normed
                    out = self.step(tokens, carried, embed, [row.cache.layers for row in rows])
        except Exception:  # a row's choice failed: every row's cache as it was
            for row, start in zip(rows, starts):
                for layer_cache in row.cache.layers:
                    layer_cache.trim(layer_cache.offset - start)
            raise
        for row in rows:
            for layer_cache in row.cache.layers:
                layer_cache.trim(steps)
            row.cache.features = row.cache.features[:, -1:]

    def propose(
        self,
        blocks: mx.array,
        embed: Callable[[mx.array], mx.array],
        lm_head: Callable[[mx.array], mx.array],
        rows: list[DraftChain],
    ) -> list[tuple[mx.array, mx.array | None]]:
        """Each row's chain of `length` drafts after its root (`blocks[i, 0]`; the rest of a
        block is unread) and their log-probabilities, chosen by the row's `choose` (a
        `Verifier.propose`) after its `context` and the drafts before. A row's `cache` is its
        `MTPRow`. `lm_head` gives full-vocabulary logits, as the DFlash drafter's chains read
        them: a draft vocabulary's head (`TargetAdapter.draft_head`) computes its own rows
        alone and leaves the others at -inf, so q is 0 outside it and stays exact."""
        drafted: list[list[mx.array]] = [[] for _ in rows]
        logqs: list[list[mx.array]] = [[] for _ in rows]
        contexts = [None if row.context is None else list(row.context) for row in rows]

        def pick(step: int, logits: mx.array) -> mx.array:
            for i, row in enumerate(rows):
                if step >= row.length:  # a shorter chain: its steps past the end are unread
                    drafted[i].append(drafted[i][-1])
                    continue
                token, logq = row.choose(logits[i, :1], contexts[i])
                drafted[i].append(token)
                if logq is not None:
                    logqs[i].append(logq)
                if contexts[i] is not None:
                    contexts[i].append(token.item())
            return mx.stack([d[-1] for d in drafted])

        steps = max(row.length for row in rows)
        self.chain(blocks[:, :1], embed, lm_head, [row.cache for row in rows], steps, pick)
        return [
            (mx.concatenate(d[: row.length]), mx.concatenate(q) if q else None)
            for d, q, row in zip(drafted, logqs, rows)
        ]

    def trees(
        self,
        depth: int,
        embed: Callable[[mx.array], mx.array],
        head: DraftHead,
        rows: list[DraftTree],
    ) -> list[Drafted]:
        """Each row's `budget` most likely continuations of its root, up to `depth` deep, from
        the MTP layers' top-k at each step of their greedy chain (each depth's tokens ranked
        apart, as the DFlash drafter's, by the row's `scores` of the logits if given), over
        the head's own columns (a draft vocabulary's), their ids looked up on the device."""
        logits = []

        def pick(step: int, step_logits: mx.array) -> mx.array:
            logits.append(step_logits)
            best = mx.argmax(step_logits, axis=-1)
            return best if head.ids is None else head.ids[best]

        roots = mx.stack([row.root for row in rows])
        self.chain(roots, embed, head.rows, [row.cache for row in rows], depth, pick)
        scored = mx.concatenate(logits, axis=1)
        return [rank_tree(row, scored[i], head) for i, row in enumerate(rows)]


def _mask(h: mx.array, cache: Any) -> mx.array | None:
    """The layer's attention mask over its cache (a group's first: the MLA latents)."""
    return create_attention_mask(h, getattr(cache, "caches", [cache])[0], return_array=True)


def mtp_layout(config: dict) -> tuple[str, dict]:
    """The checkpoint's model_type and text config, or a one-line ValueError naming why its
    family has no MTP layers here."""
    model_type = config.get("model_type", "")
    if model_type in REFUSED:
        raise ValueError(
            f"target model type '{model_type}' has no MTP drafter here: {REFUSED[model_type]}"
        )
    if model_type not in LAYOUTS:
        raise ValueError(
            f"target model type '{model_type}' has no MTP layers dflash-mlx can run "
            f"(MTP families: {', '.join(LAYOUTS)})"
        )
    return model_type, config.get("text_config") or config


def mtp_name(key: str, layout: Layout, num_layers: int) -> str | None:
    """A checkpoint tensor's name in `MTPDraft` (`key` without a leading "model."), or None
    for a tensor of the target or a nextn layer's copy of the target's embedding or head."""
    if not layout.nextn:
        return key.removeprefix(PREFIX) if key.startswith(PREFIX) else None
    parts = key.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    index, rest = int(parts[1]) - num_layers, parts[2]
    if index < 0 or rest.startswith(NEXTN_SHARED):
        return None
    for name, ours in NEXTN_NAMES.items():
        if rest.startswith(name + "."):
            return ours + rest.removeprefix(name) if index == 0 else None
    return f"layers.{index}.{rest}"


def read_mtp_tensors(
    path: Path, layout: Layout, num_layers: int
) -> tuple[dict[str, mx.array], mx.array | None, bool]:
    """The checkpoint's MTP tensors (named as `MTPDraft` names them, `mtp_name`), its final
    norm's weight, and whether it is in the Hugging Face layout (its norms stored
    zero-centred), told as mlx-lm's sanitize tells it: by its convolution weights' shape.
    Reads lazily: only these tensors are loaded."""
    tensors: dict[str, mx.array] = {}
    final_norm, hugging_face = None, False
    for _, weights in safetensors(path):
        for name, w in weights.items():
            key = name.removeprefix("model.")
            ours = mtp_name(key, layout, num_layers)
            if ours is not None:
                tensors[ours] = w
            elif key in FINAL_NORM_NAMES:
                final_norm = w
            elif "conv1d.weight" in key and w.shape[-1] != 1:
                hugging_face = True
    return tensors, final_norm, hugging_face


def sanitize(tensors: dict[str, mx.array], hugging_face: bool) -> dict:
    """The MTP tensors as mlx-lm's layer names them: experts stacked (one tensor per expert,
    or Qwen3.5's fused gate and up projections split) and, from a Hugging Face Qwen
    checkpoint, the zero-centred norms made whole."""
    out = dict(tensors)
    for key in [k for k in out if k.endswith(".experts.gate_up_proj")]:
        prefix = key.removesuffix(".experts.gate_up_proj")
        gate_up = out.pop(key)
        half = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :half, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., half:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    for key in [k for k in out if k.endswith(".experts.0.up_proj.weight")]:
        prefix = key.removesuffix(".experts.0.up_proj.weight")
        count = sum(k.startswith(f"{prefix}.experts.") for k in out) // 3
        for proj in ("gate_proj", "up_proj", "down_proj"):
            experts = [out.pop(f"{prefix}.experts.{e}.{proj}.weight") for e in range(count)]
            out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack(experts)
    if hugging_face:
        for key, w in out.items():
            if key.endswith(CENTRED_NORMS) or key == "norm.weight":
                out[key] = w + 1.0
    return out


def family_sanitized(layout: Layout, args: Any, tensors: dict[str, mx.array]) -> dict:
    """A nextn layer's tensors through its family's own mlx-lm `sanitize`, as one of the
    target's layers: experts stacked, and DeepSeek's fp8 and int4 tensors read and its MLA
    projection split as mlx-lm does for the target (the sanitize reads only `args`)."""
    family = importlib.import_module(f"mlx_lm.models.{layout.module}").Model
    named = {f"model.{k}" if k.startswith("layers.") else k: v for k, v in tensors.items()}
    out = family.sanitize(SimpleNamespace(args=args), named)
    return {k.removeprefix("model."): v for k, v in out.items()}


def mtp_args(model_type: str, text_config: dict) -> Any:
    """mlx-lm's args of the target's layers, from its (text) config."""
    layout = LAYOUTS[model_type]
    module = importlib.import_module(f"mlx_lm.models.{layout.module}")
    return getattr(module, layout.args).from_dict({"model_type": model_type, **text_config})


def _fields(args: Any) -> set[str]:
    return {f.name for f in fields(args)}


def missing(model_type: str) -> str:
    """Why a checkpoint of this family lacks MTP tensors, in words."""
    if LAYOUTS[model_type].published:
        return (
            "mlx-lm's conversion drops them; use the original checkpoint (or one converted "
            "with them)"
        )
    return f"no published {model_type} checkpoint has one; `dflash-mlx train fit --arch mtp` does"


def _read(path: Path) -> tuple[str, dict, int, dict[str, mx.array], mx.array | None, bool]:
    """The checkpoint's model type, config, MTP layer count, and `read_mtp_tensors`."""
    config = read_config(path)
    model_type, text = mtp_layout(config)
    layout = LAYOUTS[model_type]
    num_layers = int(text.get(layout.count, 1) or 0)
    target_layers = int(text.get("num_hidden_layers", 0))
    return model_type, config, num_layers, *read_mtp_tensors(path, layout, target_layers)


def describe_mtp(path_or_repo: str | Path) -> str:
    """Whether the target checkpoint carries MTP layers dflash-mlx can draft with, in words."""
    path = resolve_path(path_or_repo, "target model", ["*.json", "*.safetensors"])
    try:
        model_type, config, num_layers, tensors, _, _ = _read(path)
    except ValueError as exc:
        return f"no: {exc}"
    if not tensors or not num_layers:
        return f"no: no MTP tensors in this {model_type} checkpoint ({missing(model_type)})"
    stored = "quantized" if any(k.endswith(".scales") for k in tensors) else "unquantized"
    vocab = config.get(VOCAB_KEY)
    drafts = "" if vocab is None else f", drafting {len(set(vocab))} of the vocabulary's tokens"
    return f"yes: {num_layers} MTP layer(s), {stored} ({model_type}; --draft mtp){drafts}"


def load_mtp(
    path_or_repo: str | Path,
    dtype: mx.Dtype | None = None,
    bits: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    full_vocab: bool = False,
) -> MTPDraft:
    """The MTP layers of the target checkpoint at `path_or_repo`, as a drafter.

    `dtype` defaults to float32 on the CPU and to the checkpoint's dtype on a GPU (MTP layers
    stored quantized stay so there); `bits` quantizes them (group size 64) after that, for
    targets whose MTP layers are worth the loss (quantized MTP layers may be accepted less).
    They draft over the checkpoint's draft vocabulary (`VOCAB_KEY`) if it lists one, unless
    `full_vocab`. Refused in one line for a family without MTP layers or a checkpoint that
    lacks them.
    """
    path = resolve_path(path_or_repo, "target model", ["*.json", "*.safetensors"])
    model_type, config, num_layers, tensors, final_norm, hugging_face = _read(path)
    if not tensors or not num_layers:
        raise ValueError(f"the checkpoint at {path} has no MTP tensors: {missing(model_type)}")
    if final_norm is None:
        raise ValueError(f"the checkpoint at {path} has no final norm weight (model.norm.weight)")
    args = mtp_args(model_type, config.get("text_config") or config)
    vocab = None if full_vocab else config.get(VOCAB_KEY)
    if vocab is not None:
        vocab = draft_vocabulary(vocab, args.vocab_size, f"{path / 'config.json'}: {VOCAB_KEY}")
    mtp = MTPConfig.for_target(
        model_type,
        args,
        num_hidden_layers=num_layers,
        block_size=block_size,
        quantization=config.get("quantization") if any(".scales" in k for k in tensors) else None,
        draft_vocab=vocab,
    )
    model = MTPDraft(mtp, args)
    if LAYOUTS[model_type].nextn:
        tensors = family_sanitized(LAYOUTS[model_type], args, tensors)
    weights = sanitize(tensors, hugging_face)
    weights["target_norm.weight"] = final_norm + 1.0 if hugging_face else final_norm
    load_checked(model, weights, mtp.quantization, f"the MTP tensors in {path}")
    cast_model(model, dtype if dtype is not None else default_dtype())
    if bits is not None:
        nn.quantize(model, group_size=64, bits=bits, class_predicate=_quantizable)
        mtp.quantization = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    model.eval()
    return model


def _quantizable(name: str, module: nn.Module) -> bool:
    """What `--mtp-bits` quantizes: the MTP layers' linear layers (not the MoE routers, which
    mlx-lm keeps at 8 bits, nor the norms)."""
    return (
        hasattr(module, "to_quantized")
        and not name.endswith(("mlp.gate", "shared_expert_gate"))
        and module.weight.shape[-1] % 64 == 0
    )
