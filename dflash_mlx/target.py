"""The target side: loading an mlx-lm model and adapting it for speculative decoding.

`TargetAdapter` finds the layer list, embedding and LM head of an mlx-lm model
(also inside multimodal wrappers), captures the hidden states of chosen layers
lazily (the layer outputs are kept as unevaluated arrays of the same graph, so
capturing costs no extra evaluation), and makes and rolls back the target's
caches: sliding-window and recurrent layers get the caches of `rollback.py`.
Families share this one mechanism and differ only in data (`SCALED_EMBEDDINGS`).

Hooks work per instance: each tapped or recurrent layer object gets a subclass
of its own class whose `__call__` records the output and checkpoints the
recurrent cache, and gets its class back when the capture ends. No mlx-lm class
is modified, so other models see mlx-lm unchanged. A model is captured by one
generation at a time (a second is refused); forwards through caches other than
the capture's (mlx-lm's own decoding of the same model) are not recorded.
A tree forward (`tree_attention`) swaps the classes of the caches and RoPE
modules the same way, for that one forward.

In the verify forward (`TargetAdapter.forward` over several positions, on the
CPU) the modules whose `__call__` calls mlx-lm's `swiglu` or
`scaled_dot_product_attention` (MLPs, MoE activations, attention) get, while its
graph is built, a subclass whose `__call__` is their own code reading those two
names from a copy of its globals that binds `cpu_math`'s, and their class back
right after: MLX's CPU `exp` is scalar, and over 16 positions and a long context
the SwiGLUs' and softmaxes' exps are a large part of the forward ("cpu_math" in
benchmarks/README.md). On the CPU the RMSNorm and RoPE modules (MLX's and mlx-lm's
plain ones) also change class for every forward through `forward`, one position
included, to run `cpu_math`'s compiled RMSNorm and RoPE: mlx-lm's bits from fewer
ops (a SmolLM2 forward at one position: 2,158 against 4,071; "Compiled norms and
RoPE" in benchmarks/README.md). On MLX's CUDA backend the same rebinding gives the
attention modules the verify-attention kernel (`kernels/cuda.py`): MLX sends 4 or
more bf16/fp16 queries to cuDNN, whose graphs are cached by shape while every cycle
has more keys than the last; side by side on an H100 a cycle through the kernel
cost 0.71-0.74x one through cuDNN ("Verify forward on an H100" in
benchmarks/README.md). There the blocks' plain linear layers and the LM head also
change class for the verify forward, to take the few-rows kernel
(`kernels/cuda.py`) in place of cuBLAS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from threading import Lock
from types import FunctionType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import gather_last_axis, scaled_dot_product_attention
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    _BaseCache,
    make_prompt_cache,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

from . import cpu_math
from .kernels import cuda as cuda_kernels
from .loading import cast_model, default_dtype, read_config, resolve_path
from .rollback import RecurrentCache, WindowKVCache
from .swaps import Swap, swapped

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
    dtype: mx.Dtype | None = None,
    tensor_group: mx.distributed.Group | None = None,
    pipeline_group: mx.distributed.Group | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load an mlx-lm target and its tokenizer (local dir or hub id).

    `dtype` defaults to float32 on the CPU (quantized weights are dequantized:
    quantized and bf16 matmuls are not BLAS-accelerated there) and to the
    checkpoint's dtype on a GPU (Metal or CUDA). Extra keyword arguments go to `mlx_lm.load`.
    `tensor_group` (as in mlx-lm's `sharded_load`) shards the target over the
    group with the model's own `shard()`: each rank keeps its slice of the
    weights and runs every forward together with the others. `pipeline_group`
    instead splits the layers over the group with the model's own `pipeline()`
    (rank 0 keeps the last ones); only the world group is supported, as in mlx-lm.
    """
    if tensor_group is not None and pipeline_group is not None:
        raise ValueError("shard the target over a tensor group or a pipeline group, not both")
    group = tensor_group or pipeline_group
    path = resolve_path(path_or_repo, "target model", TARGET_PATTERNS)
    model_config = {**rope_overrides(read_config(path)), **kwargs.pop("model_config", {})}
    sharded = group is not None and group.size() > 1
    try:
        model, tokenizer = mlx_lm_load(str(path), model_config=model_config, lazy=sharded, **kwargs)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as exc:  # the cause stays chained for callers and tracebacks
        raise ValueError(
            f"mlx-lm could not load the target at {path}: {type(exc).__name__}: {exc}"
        ) from exc
    cast_model(model, dtype if dtype is not None else default_dtype())
    if sharded:
        (shard if tensor_group is not None else pipeline)(model, group)
    mx.eval(model.parameters())
    if sharded:  # every rank has its slice before any of them starts a forward
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
    return model, tokenizer


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
    "gemma4",
    "gemma4_text",
    "gpt_oss",
    "kimi_k25",
    "llama",
    "minimax",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_next",
)
# Backbones that multiply the embeddings by `embed_scale`; transformers folds it into
# `embed_tokens`, which is what the published drafters were trained on.
SCALED_EMBEDDINGS = ("gemma4", "gemma4_text")
SUPPORTED = (
    f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}; "
    "other models whose layers all use a plain KVCache are expected to work."
)


