"""The verify forward's CPU attention kernel (`cpu_attention.py`): float64 parity for causal,
tree and per-head masks over grouped-query heads, short and long caches, strided views; the
fallback to `cpu_math.attention` where it is off or does not apply; its place in `_cpu_sdpa`."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention

from dflash_mlx.models import backends
from dflash_mlx.native import cpu_attention, cpu_math
from dflash_mlx.native.cpu_attention import causal_visible, reference

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU only")


@pytest.fixture(scope="module")
def ext():
    built = cpu_attention.extension()
    assert built is not None, cpu_attention.status()  # a compiler and nanobind are there
    return built


def tree_visible(queries: int, keys: int, rng: np.random.Generator) -> np.ndarray:
    """A tree's mask over a cache: every node sees the context, itself and its ancestors."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, queries)]
    visible = np.zeros((queries, keys), bool)
    visible[:, : keys - queries] = True
    for i, parent in enumerate(parents):
        visible[i, keys - queries + i] = True
        if parent >= 0:
            visible[i] |= visible[parent]
    return visible


def inputs(batch: int, heads: int, kv_heads: int, queries: int, keys: int, seed: int = 0):
    """Queries as mlx-lm's attention has them (a transposed view) and keys and values as a
    KVCache returns them (views of a longer preallocated buffer)."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((batch, queries, heads, 64)).astype(np.float32))
    buffers = rng.standard_normal((2, batch, kv_heads, keys + 37, 64)).astype(np.float32)
    k, v = (mx.array(b)[:, :, :keys] for b in buffers)
    return q.transpose(0, 2, 1, 3), k, v


def assert_close(ours: mx.array, exact: np.ndarray):
    assert ours.shape == exact.shape and ours.dtype == mx.float32
    assert np.max(np.abs(np.array(ours) - exact)) <= 1e-5 * np.max(np.abs(exact))


@pytest.mark.parametrize("keys", [17, 300, 5000])
@pytest.mark.parametrize("queries", [2, 5, 16, 33])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_matches_float64_attention(ext, mask, queries, keys):
    if queries > keys:
        pytest.skip("more queries than keys")
    q, k, v = inputs(1, 9, 3, queries, keys, seed=queries + keys)
    if mask == "causal":
        visible = causal_visible(queries, keys)
    else:
        visible = tree_visible(queries, keys, np.random.default_rng(queries * keys))
    given = mask if mask == "causal" else mx.array(visible)
    ours = cpu_attention.attention(q, k, v, 0.125, given)
    assert_close(ours, reference(q, k, v, 0.125, visible))
    assert mx.allclose(ours, cpu_math.attention(q, k, v, 0.125, given), atol=2e-6)


@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (6, 2)])
def test_batches_heads_and_broadcast_masks(ext, heads):
    h, kv = heads
    rng = np.random.default_rng(h)
    q, k, v = inputs(2, h, kv, 7, 900, seed=h)
    per_head = rng.random((2, h, 7, 900)) < 0.7
    per_head[..., 0] = True
    for visible in (None, per_head, per_head[:1, :1]):
        given = None if visible is None else mx.array(visible)
        exact = reference(q, k, v, 0.3, True if visible is None else visible)
        assert_close(cpu_attention.attention(q, k, v, 0.3, given), exact)


def test_values_may_have_another_width_and_scores_need_not_be_small(ext):
    q, k, _ = inputs(1, 4, 2, 3, 650)
    v = mx.random.normal((1, 2, 650, 32), key=mx.random.key(0))
    exact = reference(q * 20, k, v, 1.0, causal_visible(3, 650))  # a peaked softmax
    assert_close(cpu_attention.attention(q * 20, k, v, 1.0, "causal"), exact)


def test_other_masks_and_dtypes_take_cpu_math(ext, monkeypatch):
    monkeypatch.setattr(ext, "verify_attention", None)  # not called
    q, k, v = inputs(1, 4, 2, 5, 40)
    additive = mx.random.normal((5, 40), key=mx.random.key(1))
    half = [a.astype(mx.float16) for a in (q, k, v)]
    for args in ((q, k, v, 0.125, additive), (*half, 0.125, "causal")):
        ours, theirs = cpu_attention.attention(*args), cpu_math.attention(*args)
        assert mx.array_equal(ours, theirs, equal_nan=True)
    with pytest.raises(ValueError, match="unknown attention mask"):
        cpu_attention.attention(q, k, v, 0.125, "sliding")


def test_inconsistent_shapes_are_refused_while_the_graph_is_built(ext):
    q, k, v = inputs(1, 4, 3, 5, 40)  # 4 heads over 3 KV heads
    with pytest.raises(ValueError, match="needs float32"):
        ext.verify_attention(q, k, v, 0.125, None, True)


def test_the_verify_forwards_sdpa_takes_the_kernel(ext, monkeypatch):
    q, k, v = inputs(1, 6, 2, 4, 100)
    expected = cpu_attention.attention(q, k, v, 0.125, "causal")
    calls = []
    monkeypatch.setattr(ext, "verify_attention", lambda *a: calls.append(a) or expected)
    assert backends._cpu_sdpa(q, k, v, None, 0.125, "causal") is expected and calls
    theirs = scaled_dot_product_attention(q, k, v, None, 0.125, "causal")  # MLX's own
    assert mx.allclose(expected, theirs, atol=2e-6)


def test_off_by_environment_and_says_so(ext, monkeypatch):
    assert cpu_attention.status().startswith("in use")
    q, k, v = inputs(1, 4, 2, 5, 40)
    monkeypatch.setenv("DFLASH_MLX_NO_CPU_ATTENTION", "1")
    cpu_attention.extension.cache_clear()
    try:
        assert cpu_attention.extension() is None
        assert "disabled" in cpu_attention.status()
        ours = cpu_attention.attention(q, k, v, 0.125, "causal")
        assert mx.array_equal(ours, cpu_math.attention(q, k, v, 0.125, "causal"))
    finally:
        monkeypatch.delenv("DFLASH_MLX_NO_CPU_ATTENTION")
        cpu_attention.extension.cache_clear()
        assert cpu_attention.extension() is not None
