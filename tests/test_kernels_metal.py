"""The Metal block-attention kernel, run on the CPU by the MSL emulator in tests/msl_emu."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import msl_emu
import numpy as np
import pytest
from msl_emu import Tensor

from dflash_mlx.native import kernels
from dflash_mlx.native.kernels import metal
from dflash_mlx.native.kernels.reference import reference_attention

NO_COMPILER = "no clang with _Float16/__bf16 (apt-get install clang-19 libclang-rt-19-dev)"
COMPILER_MISSING = msl_emu.find_compiler() is None
# Skipped on a developer's machine without clang; under CI=true they run, and fail.
pytestmark = pytest.mark.skipif(
    COMPILER_MISSING and os.environ.get("CI") != "true", reason=NO_COMPILER
)


def test_the_emulator_has_a_compiler():
    assert not COMPILER_MISSING, NO_COMPILER


@pytest.mark.skipif(COMPILER_MISSING, reason=NO_COMPILER)  # CI: the test above fails instead
def test_ci_fails_instead_of_skipping_without_a_compiler(tmp_path):
    (tmp_path / "python").symlink_to(sys.executable)  # a PATH with python and no clang
    env = {**os.environ, "CI": "true", "PATH": str(tmp_path)}
    # -n 0: the two tests in this process, not in worker processes (addopts' -n 2)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__]
    cmd += ["-k", "has_a_compiler or test_barrier_and_threadgroup_memory"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).parent)
    assert out.returncode == 1, out.stdout
    assert "2 failed" in out.stdout and "skipped" not in out.stdout, out.stdout


DTYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def emulate(source, inputs, grid, threadgroup, output_shapes, output_dtypes, **kw):
    """Run a test kernel body; inputs are numpy arrays (float32/int32) or Tensors."""
    tensors = [x if isinstance(x, Tensor) else Tensor(x, mx.array(x[:0]).dtype) for x in inputs]
    names = kw.pop("input_names", [f"in{i}" for i in range(len(inputs))])
    outs = msl_emu.run(
        name="t", input_names=names, output_names=[f"out{i}" for i in range(len(output_shapes))],
        source=source, header=kw.pop("header", "#include <metal_stdlib>\nusing namespace metal;\n"),
        inputs=tensors, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
        output_dtypes=output_dtypes, template=kw.pop("template", []), **kw,
    )  # fmt: skip
    return [o.data for o in outs]


# --- the shim itself ------------------------------------------------------------------


def test_barrier_and_threadgroup_memory():
    # Each thread reads what the mirror thread of its own threadgroup wrote before the
    # barrier, then all reduce a tree over threadgroup memory (one barrier per level).
    src = """
    threadgroup float buf[64];
    threadgroup float tree[64];
    uint t = thread_index_in_threadgroup;
    buf[t] = in0[thread_position_in_grid.x];
    tree[t] = buf[t];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out0[thread_position_in_grid.x] = buf[63 - t];
    for (uint stride = 32; stride > 0; stride /= 2) {
      float v = t < stride ? tree[t] + tree[t + stride] : 0.0f;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (t < stride) tree[t] = v;
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (t == 0) out1[threadgroup_position_in_grid.x] = tree[0];
    """
    x = np.arange(256, dtype=np.float32)
    mirrored, sums = emulate(src, [x], (256, 1, 1), (64, 1, 1), [(256,), (4,)], [mx.float32] * 2)
    np.testing.assert_array_equal(mirrored, x.reshape(4, 64)[:, ::-1].ravel())
    np.testing.assert_array_equal(sums, x.reshape(4, 64).sum(1))


def test_simdgroup_functions():
    src = """
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float x = in0[i];
    out0[i * 6 + 0] = simd_sum(x);
    out0[i * 6 + 1] = simd_max(x);
    out0[i * 6 + 2] = simd_min(x);
    out0[i * 6 + 3] = simd_shuffle(x, (lane + 3) % 32);
    out0[i * 6 + 4] = simd_shuffle_xor(x, 5);
    out0[i * 6 + 5] = simd_broadcast(x, 7) + float(simdgroup_index_in_threadgroup);
    """
    x = np.random.default_rng(0).normal(size=128).astype(np.float32)
    (got,) = emulate(src, [x], (128, 1, 1), (64, 1, 1), [(128 * 6,)], [mx.float32])
    got = got.reshape(4, 32, 6)
    g = x.reshape(4, 32)
    lanes = np.arange(32)
    np.testing.assert_allclose(got[..., 0], np.repeat(g.sum(1, keepdims=True), 32, 1), rtol=1e-6)
    np.testing.assert_array_equal(got[..., 1], np.repeat(g.max(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(got[..., 2], np.repeat(g.min(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(got[..., 3], g[:, (lanes + 3) % 32])
    np.testing.assert_array_equal(got[..., 4], g[:, lanes ^ 5])
    want_broadcast = g[:, 7:8] + np.array([[0], [1], [0], [1]])
    np.testing.assert_array_equal(got[..., 5], np.broadcast_to(want_broadcast, (4, 32)))


def test_thread_attributes_and_vector_types():
    src = """
    uint3 p = thread_position_in_grid;
    uint i = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
    uint3 g = threadgroup_position_in_grid;
    uint4 v = {g.x, g.y, g.z, thread_index_in_threadgroup};
    uint3 w = thread_position_in_threadgroup * threads_per_threadgroup;
    out0[i * 4 + 0] = v.wzyx.x;
    out0[i * 4 + 1] = w.x + w.y + w.z;
    out0[i * 4 + 2] = threadgroups_per_grid.z;
    out0[i * 4 + 3] = p.x;
    """
    (got,) = emulate(src, [np.zeros(8, np.float32)], (8, 4, 2), (4, 2, 1), [(2, 4, 8, 4)],
                     [mx.uint32])  # fmt: skip
    z, y, x = np.meshgrid(np.arange(2), np.arange(4), np.arange(8), indexing="ij")
    local = (x % 4) + 4 * (y % 2)
    np.testing.assert_array_equal(got[..., 0], local)
    np.testing.assert_array_equal(got[..., 1], (x % 4) * 4 + (y % 2) * 2)
    np.testing.assert_array_equal(got[..., 2], 2)
    np.testing.assert_array_equal(got[..., 3], x)


@pytest.mark.parametrize("contiguous", [True, False])
def test_strided_inputs(contiguous):
    # With ensure_row_contiguous=False the view's own strides are bound, as MLX does.
    src = """
    uint i = thread_position_in_grid.x, j = thread_position_in_grid.y;
    out0[j * in0_shape[1] + i] = in0[j * in0_strides[0] + i * in0_strides[1]] + float(in0_ndim);
    """
    base = np.full((10, 12), np.nan, np.float32)
    base[1:8, 2:11:2] = np.arange(35, dtype=np.float32).reshape(7, 5)
    view = base[1:8, 2:11:2].T
    (got,) = emulate(src, [view], (7, 5, 1), (7, 1, 1), [(5, 7)], [mx.float32],
                     ensure_row_contiguous=contiguous)  # fmt: skip
    np.testing.assert_array_equal(got, view + 2)


def test_half_and_bfloat_conversions():
    src = "out0[thread_position_in_grid.x] = static_cast<T>(in0[thread_position_in_grid.x]);"
    x = np.random.default_rng(1).normal(size=64).astype(np.float32) * 300
    for dtype in (mx.float16, mx.bfloat16):
        (got,) = emulate(src, [x], (64, 1, 1), (32, 1, 1), [(64,)], [dtype],
                         template=[("T", dtype)])  # fmt: skip
        rounded = mx.array(x).astype(dtype)
        want = np.array(rounded.view(mx.uint16) if dtype == mx.bfloat16 else rounded)
        np.testing.assert_array_equal(got, want)


def test_divergent_barrier_and_stray_write_are_errors():
    x = np.zeros(64, np.float32)
    diverge = "if (thread_index_in_threadgroup < 16) threadgroup_barrier(mem_flags::mem_none);"
    with pytest.raises(msl_emu.EmulatorError, match="deadlock"):
        emulate(diverge, [x], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32])
    mixed = "float v = thread_index_in_simdgroup < 8 ? simd_sum(1.0f) : simd_max(1.0f);"
    with pytest.raises(msl_emu.EmulatorError, match="different simdgroup functions"):
        emulate(mixed, [x], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32])
    stray = "out0[thread_position_in_grid.x + 1] = 1.0f;"
    with pytest.raises(msl_emu.EmulatorError, match="outside an output"):
        emulate(stray, [x], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32])
    with pytest.raises(msl_emu.CompileError):
        emulate("this is not C++;", [x], (64, 1, 1), (64, 1, 1), [(64,)], [mx.float32])


# --- the block-attention kernel against a float64 reference -----------------------------


def strided(values: np.ndarray, dtype, layout: str) -> Tensor:
    """`values` stored as `dtype` in a NaN-filled buffer and returned as a strided view."""
    if dtype == mx.bfloat16:
        stored = np.array(mx.array(values).astype(mx.bfloat16).view(mx.uint16))
        nan = np.uint16(0x7FC0)
    else:
        stored, nan = values.astype(DTYPES[dtype]), np.nan
    b, h, n, d = stored.shape
    if layout == "cache":  # the first n rows of a longer preallocated cache
        base = np.full((b, h, n + 7, d), nan, stored.dtype)
        base[:, :, :n] = stored
        view = base[:, :, :n]
    elif layout == "heads-last":  # (B, L, H, D) transposed to (B, H, L, D)
        base = np.full((b, n, h, d), nan, stored.dtype)
        base[:] = stored.transpose(0, 2, 1, 3)
        view = base.transpose(0, 2, 1, 3)
    else:  # every other column of a wider buffer
        base = np.full((b, h, n, 2 * d), nan, stored.dtype)
        base[..., ::2] = stored
        view = base[..., ::2]
    return Tensor(view, dtype)


def decoded(t: Tensor) -> np.ndarray:
    if t.dtype == mx.bfloat16:
        return (t.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return t.data.astype(np.float64)


def attention64(q, kc, vc, kb, vb, scale):
    g = q.shape[1] // kb.shape[1]
    k = np.repeat(np.concatenate([kc, kb], 2), g, axis=1)
    v = np.repeat(np.concatenate([vc, vb], 2), g, axis=1)
    s = scale * q @ k.swapaxes(-1, -2)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def run_kernel(s, gqa, head_dim, block_len, dtype, batch=1, n_kv_heads=2, seed=0, scale=None):
    rng = np.random.default_rng(seed)
    hq = n_kv_heads * gqa
    shapes = [(batch, hq, block_len), (batch, n_kv_heads, s), (batch, n_kv_heads, s)]
    shapes += [(batch, n_kv_heads, block_len)] * 2
    layouts = ["heads-last", "cache", "cache", "wide", "wide"]
    args = [
        strided(rng.normal(size=(*shape, head_dim)).astype(np.float32), dtype, layout)
        for shape, layout in zip(shapes, layouts, strict=True)
    ]
    scale = scale or head_dim**-0.5
    call = metal.kernel_call(*args, scale=scale)
    (out,) = msl_emu.run(**metal.kernel_spec(), **call)
    assert out.dtype == dtype and out.shape == (batch, hq, block_len, head_dim)
    want = attention64(*map(decoded, args), scale)
    return decoded(out), want


TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
CASES = [  # (S, GQA factor, head dim, block size)
    (0, 1, 64, 16),
    (0, 8, 128, 3),
    (1, 4, 64, 1),
    (1, 1, 128, 16),
    (17, 8, 64, 7),
    (17, 4, 128, 12),
    (1000, 4, 64, 16),
    (1000, 8, 128, 16),
]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("s,gqa,head_dim,block_len", CASES)
def test_kernel_matches_reference(s, gqa, head_dim, block_len, dtype):
    got, want = run_kernel(s, gqa, head_dim, block_len, dtype)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("block_len", range(1, 17))
def test_kernel_block_sizes(block_len):
    got, want = run_kernel(33, 2, 64, block_len, mx.float32, batch=2, seed=block_len)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@pytest.mark.parametrize("dropped", range(metal.load_sources()[1].count(BARRIER)))
def test_the_emulator_catches_a_dropped_barrier(monkeypatch, dropped):
    header, body = metal.load_sources()
    parts = body.split(BARRIER)
    mutated = "".join(p + (BARRIER if i not in (dropped, len(parts) - 1) else "")
                      for i, p in enumerate(parts))  # fmt: skip
    assert mutated.count(BARRIER) == body.count(BARRIER) - 1
    monkeypatch.setattr(metal, "load_sources", lambda: (header, mutated))
    for case in [(17, 8, 64, 7), (1000, 4, 64, 16), (1, 1, 128, 16)]:
        try:
            got, want = run_kernel(*case, mx.float32)
        except msl_emu.EmulatorError:
            return
        if not np.allclose(got, want, atol=TOLERANCE[mx.float32], rtol=0):
            return
    pytest.fail(f"dropping barrier {dropped} went unnoticed")


def test_kernel_large_logits():
    # Logits of +-100 and more: the running max must be rescaled across tiles (fp32
    # rounding of such logits alone moves the result by ~1e-5, a missed rescale by ~1).
    got, want = run_kernel(70, 2, 64, 16, mx.float32, seed=3, scale=4.0)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


# --- the Python wrapper, with the emulator standing in for mx.fast.metal_kernel --------


@pytest.fixture
def emulated_metal(monkeypatch):
    """Pretend Metal is available and route mx.fast.metal_kernel to the emulator."""
    built = []

    def factory(**spec):
        built.append(spec)
        return msl_emu.metal_kernel(**spec)

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(metal, "kernel_factory", factory)
    monkeypatch.setattr(kernels, "_self_check", {})
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    metal._kernel.cache_clear()
    yield built
    metal._kernel.cache_clear()


def inputs(s=20, gqa=3, dtype=mx.float32, head_dim=64):
    keys = mx.random.split(mx.random.key(7), 5)
    shapes = [(1, 2 * gqa, 16), (1, 2, s), (1, 2, s), (1, 2, 16), (1, 2, 16)]
    return [mx.random.normal((*sh, head_dim), key=k).astype(dtype) for sh, k in zip(shapes, keys)]


def test_wrapper_uses_emulated_kernel_after_self_check(emulated_metal, caplog):
    with caplog.at_level(logging.WARNING):
        assert kernels.active_backend() == "metal"
    assert not caplog.records and kernels._self_check == {"result": None}
    assert emulated_metal[0]["ensure_row_contiguous"] is False
    for dtype, tol in ((mx.float32, 1e-5), (mx.bfloat16, 3e-2)):
        args = inputs(dtype=dtype)
        got = kernels.block_attention(*args, scale=0.125)
        want = reference_attention(*[a.astype(mx.float32) for a in args], scale=0.125)
        assert got.dtype == dtype
        assert mx.abs(got.astype(mx.float32) - want).max().item() < tol


def test_wrapper_dtype_dispatch(emulated_metal, monkeypatch):
    assert kernels.active_backend() == "metal"  # self-check passes with the real kernel
    calls = []
    monkeypatch.setattr(metal, "metal_attention", lambda *a, **k: calls.append(a) or a[0])
    args = inputs()
    kernels.block_attention(*args, scale=0.1)
    assert len(calls) == 1
    mixed = [args[0], *(a.astype(mx.float16) for a in args[1:])]
    assert kernels.block_attention(*mixed, scale=0.1).dtype == mx.float32
    assert len(calls) == 1  # mixed dtypes take the reference path
    with pytest.raises(ValueError, match="head dim 80"):
        kernels.block_attention(*inputs(head_dim=80), scale=0.1, backend="metal")


BROKEN = {
    "compile error": ("simd_sum(p);", "simd_sum(p) +;"),
    "mismatch": ("row_l[t] * alpha", "row_l[t]"),
}


@pytest.mark.parametrize("bug", BROKEN)
def test_failing_self_check_falls_back_once(emulated_metal, monkeypatch, caplog, bug):
    header, body = metal.load_sources()
    old, new = BROKEN[bug]
    assert old in body
    monkeypatch.setattr(metal, "load_sources", lambda: (header, body.replace(old, new)))
    args = inputs(s=5)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            got = kernels.block_attention(*args, scale=0.125)
            assert mx.array_equal(got, reference_attention(*args, scale=0.125))
    assert len(caplog.records) == 1 and "disabled" in caplog.text
    assert kernels.active_backend() == "reference"
    with pytest.raises(RuntimeError, match="CompileError" if bug == "compile error" else "error"):
        kernels.block_attention(*args, scale=0.125, backend="metal")
