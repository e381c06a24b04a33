"""The target side: loading an mlx-lm model and adapting it for speculative decoding.

`TargetAdapter` finds the layer list, embedding and LM head of an mlx-lm model
(also inside multimodal wrappers), makes and rolls back the target's caches
(the cache kinds a trim cannot roll back get the caches of `rollback.py`), runs its
forwards (one or several rows, chains or trees) with the backend's swaps (`backends.py`)
and the per-forward hooks that record hidden states and make tree rows (`hooks.py`). Families
share this one mechanism and differ only in data (`SCALED_EMBEDDINGS`,
`NORMALISED_EMBEDDINGS`, `TREE_REFUSALS`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from threading import Lock
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, wired_limit
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.models.deepseek_v41 import LayerCache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from ..native import few_rows_quantized
from ..native.kernels import cuda as cuda_kernels
from ..native.kernels import metal_quantized
from ..native.swaps import Swap
from . import backends, hooks, rows
from .loading import cast_model, default_cast, load_dtype, read_config, resolve_path
from .rollback import (
    CacheGroup,
    ChunkCache,
    CompressedWindowCache,
    QuantizingKVCache,
    RecurrentCache,
    WindowKVCache,
    cache_parts,
    forward_limit,
    stepwise,
)

TARGET_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def rope_overrides(config: dict) -> dict:
    """Lift a transformers-5 nested `rope_parameters.rope_theta` to the top level.

    mlx-lm's llama reads only a top-level `rope_theta` and otherwise silently
    runs with θ=10,000 (measured on SmolLM2: logits off by 5.0).
    """
    rope = config.get("rope_parameters") or {}
    overrides = {}
    if "rope_theta" not in config and "rope_theta" in rope:
        overrides["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = rope
    return overrides


def load(
    path_or_repo: str | Path,
    dtype: mx.Dtype | str | None = None,
    tensor_group: mx.distributed.Group | None = None,
    pipeline_group: mx.distributed.Group | None = None,
    trust_remote_code: bool = False,
    adapter_path: str | Path | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm target and its tokenizer (local dir or hub id).

    `adapter_path` (a directory with `adapter_config.json` and `adapters.safetensors`, as
    mlx-lm's LoRA trainer writes them) applies fine-tuned adapters with mlx-lm's own
    `load_adapters`, as `mlx_lm.load(..., adapter_path=)` does.

    `dtype` defaults to float32 on the CPU (quantized weights are dequantized:
    quantized and bf16 matmuls are not BLAS-accelerated there), unless the dequantized
    weights would take over half of the machine's memory (then as `"checkpoint"`), and to the
    checkpoint's dtype on a GPU (Metal or CUDA); `dtype="checkpoint"` keeps the
    checkpoint's dtype and quantization anywhere. Extra keyword arguments go to `mlx_lm.load`.
    `tensor_group` (as in mlx-lm's `sharded_load`) shards the target over the
    group with the model's own `shard()`: each rank keeps its slice of the
    weights and runs every forward together with the others. `pipeline_group`
    instead splits the layers over the group with the model's own `pipeline()`
    (rank 0 keeps the last ones); only the world group is supported, as in mlx-lm.
    `trust_remote_code` lets the checkpoint's own tokenizer (and model) code run, as
    mlx-lm's `--trust-remote-code` does (Kimi's tokenizer needs it).
    """
    if tensor_group is not None and pipeline_group is not None:
        raise ValueError("shard the target over a tensor group or a pipeline group, not both")
    group = tensor_group or pipeline_group
    cast_to = load_dtype(dtype)
    path = resolve_path(path_or_repo, "target model", TARGET_PATTERNS)
    model_config = {**rope_overrides(read_config(path)), **kwargs.pop("model_config", {})}
    sharded = group is not None and group.size() > 1
    # always said, so that transformers refuses remote code rather than asking on stdin
    tokenizer_config = {
        **kwargs.pop("tokenizer_config", {}),
        "trust_remote_code": trust_remote_code,
    }
    try:
        model, tokenizer = mlx_lm_load(
            str(path),
            tokenizer_config=tokenizer_config,
            model_config=model_config,
            lazy=sharded,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code=True" not in str(exc):
            raise
        raise ValueError(
            f"the target at {path} comes with its own tokenizer or model code: pass "
            "--trust-remote-code (trust_remote_code=True) if you trust it"
        ) from exc
    except FileNotFoundError:
        raise
    except Exception as exc:  # the cause stays chained for callers and tracebacks
        raise ValueError(
            f"mlx-lm could not load the target at {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if not mx.metal.is_available() and runs_metal_kernels(model):
        raise ValueError(
            f"target model type '{getattr(model, 'model_type', '?')}' runs mlx-lm's fused Metal "
            "kernels (mlx_lm.kernels), which have no CPU or CUDA version: it needs Apple silicon, "
            "as in mlx-lm"
        )
    if adapter_path is not None:
        apply_adapters(model, Path(adapter_path).expanduser())
    cast_model(model, default_cast(model, cast_to) if dtype is None else cast_to)
    if sharded:
        (shard if tensor_group is not None else pipeline)(model, group)
    mx.eval(model.parameters())
    if sharded:  # every rank has its slice before any of them starts a forward
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return model, tokenizer


def runs_metal_kernels(model: nn.Module) -> bool:
    """Whether mlx-lm's module of `model` calls `mlx_lm.kernels` (muse_spark), Metal-only:
    elsewhere its first forward would fail with MLX's "No Metal back-end"."""
    module = sys.modules.get(type(model).__module__)
    names = vars(module).values() if module is not None else ()
    return any(getattr(v, "__module__", "").startswith("mlx_lm.kernels") for v in names)


def apply_adapters(model: nn.Module, adapter_path: Path) -> None:
    """Apply the fine-tuned adapters at `adapter_path` to `model` with mlx-lm's
    `load_adapters`, or say in one line which file is missing or does not fit."""
    from mlx_lm.tuner.utils import load_adapters  # imports the trainer's optimizers: 0.2 s

    if not adapter_path.is_dir():
        raise FileNotFoundError(f"adapter directory not found: {adapter_path}")
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (adapter_path / name).is_file():
            raise FileNotFoundError(f"no {name} in the adapter directory {adapter_path}")
    try:
        load_adapters(model, str(adapter_path))
    except (KeyError, ValueError, TypeError) as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(f"the adapters at {adapter_path} do not fit the target: {detail}") from exc
    model.eval()


def shard(model: nn.Module, group: mx.distributed.Group) -> None:
    """Tensor-parallel `model` over `group` with mlx-lm's `shard()`, or say why it cannot be."""
    model_type = getattr(model, "model_type", type(model).__name__)
    if not hasattr(model, "shard"):
        raise ValueError(f"mlx-lm has no tensor parallelism for model type '{model_type}'")
    try:
        model.shard(group)
    except (AssertionError, ValueError) as exc:
        raise ValueError(
            f"cannot shard model type '{model_type}' over {group.size()} ranks: {exc}"
        ) from None


def pipeline(model: nn.Module, group: mx.distributed.Group) -> None:
    """Pipeline-parallel `model` over `group` with mlx-lm's `pipeline()`, or say why not."""
    model_type = getattr(model, "model_type", type(model).__name__)
    _, backbone = _find_backbone(model)
    if not hasattr(backbone, "pipeline"):
        raise ValueError(
            f"mlx-lm has no pipeline parallelism for model type '{model_type}'; "
            "shard it tensor parallel instead (without --pipeline)"
        )
    try:
        backbone.pipeline(group)
    except ValueError as exc:
        raise ValueError(
            f"cannot pipeline model type '{model_type}' over {group.size()} ranks: {exc}"
        ) from None


# mlx-lm model modules (the model_type a checkpoint loads into, after mlx-lm's remapping such as
# minimax_m2 -> minimax) proven lossless on tiny random configs (tests/test_families.py).
SUPPORTED_MODEL_TYPES = (
    "deepseek_v41",
    "gemma4",
    "gemma4_text",
    "glm_moe_dsa",
    "gpt_oss",
    "kimi_k25",
    "kimi_k3",
    "laguna",
    "lfm2",
    "lfm2_moe",
    "llama",
    "llama4",
    "minimax",
    "minimax_m3_vl",
    "muse_glimmer",
    "muse_spark",
    "nemotron_h",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_next",
)
# Backbones that multiply the embeddings by `embed_scale`; transformers folds it into
# `embed_tokens`, which is what the published drafters were trained on.
SCALED_EMBEDDINGS = ("gemma4", "gemma4_text")
# What backbones call their token embedding (nemotron_h: `embeddings`) and their last norm.
EMBEDDINGS = ("embed_tokens", "embeddings")
FINAL_NORMS = ("norm", "norm_f", "embedding_norm")
# Backbones that RMS-normalise the embeddings (no weight) before the first layer; the drafter
# embeds its block as that layer sees it.
NORMALISED_EMBEDDINGS = ("muse_glimmer", "muse_spark")
# Why a family's (or a cache kind's) attention cannot verify a tree: it does not take the
# tree's positions and mask through the cache and RoPE modules `hooks.hooked` swaps, or it
# selects keys (`sparse_attention.py`), where a tree forward's rounding picks other keys than
# decoding's (greedy output parted from mlx-lm's at 43 tokens on a tiny random glm_moe_dsa).
_SELECTING = "its sparse indexer's top-k selection is computed as decoding does for chains only"
TREE_REFUSALS = {
    RecurrentCache: "its recurrent layers cannot keep just the accepted path of a tree",
    ChunkCache: "its chunked attention builds its mask from positions, not from the cache",
    CompressedWindowCache: "its compressed sparse attention picks its keys from positions, "
    "not through the cache's mask",
    "minimax_m3_vl": "its block-sparse indexer groups keys by cache slot, and a tree's nodes "
    "do not sit in their path's slots",
    "muse_spark": "its attention rotates queries and keys in a fused kernel at the cache's "
    "offset, not through its rope module",
    "deepseek_v32": _SELECTING,
    "glm_moe_dsa": _SELECTING,
}
# Submodules (by name) that extend their layer's cache by what a trim cannot drop: hooked to
# checkpoint the cache, so that a rollback re-runs them on the kept positions.
CHECKPOINTED_MODULES = ("compressor",)
SUPPORTED = (
    f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}; "
    "other models whose layers all use a plain KVCache are expected to work."
)


def _find_backbone(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(owner, backbone): the module with a token embedding (`EMBEDDINGS`) and `layers` and
    the one holding it.

    The owner holds the LM head and the text config, also inside multimodal
    wrappers (`model.language_model.model`).
    """
    for owner_path, name in (
        ("language_model", "model"),
        ("", "model"),
        ("model", "language_model"),
        ("", "backbone"),
        ("", ""),
    ):
        owner: Any = model
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part, None) if isinstance(owner, nn.Module) else None
        backbone = getattr(owner, name, None) if name and isinstance(owner, nn.Module) else owner
        if isinstance(backbone, nn.Module) and "layers" in backbone:
            if any(embedding in backbone for embedding in EMBEDDINGS):
                return owner, backbone
    raise ValueError(
        f"cannot find the embedding and layer list of model type "
        f"'{getattr(model, 'model_type', type(model).__name__)}'. {SUPPORTED}"
    )


class FullHead:
    """A head over the whole vocabulary, as `draft.DraftHead`: its rows are every token."""

    token_ids = ids = None

    def __init__(self, logits: Callable[[mx.array], mx.array]):
        self.rows = self.logits = logits

    def __call__(self, x: mx.array) -> mx.array:
        return self.logits(x)


class RestrictedHead:
    """`head` (an LM head or a tied embedding) over the rows `token_ids` only.

    The rows are sliced once, so the matmul costs len(token_ids) / vocab of the
    full head's. Called, it scatters the logits back into full-vocabulary rows
    of -inf (on a CPU much cheaper than a gather through an inverse index):
    the sampling code sees ordinary logits, and tokens outside get
    probability 0, which keeps speculative sampling exact. `rows` gives the
    logits of `token_ids` alone, for code that only ranks them (a draft tree's
    top-k over 8k columns instead of 49k).
    """

    def __init__(self, head: nn.Module, token_ids: list[int]):
        self.quantized = isinstance(head, nn.QuantizedLinear | nn.QuantizedEmbedding)
        if not self.quantized and not isinstance(head, nn.Linear | nn.Embedding):
            raise ValueError(
                f"cannot restrict an LM head of type {type(head).__name__} to a draft vocabulary; "
                "load the drafter with full_vocab=True"
            )
        self.vocab = head.weight.shape[0]
        if not token_ids or not 0 <= min(token_ids) <= max(token_ids) < self.vocab:
            raise ValueError(f"draft vocabulary ids must be non-empty and in [0, {self.vocab})")
        self.head, self.token_ids = head, np.array(token_ids, dtype=np.int32)
        self.ids = mx.array(self.token_ids)
        self.weights = {n: w[self.ids] for n, w in head.items() if isinstance(w, mx.array)}
        mx.eval(self.weights)
        backend = backends.current()  # the drafter's block: 2-16 rows
        self.few_rows = backend == "cuda"
        self.metal_rows = backend == "metal" and metal_quantized.few_rows_class(head) is not None

    def rows(self, x: mx.array) -> mx.array:
        """Logits (..., len(token_ids)): column j is token `token_ids[j]`."""
        w = self.weights
        if self.quantized and self.metal_rows:
            h = self.head
            out = metal_quantized.quantized_product(x, w, h.group_size, h.bits, h.mode)
        elif self.quantized:  # MLX's product, or on the CPU over 2+ rows the few-row one
            out = few_rows_quantized.quantized_matmul(x, self.head, w)
        elif self.few_rows:
            out = cuda_kernels.times_transposed(x, w["weight"])
        else:
            out = x @ w["weight"].T
        return out + w["bias"] if "bias" in w else out

    def __call__(self, x: mx.array) -> mx.array:
        sub = self.rows(x)
        full = mx.full((*sub.shape[:-1], self.vocab), -mx.inf, dtype=sub.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self.ids, sub.shape), sub, axis=-1)


SHARDED_HEADS = (AllToShardedLinear, QuantizedAllToShardedLinear)


def _gathered_logits(head: nn.Module, x: mx.array) -> mx.array:
    """The full-vocabulary logits of a vocabulary-sharded LM head, on every rank."""
    return gather_last_axis(head(x), head.group)


@dataclass
class TreeShape:
    """One row's tree in a verify forward: node i sits at the row cache's offset + depths[i]
    and sees the committed cache and the nodes visible[i] (itself and its ancestors)."""

    depths: mx.array | list[int]
    visible: mx.array  # (n, n) bool


@dataclass
class Forward:
    """A target forward's logits (R, N, vocab) and the features (R, N, len(taps) x hidden)
    of its tapped layers (`hooks.feature`), concatenated in the order of the taps (None
    without taps): unevaluated arrays of the forward's graph."""

    logits: mx.array
    features: mx.array | None


_GENERATING: set[int] = set()  # ids of the models a generation holds (`generating`)
_CLAIMING = Lock()


class TargetAdapter:
    """What the speculative loop needs from an mlx-lm model; families differ only in data."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.model_type = getattr(model, "model_type", type(model).__name__)
        self.family = type(model).__module__.rpartition(".")[2]
        owner, backbone = _find_backbone(model)
        self.layers = backbone.layers
        self.backbone, self.layer_offset, self.pipelined = backbone, 0, False
        if getattr(backbone, "pipeline_size", 1) > 1:  # this rank holds layers [start, end)
            total = owner.args.num_hidden_layers
            self.layers = [*backbone.layers, *[None] * (total - len(backbone.layers))]
            self.layer_offset, self.pipelined = backbone.start_idx, True
        self.embedding = next(backbone[name] for name in EMBEDDINGS if name in backbone)
        self.embed_scale = backbone.embed_scale if self.family in SCALED_EMBEDDINGS else None
        self.embed_norm_eps = _embed_eps(backbone) if self.family in NORMALISED_EMBEDDINGS else None
        # muse_spark's head sits beside its wrapper (model.lm_head, backbone model.model.*)
        head_owner = next((m for m in (owner, model) if "lm_head" in m), None)
        self.head = self.embedding if head_owner is None else head_owner.lm_head
        self.lm_head = self.embedding.as_linear if head_owner is None else self.head
        if isinstance(self.head, SHARDED_HEADS):  # each rank holds a slice of the vocabulary
            self.lm_head = partial(_gathered_logits, self.head)
        args = getattr(owner, "args", None)
        self.max_context = getattr(args, "max_position_embeddings", None)
        self._verify_swaps: dict[tuple, list[Swap]] = {}

    def forward(
        self,
        tokens: mx.array,
        caches: list[list[Any]] | None,
        trees: list[TreeShape | None] | None = None,
        taps: list[int] | None = None,
        prompt: bool = False,
        embeddings: mx.array | None = None,
    ) -> Forward:
        """The target's logits at `tokens` (R, N), row i appended to `caches[i]` and attending
        to that cache alone, and the features of the tapped layers `taps` at every position.

        A row whose tree is None (or `trees` None) holds N consecutive positions (a chain); a
        row with a `TreeShape` of N nodes is a tree. Each position sees the keys its own
        one-position step would (`rollback.stepwise`). On the CPU norms and RoPEs run
        compiled, and over several positions SwiGLUs and attention take their exps from
        `cpu_math`; on MLX's CUDA backend attention takes the verify kernel over several
        positions (`backends.py`). R > 1 needs caches that can share a forward
        (`rows.batchable`): projections run over all rows, attention row by row, recurrent
        layers over the rows' states stacked (`rows.py`).
        A `prompt` chunk (R = 1) is computed as mlx-lm computes one (its kernels, its masks);
        so are rows without caches (`caches` None: independent sequences from position 0).
        The modules of `checkpointed` checkpoint their caches for `rollback` on every forward.
        `embeddings` (1, N, hidden) are a prompt chunk's input rows in place of its tokens'
        embeddings (mlx-lm's `input_embeddings`: the rows a model's `embed_inputs` made of
        its images).
        """
        n_rows, n = tokens.shape
        trees = trees if trees is not None and any(trees) else None
        if caches is None or n_rows == 1:
            cache = None if caches is None else caches[0]
            attention = None
        elif all(rows.batchable(c) for c in caches):
            cache, attention = rows.row_caches(caches), rows.attention
        else:
            raise ValueError(
                "only targets whose caches are all plain KV or recurrent caches batch replies"
            )
        plain = caches is None or (prompt and attention is None)  # mlx-lm's own forward
        swaps = [] if plain else self.verify_swaps(n, attention, trees is not None)
        recorded = self._recorded(taps or [])
        checkpointed = self.checkpointed if caches is not None else []
        tree_rows, positions = [], None
        if trees is not None:
            tree_rows, positions = self._tree_rows(caches, trees, n)
        inputs = {} if embeddings is None else {"input_embeddings": embeddings}
        if not (swaps or recorded or checkpointed or tree_rows):
            return Forward(self.model(tokens, cache=cache, **inputs), None)
        # graph building only: the classes are back before anything runs
        with ExitStack() as building:
            if cache is not None and not prompt and attention is None:
                building.enter_context(stepwise(cache))
            building.enter_context(hooks.HOOKING)
            building.enter_context(backends.building(swaps))
            forward = building.enter_context(
                hooks.hooked(
                    recorded, checkpointed, tree_rows, self.ropes, positions, self.model_type
                )
            )
            logits = self.model(tokens, cache=cache, **inputs)
        return Forward(logits, hooks.features(forward.outputs, taps) if taps else None)

    def _recorded(self, taps: list[int]) -> list[tuple[Any, nn.Module]]:
        """The modules a forward with `taps` records, by key: the tapped layers this rank
        holds and, when the layers are split over pipeline ranks, the backbone, whose output
        comes after the forward's collectives (`hooks.features`)."""
        recorded: list[tuple[Any, nn.Module]] = [
            (i, self.layers[i]) for i in taps if self.layers[i] is not None
        ]
        if taps and self.pipelined:
            recorded.append((hooks.PIPELINE_OUTPUT, self.backbone))
        return recorded

    def _tree_rows(
        self, caches: list[list[Any]], trees: list[TreeShape | None], n: int
    ) -> tuple[list[tuple[list[Any], hooks.TreeForward]], mx.array]:
        """Each tree row's caches and `TreeForward`, and every row's positions, flat: a chain
        row's are consecutive after its cache's offset."""
        tree_rows, positions = [], []
        for cache, tree in zip(caches, trees):
            offset = cache[0].offset
            if tree is None:
                positions.append(offset + mx.arange(n))
                continue
            forward = hooks.TreeForward(offset + mx.array(tree.depths), tree.visible)
            tree_rows.append((cache, forward))
            positions.append(forward.positions)
        return tree_rows, positions[0] if len(positions) == 1 else mx.concatenate(positions)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the model for one generation: its weights wired, as mlx-lm's decoding keeps
        them, and a second generation on the same model refused (RuntimeError) meanwhile,
        since both would checkpoint and roll back through the same modules."""
        with _CLAIMING:
            if id(self.model) in _GENERATING:
                raise RuntimeError(
                    "this model is already being generated with (in another thread or another "
                    "open generator); run one generation per model at a time"
                )
            _GENERATING.add(id(self.model))
        try:
            with wired_limit(self.model):
                yield
        finally:
            with _CLAIMING:
                _GENERATING.discard(id(self.model))

    def verify_swaps(
        self, positions: int, attention: Callable | None = None, tree: bool = False
    ) -> list[Swap]:
        """The class swaps of a forward over `positions` on this backend
        (`backends.verify_swaps`, with `attention` for batched forwards; for a forward with
        tree rows, the RoPEs' tree classes too: `hooks.tree_swaps`), found once per backend
        and kind of forward."""
        backend = backends.current()
        key = (backend, positions > 1, attention, tree)
        if key not in self._verify_swaps:
            norms = [self.backbone.get(name) for name in FINAL_NORMS]
            modules = [*self.layers, *[n for n in norms if isinstance(n, nn.Module)], self.head]
            swaps = backends.verify_swaps(modules, backend, positions, attention)
            self._verify_swaps[key] = hooks.tree_swaps(swaps, self.ropes) if tree else swaps
        return self._verify_swaps[key]

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        """What the target's first layer sees for `tokens` (the drafter embeds its block so)."""
        h = self.embedding(tokens)
        if self.embed_norm_eps is not None:
            h = mx.fast.rms_norm(h, None, self.embed_norm_eps)
        return h if self.embed_scale is None else h * self.embed_scale

    def draft_head(self, token_ids: list[int] | None) -> FullHead | RestrictedHead:
        """The head the drafter proposes through (`draft.DraftHead`): the LM head, restricted
        to `token_ids` if given. Build it once per generation: the restriction slices the
        weights."""
        if token_ids is None:  # the drafter's block (2-16 rows) takes a few-rows product
            few_rows = backends.FEW_ROWS_HEAD.get(backends.current())
            return FullHead((few_rows and few_rows(self.head)) or self.lm_head)
        if isinstance(self.head, SHARDED_HEADS):  # no rank holds all the rows: mask instead
            outside = mx.full((self.vocab_size,), -mx.inf)
            outside[mx.array(token_ids)] = 0.0
            return FullHead(lambda x: self.lm_head(x) + outside)
        return RestrictedHead(self.head, token_ids)

    @property
    def hidden_size(self) -> int:
        embed = self.embedding
        if isinstance(embed, nn.QuantizedEmbedding):
            return embed.scales.shape[-1] * embed.group_size
        return embed.weight.shape[-1]

    @property
    def vocab_size(self) -> int:
        return self.embedding.weight.shape[0]

    def make_cache(
        self,
        max_kv_size: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    ) -> list[Any]:
        """mlx-lm's caches for the model, with the ones a trim cannot roll back replaced.

        The options mean what they mean to mlx-lm's `generate_step`: `max_kv_size` makes
        mlx-lm's `make_prompt_cache` give a model without caches of its own rotating caches
        (keeping the first 4 positions, `WindowKVCache`s here); with `kv_bits` every plain
        KV cache is quantized once it holds `quantized_kv_start` positions
        (`QuantizingKVCache`). mlx-lm cannot quantize rotating caches: neither is done here.
        """
        caches = [self._rollbackable(c) for c in make_prompt_cache(self.model, max_kv_size)]
        if kv_bits is None:
            return caches
        if any(isinstance(c, WindowKVCache) for c in cache_parts(caches)):
            raise ValueError(
                f"kv_bits cannot quantize the rotating KV caches of target model type "
                f"'{self.model_type}' (sliding-window layers or max_kv_size), nor can mlx-lm: "
                "leave out kv_bits or max_kv_size"
            )
        quantizing = partial(QuantizingKVCache, kv_group_size, kv_bits, quantized_kv_start)
        return [quantizing() if type(c) is KVCache else c for c in caches]

    def _rollbackable(self, cache: Any) -> Any:
        if type(cache) is KVCache:
            return cache
        if type(cache) is RotatingKVCache and cache.keep:  # max_kv_size's
            if cache.max_size <= cache.keep:
                raise ValueError(
                    f"max_kv_size must be more than {cache.keep}: mlx-lm's rotating cache "
                    f"keeps the first {cache.keep} positions besides its window"
                )
            return WindowKVCache(cache.max_size - cache.keep, cache.keep)
        if self.family in SUPPORTED_MODEL_TYPES:
            if type(cache) is RotatingKVCache and cache.keep == 0:
                return WindowKVCache(cache.max_size)
            if type(cache) is ArraysCache:
                return RecurrentCache(len(cache.cache))
            if type(cache) is ChunkedKVCache:
                return ChunkCache(cache.chunk_size)
            if type(cache) is CacheList:
                return CacheGroup(*map(self._rollbackable, cache.caches))
            if type(cache) is LayerCache:
                return CompressedWindowCache(cache.window_size)
        raise ValueError(
            f"target model type '{self.model_type}' is not supported: its "
            f"{type(cache).__name__} cannot be rolled back after a rejected draft. {SUPPORTED}"
        )

    @staticmethod
    def forward_limit(cache: list[Any], positions: int) -> int:
        """`positions`, or fewer where the caches need the next forward to stop short
        (`rollback.forward_limit`: a quantizing cache's switch)."""
        limit = forward_limit(cache)
        return positions if limit is None else min(positions, limit)

    @staticmethod
    def rollback(cache: list[Any], num_tokens: int) -> None:
        """Drop the last `num_tokens` positions (the rejected part of a verified block).

        Called after every verify, also with 0: that ends the recurrent checkpoints.
        """
        for c in cache:
            c.trim(num_tokens)

    @cached_property
    def ropes(self) -> list[nn.Module]:
        """The rotary embedding modules of the attention layers (each once)."""
        found = {}
        for layer in filter(None, self.layers):
            for name, module in layer.named_modules():
                if name.rpartition(".")[2] == "rope":
                    found[id(module)] = module
        return list(found.values())

    def check_tree(self, cache: list[Any]) -> None:
        """Raise a one-line ValueError when this model's caches or attention cannot verify trees."""
        other = next(
            (c for c in cache_parts(cache) if not isinstance(c, KVCache | WindowKVCache)), None
        )
        reason = TREE_REFUSALS.get(self.family)
        if other is not None:
            reason = TREE_REFUSALS.get(
                type(other),
                f"its {type(other).__name__} layers cannot keep just the accepted path of a tree",
            )
        elif not self.ropes:
            reason = "its attention has no `rope` module to give tree nodes their positions"
        if reason:
            raise ValueError(
                f"tree verification does not support target model type '{self.model_type}': "
                f"{reason}; use the chain (no --tree-budget)"
            )

    @cached_property
    def checkpointed(self) -> list[nn.Module]:
        """The modules a rollback re-runs: the mixers given a recurrent cache
        (`recurrent_mixers`) and the `CHECKPOINTED_MODULES` inside layers."""
        found = list(self.recurrent_mixers)
        for layer in filter(None, self.layers):
            for name, module in layer.named_modules():
                if name.rpartition(".")[2] in CHECKPOINTED_MODULES:
                    found.append(module)
        return found

    @cached_property
    def recurrent_mixers(self) -> list[nn.Module]:
        """The modules each recurrent cache is passed to (a layer's GatedDeltaNet, short
        convolution or Mamba mixer), in cache order.

        Caches belong to layers in order; where there are fewer caches than layers
        (nemotron_h: none for its MLP and MoE layers), to the layers that have a mixer.
        """
        caches = make_prompt_cache(self.model)
        if not any(isinstance(c, ArraysCache) for c in caches):
            return []  # (gemma4's last layers share caches: fewer caches than layers)
        layers = [layer for layer in self.layers if layer is not None]  # this rank's
        if len(caches) != len(layers):
            layers = [layer for layer in layers if _mixer(layer) is not None]
        mixers = [_mixer(layer) for layer, c in zip(layers, caches) if isinstance(c, ArraysCache)]
        if len(caches) != len(layers) or None in mixers:
            raise ValueError(
                f"target model type '{self.model_type}' is not supported: cannot tell which "
                f"module of its layers each of its {len(caches)} caches is passed to. {SUPPORTED}"
            )
        return mixers


def _embed_eps(backbone: nn.Module) -> float:
    """The epsilon of a backbone's weightless embedding norm (muse_spark's is its RMS norms')."""
    return getattr(backbone, "embed_eps", None) or backbone.args.rms_norm_eps


def _mixer(layer: nn.Module) -> nn.Module | None:
    """The child of `layer` that takes its cache (attention, convolution, SSM), if one does."""
    takers = [
        m
        for m in layer.values()
        if isinstance(m, nn.Module) and "cache" in inspect.signature(type(m).__call__).parameters
    ]
    return takers[0] if len(takers) == 1 else None
