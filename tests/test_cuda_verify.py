"""The verify-attention path of MLX's CUDA backend (`kernels/cuda.py`, `target._cuda_verify_sdpa`).

On this CPU the kernel cannot run, so the plumbing is tested with the kernel replaced by an
independent stand-in of its contract (MLX's SDPA over the full mask the visibility implies):
greedy chains and trees stay equal to mlx-lm's, each call gets the right visibility, and
what the kernel does not take (sinks, windowed masks) falls back to mlx-lm. Where MLX has a
CUDA GPU, the kernel itself is checked against MLX's SDPA.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import test_families
from helpers import reference_greedy
from test_families import FAMILIES, PROMPT, build, first_difference
from test_generate import OracleDraft

from dflash_mlx import stream_generate
from dflash_mlx.models import backends
from dflash_mlx.models import target as target_module
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.tree import ancestor_mask
from dflash_mlx.native.kernels import cuda as cuda_kernels

MAX_TOKENS = 60
family, tokenizer = test_families.family, test_families.tokenizer  # their fixtures, shared


def full_mask(visible: mx.array, keys: int) -> mx.array:
    """(n, keys): every key before the last n visible, the last n as `visible` says."""
    n = visible.shape[0]
    return mx.concatenate([mx.ones((n, keys - n), dtype=mx.bool_), visible], axis=1)


def stand_in(queries, keys, values, visible, scale):
    """The kernel's contract in MLX ops (its independent reference)."""
    mask = full_mask(visible, keys.shape[2])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@pytest.fixture
def as_cuda(monkeypatch):
    """Verify forwards take the CUDA path, the kernel replaced by the stand-in; returns the
    visibility matrix of every call."""
    calls = []

    def recording(queries, keys, values, visible, scale):
        calls.append(np.array(visible))
        return stand_in(queries, keys, values, visible, scale)

    monkeypatch.setattr(backends, "current", lambda: "cuda")
    monkeypatch.setattr(cuda_kernels, "verify_attention", recording)
    return calls


def run(model, draft, tokenizer, **kwargs) -> list[int]:
    responses = stream_generate(model, draft, tokenizer, PROMPT, max_tokens=MAX_TOKENS, **kwargs)
    return [t for r in responses for t in r.tokens]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_chain_and_tree_greedy_equal_mlx_lm_through_the_verify_kernel(tokenizer, as_cuda, name):
    model = build(name, fields=dict(FAMILIES[name][1], head_dim=32))  # a head the kernel takes
    draft = init_draft(model, num_layers=2, block_size=16)
    expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
    oracle = OracleDraft(draft, PROMPT + expected)
    layers = len(target_module.TargetAdapter(model).layers)
    tokens = run(model, oracle, tokenizer, block_size=16)
    assert tokens == expected[:MAX_TOKENS], (
        f"first difference at {first_difference(tokens, expected)}"
    )
    assert len(as_cuda) % layers == 0 and as_cuda  # every attention of every verify forward
    assert all((v == np.tril(np.ones(v.shape, dtype=bool))).all() for v in as_cuda)

    as_cuda.clear()
    tokens = run(model, draft, tokenizer, block_size=16, tree_budget=8)
    assert tokens == expected[:MAX_TOKENS], (
        f"first difference at {first_difference(tokens, expected)}"
    )
    assert as_cuda and all(v.shape[0] > 1 for v in as_cuda)
    # a tree's visibility is its ancestor mask: the root sees itself only, each node its parent's
    # row plus itself
    for v in as_cuda:
        assert v[0].sum() == 1 and v.diagonal().all() and not np.triu(v, 1).any()


@pytest.mark.parametrize("name", ["gpt_oss", "gemma4_text"])
def test_sinks_and_windowed_layers_fall_back_to_mlx_lm(family, tokenizer, as_cuda, name):
    """gpt-oss has attention sinks in every layer: none takes the kernel. Of gemma4's, the
    full-attention layer does (head dim 32), its sliding ones (16) fall back."""
    model, draft, expected = family(name)
    tokens = run(model, draft, tokenizer, block_size=8)
    assert tokens == expected[:MAX_TOKENS], (
        f"first difference at {first_difference(tokens, expected)}"
    )
    assert (len(as_cuda) == 0) == (name == "gpt_oss")