def _find_backbone(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(owner, backbone): the module with `embed_tokens` and `layers` and the one holding it.

    The owner holds the LM head and the text config, also inside multimodal
    wrappers (`model.language_model.model`).
    """
    for owner_path, name in (
        ("language_model", "model"),
        ("", "model"),
        ("model", "language_model"),
        ("", ""),
    ):
        owner: Any = model
        for part in filter(None, owner_path.split(".")):
            owner = getattr(owner, part, None) if isinstance(owner, nn.Module) else None
        backbone = getattr(owner, name, None) if name and isinstance(owner, nn.Module) else owner
        if isinstance(backbone, nn.Module) and "embed_tokens" in backbone and "layers" in backbone:
            return owner, backbone
    raise ValueError(
        f"cannot find the embedding and layer list of model type "
        f"'{getattr(model, 'model_type', type(model).__name__)}'. {SUPPORTED}"
    )


_HOOKED_CLASSES: dict[type, type] = {}
_HOOKING = Lock()  # makes "is a layer hooked? then hook it" one step across threads


def _hooked_class(cls: type) -> type:
    """A subclass of `cls` that checkpoints recurrent caches and records its output."""
    if cls not in _HOOKED_CLASSES:

        def __call__(self, *args, **kwargs):
            passed = (*args, *kwargs.values())
            for c in passed:
                if isinstance(c, RecurrentCache):
                    c.checkpoint(args[0].shape[1], partial(_replay, cls, self, args, kwargs))
            out = cls.__call__(self, *args, **kwargs)
            foreign = self._dflash_caches is not None and any(
                isinstance(c, _BaseCache) and id(c) not in self._dflash_caches for c in passed
            )
            if self._dflash_sink is not None and not foreign:
                self._dflash_sink[self._dflash_index] = out[0] if isinstance(out, tuple) else out
            return out

        _HOOKED_CLASSES[cls] = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
    return _HOOKED_CLASSES[cls]


def _replay(cls: type, layer: nn.Module, args: tuple, kwargs: dict, num_positions: int) -> None:
    """Re-run `layer` (unhooked) on the first positions of the input it last saw."""
    cls.__call__(layer, args[0][:, :num_positions], *args[1:], **kwargs)


def _verify_sdpa(queries, keys, values, cache, scale, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` with `cpu_math`'s softmax where it applies."""
    if sinks is not None or hasattr(cache, "bits") or queries.dtype != mx.float32:
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return cpu_math.attention(queries, keys, values, scale, mask)


def _cuda_verify_sdpa(queries, keys, values, cache, scale, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, with the CUDA verify kernel for a causal block
    (MLX's semantics: the last n keys are the block's) and for a tree over a plain KV cache."""
    tree = getattr(cache, "_dflash_tree", None)
    usable = (
        sinks is None
        and not hasattr(cache, "bits")
        and cuda_kernels.supports(queries, keys, values)
    )
    if usable and tree is None and isinstance(mask, str) and mask == "causal":
        visible = cuda_kernels.causal(queries.shape[2])
    elif usable and tree is not None and isinstance(cache, KVCache):
        visible = tree.visible  # the whole cache is visible to every node, and its ancestors
    else:
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return cuda_kernels.verify_attention(queries, keys, values, visible, scale)


# A module whose `__call__` calls these mlx-lm functions (as globals of its own module)
# calls the replacements instead during a verify forward on that backend.
_VERIFY_REPLACEMENTS = {
    "cpu": {
        "swiglu": (swiglu, cpu_math.swiglu),
        "scaled_dot_product_attention": (scaled_dot_product_attention, _verify_sdpa),
    },
    "cuda": {"scaled_dot_product_attention": (scaled_dot_product_attention, _cuda_verify_sdpa)},
}
_REBOUND_CLASSES: dict[tuple[type, str], type | None] = {}


def _rebound_class(cls: type, backend: str) -> type | None:
    """A subclass of `cls` whose `__call__` is its own code with the `backend`'s verify
    functions bound in place of mlx-lm's, or None when it calls none of them.

    The code object and closure are `cls.__call__`'s; only the globals it reads those
    names from differ, in a copy: mlx-lm's module and class stay as they are.
    """
    if (cls, backend) not in _REBOUND_CLASSES:
        call, verify = cls.__call__, None
        if isinstance(call, FunctionType):
            bound = {
                name: ours
                for name, (theirs, ours) in _VERIFY_REPLACEMENTS[backend].items()
                if name in call.__code__.co_names and call.__globals__.get(name) is theirs
            }
            if bound:
                code, defaults, closure = call.__code__, call.__defaults__, call.__closure__
                rebound = FunctionType(
                    code, {**call.__globals__, **bound}, call.__name__, defaults, closure
                )
                rebound.__kwdefaults__ = call.__kwdefaults__
                prefix = "CpuMath" if backend == "cpu" else "CudaVerify"
                verify = type(f"{prefix}{cls.__name__}", (cls,), {"__call__": rebound})
        _REBOUND_CLASSES[(cls, backend)] = verify
    return _REBOUND_CLASSES[(cls, backend)]


def verify_backend() -> str | None:
    """Which verify functions a forward over several positions takes: "cpu" (`cpu_math`'s
    exps, compiled norms and RoPE), "cuda" (the verify-attention kernel; not with
    DFLASH_MLX_KERNELS=reference), or None (mlx-lm's forward as it is)."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if cuda_kernels.enabled():
        return "cuda"
    return None


VERIFY_PATHS = {
    "cpu": "cpu_math exps, compiled norms and RoPE",
    "cuda": "CUDA verify-attention and few-rows product kernels",
    None: "mlx-lm's forward",
}


def _verify_swaps(layers: list[nn.Module | None], backend: str) -> list[Swap]:
    """(module, its class, its class during a verify forward on `backend`) for the blocks'
    modules calling the mlx-lm functions that backend replaces (SwiGLU, SDPA), on the CPU
    the norms and RoPEs (compiled), on CUDA the plain linear layers and LM head
    (`kernels.cuda.few_rows_class`). Backend "cpu step" (one position): the norms and
    RoPEs alone, whose compiled results are mlx-lm's bits."""
    swaps = []
    for layer in filter(None, layers):  # None: another pipeline rank's layer
        for m in layer.modules():
            if backend == "cuda" and (few_rows := cuda_kernels.few_rows_class(m)) is not None:
                swaps.append((m, type(m), few_rows))
            elif backend in ("cpu", "cpu step") and type(m) in cpu_math.COMPILED_CLASSES:
                swaps.append((m, type(m), cpu_math.COMPILED_CLASSES[type(m)]))
            elif backend in _VERIFY_REPLACEMENTS and (verify := _rebound_class(type(m), backend)):
                swaps.append((m, type(m), verify))
    return swaps


class RestrictedHead:
    """`head` (an LM head or a tied embedding) over the rows `token_ids` only.

    The rows are sliced once, so the matmul costs len(token_ids) / vocab of the
    full head's. Called, it scatters the logits back into full-vocabulary rows
    of -inf (0.2 ms for 15 x 49k on a CPU; a gather through an inverse index
    took 2.6 ms): the sampling code sees ordinary logits, and tokens outside get
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
        self.head, self.token_ids, self.ids = head, list(token_ids), mx.array(token_ids)
        self.weights = {n: w[self.ids] for n, w in head.items() if isinstance(w, mx.array)}
        mx.eval(self.weights)
        self.few_rows = cuda_kernels.enabled()  # the drafter's block: 2-16 rows

    def rows(self, x: mx.array) -> mx.array:
        """Logits (..., len(token_ids)): column j is token `token_ids[j]`."""
        w = self.weights
        if self.quantized:
            out = mx.quantized_matmul(
                x,
                w["weight"],
                scales=w["scales"],
                biases=w.get("biases"),
                transpose=True,
                group_size=self.head.group_size,
                bits=self.head.bits,
                mode=self.head.mode,
            )
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


class _PipelineSink(dict):
    """Captured layer outputs when the layers are split over pipeline ranks.

    Each rank records its own tapped layers and the backbone's output; reading a
    tapped layer gathers all of them to every rank with one `all_sum` (each
    layer's rank adds its output, the others zeros), made to depend on the
    backbone's output so that it runs after the forward's own send, receive and
    gather on every rank alike, and evaluated at once, before any later forward.
    """

    OUTPUT = "output"

    def __init__(self, layer_ids: list[int]):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.gathered: tuple[mx.array, mx.array] | None = None  # (for this output, features)

    def __getitem__(self, i: int) -> mx.array:
        output = dict.__getitem__(self, self.OUTPUT)
        if self.gathered is None or self.gathered[0] is not output:
            parts = [dict.get(self, j, mx.zeros_like(output)) for j in self.layer_ids]
            mine = mx.depends(mx.concatenate(parts, axis=-1), output)
            self.gathered = (output, mx.distributed.all_sum(mine, stream=mx.cpu))
            mx.eval(self.gathered[1])  # now: a receive of the next forward, which depends on
            # nothing, must not be scheduled before it on one rank and after it on another
        k, width = self.layer_ids.index(i), output.shape[-1]
        return self.gathered[1][..., k * width : (k + 1) * width]


@dataclass
class TreeForward:
    """What a tree forward's hooks hand to the model: each node's position and what it sees.

    `positions` (n,) are absolute (the cache offset + the node's depth); `visible`
    (n, n) is the ancestor mask among the nodes. The counters show afterwards
    whether the model took both (see `TargetAdapter.tree_attention`).
    """

    positions: mx.array
    visible: mx.array
    roped: set[int] = field(default_factory=set)
    masked: bool = False

    def mask(self, start: int, offset: int, n: int, window: int | None = None) -> mx.array:
        """(n, offset - start + n) over the cached positions [start, offset) and the nodes:
        every node sees the committed positions and its ancestors, those within `window`
        positions of its own if a window is given."""
        if n != self.visible.shape[0]:
            raise ValueError(f"a tree forward of {self.visible.shape[0]} nodes got {n} positions")
        self.masked = True
        if window is None:
            context, visible = mx.ones((n, offset - start), dtype=mx.bool_), self.visible
        else:
            context = self.positions[:, None] - mx.arange(start, offset)[None] < window
            visible = self.visible & (self.positions[:, None] - self.positions[None] < window)
        return mx.concatenate([context, visible], axis=1)


_TREE_CLASSES: dict[type, type] = {}


def _tree_class(cls: type) -> type:
    """The class a KV cache or a RoPE module has during a tree forward: a subclass of its own.

    The cache's `make_mask` gives the tree's mask. The RoPE puts node i of a
    (1, heads, n, dim) input at positions[i]: mx.fast.rope takes one offset per
    batch row, so the node axis goes into the batch axis and back.
    """
    if cls not in _TREE_CLASSES:
        if issubclass(cls, KVCache):

            def make_mask(self, N: int, *args: Any, **kwargs: Any) -> mx.array:
                return self._dflash_tree.mask(0, self.offset, N)

            body = {"make_mask": make_mask}
        elif issubclass(cls, WindowKVCache):

            def make_mask(self, N: int, window_size: int | None = None, **kwargs: Any) -> mx.array:
                start = self._first_visible()  # what update_and_fetch will keep
                return self._dflash_tree.mask(start, self.offset, N, window_size or self.window)

            body = {"make_mask": make_mask}
        else:

            def __call__(self, x, offset=0, *args, **kwargs):
                tree = self._dflash_tree
                if x.shape[0] != 1 or x.shape[-2] != tree.positions.size:
                    raise ValueError(f"a tree forward cannot place an input of shape {x.shape}")
                tree.roped.add(id(self))
                own = cls
                if mx.default_device() == mx.cpu and cls in cpu_math.COMPILED_CLASSES:
                    own = cpu_math.COMPILED_CLASSES[cls]  # the verify forward's compiled RoPE
                out = own.__call__(self, x.swapaxes(0, -2), tree.positions, *args, **kwargs)
                return out.swapaxes(0, -2)

            body = {"__call__": __call__}
        _TREE_CLASSES[cls] = type(f"Tree{cls.__name__}", (cls,), body)
    return _TREE_CLASSES[cls]


def _gathered_logits(head: nn.Module, x: mx.array) -> mx.array:
    """The full-vocabulary logits of a vocabulary-sharded LM head, on every rank."""
    return gather_last_axis(head(x), head.group)


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
        self.embedding = backbone.embed_tokens
        self.embed_scale = backbone.embed_scale if self.family in SCALED_EMBEDDINGS else None
        self.head = owner.lm_head if "lm_head" in owner else self.embedding
        self.lm_head = self.head if "lm_head" in owner else self.embedding.as_linear
        if isinstance(self.head, SHARDED_HEADS):  # each rank holds a slice of the vocabulary
            self.lm_head = partial(_gathered_logits, self.head)
        args = getattr(owner, "args", None)
        self.max_context = getattr(args, "max_position_embeddings", None)
        self._verify_swaps: dict[str, list[Swap]] = {}

    def forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """The target's logits (len(tokens), vocab) at `tokens`, appended to `cache`.

        On the CPU norms and RoPEs run compiled, and over several positions SwiGLUs and
        attention take their exps from `cpu_math`; on MLX's CUDA backend attention takes
        the verify kernel over several positions (see the module docstring).
        """
        backend = verify_backend()
        if tokens.size == 1:
            backend = "cpu step" if backend == "cpu" else None
        if backend is None:
            return self.model(tokens[None], cache=cache)[0]
        if backend not in self._verify_swaps:
            norm = getattr(self.backbone, "norm", None)
            norm = norm if isinstance(norm, nn.Module) else None
            self._verify_swaps[backend] = _verify_swaps([*self.layers, norm, self.head], backend)
        # graph building only: the classes are back before anything runs
        with _HOOKING, swapped(self._verify_swaps[backend]), cpu_math.shared_rope_tables():
            return self.model(tokens[None], cache=cache)[0]

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        """What the target's first layer sees for `tokens` (the drafter embeds its block so)."""
        h = self.embedding(tokens)
        return h if self.embed_scale is None else h * self.embed_scale

    def draft_head(self, token_ids: list[int] | None) -> Callable[[mx.array], mx.array]:
        """The head the drafter proposes through: the LM head, restricted to `token_ids`
        if given. Build it once per generation: the restriction slices the weights."""
        if token_ids is None:
            plain = cuda_kernels.few_rows_class(self.head) and "bias" not in self.head
            if plain and cuda_kernels.enabled():  # the drafter's block: 2-16 rows
                return partial(cuda_kernels.times_transposed, weight=self.head.weight)
            return self.lm_head
        if isinstance(self.head, SHARDED_HEADS):  # no rank holds all the rows: mask instead
            outside = mx.full((self.vocab_size,), -mx.inf)
            outside[mx.array(token_ids)] = 0.0
            return lambda x: self.lm_head(x) + outside
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

    def make_cache(self) -> list[Any]:
        """mlx-lm's caches for the model, with the ones a trim cannot roll back replaced."""
        return [self._rollbackable(c) for c in make_prompt_cache(self.model)]

    def _rollbackable(self, cache: Any) -> Any:
        if type(cache) is KVCache:
            return cache
        if self.family in SUPPORTED_MODEL_TYPES:
            if type(cache) is RotatingKVCache and cache.keep == 0:
                return WindowKVCache(cache.max_size)
            if type(cache) is ArraysCache:
                return RecurrentCache(len(cache.cache))
        raise ValueError(
            f"target model type '{self.model_type}' is not supported: its "
            f"{type(cache).__name__} cannot be rolled back after a rejected draft. {SUPPORTED}"
        )

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
        other = next((c for c in cache if not isinstance(c, KVCache | WindowKVCache)), None)
        if other is not None:
            kind = "recurrent" if isinstance(other, RecurrentCache) else type(other).__name__
            raise ValueError(
                f"tree verification does not support target model type '{self.model_type}': "
                f"its {kind} layers cannot keep just the accepted path of a tree; "
                "use the chain (no --tree-budget)"
            )
        if not self.ropes:
            raise ValueError(
                f"tree verification does not support target model type '{self.model_type}': "
                "its attention has no `rope` module to give tree nodes their positions"
            )

    @contextmanager
    def tree_attention(self, cache: list[Any], depths: list[int], visible: mx.array) -> Iterator:
        """Make the next forward through `cache` a tree forward, per instance.

        Its inputs are tree nodes: node i is placed at the cache offset + `depths[i]`
        and sees the committed cache and the nodes `visible[i]` (its ancestors).
        The model code runs unchanged: the caches' class is swapped for one whose
        `make_mask` gives the tree mask and each attention's RoPE for one that
        takes per-node positions (mlx-lm's attention asks `cache.make_mask` for
        its mask and ropes at `cache.offset`); both get their classes back after.
        A model that took neither (its attention computes them otherwise) is
        refused after the forward, before anything is read from it.
        """
        tree = TreeForward(cache[0].offset + mx.array(depths), visible)
        swapped: list[tuple[Any, type]] = []
        try:
            for obj in [*cache, *self.ropes]:
                swapped.append((obj, type(obj)))
                object.__setattr__(obj, "_dflash_tree", tree)
                obj.__class__ = _tree_class(type(obj))
            yield tree
        finally:
            for obj, original in swapped:
                obj.__class__ = original
                object.__delattr__(obj, "_dflash_tree")
        if not tree.masked or len(tree.roped) != len(self.ropes):
            raise ValueError(
                f"tree verification does not support target model type '{self.model_type}': "
                "its attention did not take the tree's positions and mask"
            )

    @contextmanager
    def capture(
        self, layer_ids: list[int], cache: list[Any] | None = None
    ) -> Iterator[dict[int, mx.array]]:
        """Record the outputs of `layer_ids` on every forward while the context is open.

        Layers with a recurrent cache are hooked too: each forward checkpoints
        their cache so that `rollback` can re-run the committed prefix. With
        `cache`, a forward through other caches is not recorded. A second
        capture of the same model while one is open raises RuntimeError.
        """
        sink: dict[Any, mx.array] = _PipelineSink(layer_ids) if self.pipelined else {}
        tapped = set(layer_ids)
        recurrent = {
            self.layer_offset + i
            for i, c in enumerate(make_prompt_cache(self.model))
            if isinstance(c, ArraysCache)
        }
        caches = None if cache is None else {id(c) for c in cache}
        hooked = []
        with _HOOKING:
            if any(type(layer) in _HOOKED_CLASSES.values() for layer in self.layers):
                raise RuntimeError(
                    "this model is already being generated with (in another thread or another "
                    "open generator); run one generation per model at a time"
                )
            hooks = [(i, self.layers[i]) for i in sorted(tapped | recurrent)]
            if self.pipelined:  # its output: after the forward's collectives on every rank
                hooks.append((_PipelineSink.OUTPUT, self.backbone))
            for i, layer in hooks:
                if layer is None:  # on another pipeline rank
                    continue
                original = type(layer)
                record = i in tapped or i == _PipelineSink.OUTPUT
                object.__setattr__(layer, "_dflash_sink", sink if record else None)
                object.__setattr__(layer, "_dflash_index", i)
                object.__setattr__(layer, "_dflash_caches", caches)
                layer.__class__ = _hooked_class(original)
                hooked.append((layer, original))
        try:
            yield sink
        finally:
            with _HOOKING:
                for layer, original in hooked:
                    layer.__class__ = original
                    for name in ("_dflash_sink", "_dflash_index", "_dflash_caches"):
                        object.__delattr__(layer, name)