def test_supports_names_what_the_kernel_takes():
    q = mx.zeros((1, 8, 16, 128), dtype=mx.bfloat16)
    kv = mx.zeros((1, 2, 80, 128), dtype=mx.bfloat16)
    assert cuda_kernels.supports(q, kv, kv)
    assert not cuda_kernels.supports(q, kv.astype(mx.float16), kv)  # mixed dtypes
    assert not cuda_kernels.supports(q[..., :80], kv[..., :80], kv[..., :80])  # head dim 80
    assert not cuda_kernels.supports(q, kv[:, :, :8], kv[:, :, :8])  # fewer keys than queries
    assert not cuda_kernels.supports(q[:, :3], kv, kv)  # 3 query heads over 2 kv heads
    assert (np.array(cuda_kernels.causal(4)) == np.tril(np.ones((4, 4), dtype=bool))).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(
    "n, context, q_heads, kv_heads, head_dim",
    [(16, 64, 32, 8, 128), (5, 300, 9, 3, 64), (9, 1000, 16, 16, 128), (2, 7, 4, 2, 32)],
)
def test_kernel_equals_mlx_sdpa(dtype, n, context, q_heads, kv_heads, head_dim):
    """Causal and tree visibility, keys and values a strided slice of a cache-like buffer."""
    mx.random.seed(n)
    q = mx.random.normal((1, q_heads, n, head_dim)).astype(dtype)
    buffer = mx.random.normal((2, 1, kv_heads, 512 * (1 + (context + n) // 512), head_dim))
    k, v = (b[:, :, : context + n].astype(dtype) for b in buffer)
    parents = [-1] + [
        int(p) % i for i, p in enumerate(np.random.default_rng(n).integers(0, 99, n - 1), 1)
    ]
    for visible in (cuda_kernels.causal(n), ancestor_mask(parents)):
        mask = full_mask(visible, context + n)
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5, mask=mask)
        got = cuda_kernels.verify_attention(q, k, v, visible, head_dim**-0.5)
        ref, got = ref.astype(mx.float32), got.astype(mx.float32)
        error = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
        # bf16/fp16 outputs round differently; float32 references go through TF32 products
        assert error < {mx.bfloat16: 1e-2, mx.float16: 2e-3, mx.float32: 2e-3}[dtype]


@pytest.fixture
def few_rows(as_cuda, monkeypatch):
    """As `as_cuda`, and the few-rows kernel runs (here: an exact stand-in, `x @ w.T`, taking
    float32 weights too); returns (rows, id of the weight) of every product it was given."""
    calls = []

    def recording(x, weight):
        calls.append((x.size // x.shape[-1], id(weight)))
        return x @ weight.T

    monkeypatch.setattr(cuda_kernels, "enabled", lambda: True)
    monkeypatch.setattr(cuda_kernels, "few_rows_weight", lambda weight: weight.ndim == 2)
    monkeypatch.setattr(cuda_kernels, "few_rows_matmul", recording)
    return calls


def assert_products_taken(model, draft, calls: list, layer_class: type) -> None:
    """The kernel's `calls` ((rows, id of the weight)) had 2..8 rows each and took every
    `layer_class` layer of the target's blocks and of the drafter, and the LM head."""
    assert all(2 <= rows <= 8 for rows, _ in calls)
    taken = {weight for _, weight in calls}
    target = target_module.TargetAdapter(model)
    layers = [m for layer in [*target.layers, *draft.layers] for m in layer.modules()]
    wanted = {id(m.weight) for m in layers if type(m) is layer_class}
    assert wanted and wanted | {id(target.head.weight)} <= taken


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_verify_and_draft_products_of_several_rows_take_the_few_rows_kernel(
    tokenizer, few_rows, name
):
    """Every plain linear layer of the target's blocks, its LM head (tied or not), the
    drafter's layers and the head it drafts through: products of 2+ rows go to the kernel,
    one row to MLX's; the output stays mlx-lm's, and the classes are back afterwards."""
    model = build(name, fields=dict(FAMILIES[name][1], head_dim=32))
    draft = init_draft(model, num_layers=2, block_size=8)
    expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
    classes = {id(m): type(m) for m in [*model.modules(), *draft.modules()]}
    for drafter in (draft, OracleDraft(draft, PROMPT + expected)):  # drafting; long accepts
        tokens = run(model, drafter, tokenizer, block_size=8)
        assert tokens == expected[:MAX_TOKENS], (
            f"first difference at {first_difference(tokens, expected)}"
        )
    assert_products_taken(model, draft, few_rows, nn.Linear)
    assert classes == {id(m): type(m) for m in [*model.modules(), *draft.modules()]}


def test_few_rows_supports_names_what_the_kernel_takes():
    x = mx.zeros((1, 16, 4096), dtype=mx.bfloat16)
    w = mx.zeros((1024, 4096), dtype=mx.bfloat16)
    assert cuda_kernels.few_rows_supports(x, w)
    assert cuda_kernels.few_rows_supports(x[:, :1], w)  # one row too (the layer uses MLX's)
    assert not cuda_kernels.few_rows_supports(x, w.astype(mx.float16))  # mixed dtypes
    assert not cuda_kernels.few_rows_supports(x.astype(mx.float32), w.astype(mx.float32))
    assert not cuda_kernels.few_rows_supports(mx.zeros((1, 17, 4096), mx.bfloat16), w)
    assert not cuda_kernels.few_rows_supports(x[..., :4092], w[:, :4092])  # K not a multiple of 8


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("n_out, depth", [(1024, 4096), (4096, 12288), (300, 576), (6, 40)])
def test_few_rows_kernel_equals_float32_products(dtype, rows, n_out, depth):
    """Tails of every tile (N not a multiple of 8 or 16, K of 32, rows of 16) and a strided
    (non-contiguous) input, against float32 products."""
    mx.random.seed(rows)
    x = mx.random.normal((1, rows, depth)).astype(dtype)
    w = (mx.random.normal((n_out, depth)) * depth**-0.5).astype(dtype)
    strided = mx.random.normal((1, rows, depth + 8)).astype(dtype)[..., 8:]
    for given in (x, strided):
        ref = given.astype(mx.float32) @ w.astype(mx.float32).T
        got = cuda_kernels.few_rows_matmul(given, w).astype(mx.float32).reshape(ref.shape)
        error = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
        assert error < 1e-2  # bf16/fp16 outputs: one rounding of a float32 sum
