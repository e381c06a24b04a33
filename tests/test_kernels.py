"""Reference block attention and backend selection (no Metal, no compiler needed)."""

from pathlib import Path

import mlx.core as mx
import pytest

from dflash_mlx.native import kernels
from dflash_mlx.native.kernels import metal
from dflash_mlx.native.kernels.reference import reference_attention


def sdpa_on_concat(q, kc, vc, kb, vb, scale):
    k = mx.concatenate([kc, kb], axis=2)
    v = mx.concatenate([vc, vb], axis=2)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def make_inputs(s, n_kv_heads=2, gqa=4, block_len=16, head_dim=64, dtype=mx.float32, seed=0):
    """Context K/V as a strided slice of a larger cache buffer, like the drafter's."""
    keys = mx.random.split(mx.random.key(seed), 5)
    q = mx.random.normal((1, n_kv_heads * gqa, block_len, head_dim), key=keys[0])
    cache_k = mx.random.normal((1, n_kv_heads, s + 13, head_dim), key=keys[1])
    cache_v = mx.random.normal((1, n_kv_heads, s + 13, head_dim), key=keys[2])
    kb = mx.random.normal((1, n_kv_heads, block_len, head_dim), key=keys[3])
    vb = mx.random.normal((1, n_kv_heads, block_len, head_dim), key=keys[4])
    arrays = [q, cache_k[:, :, :s], cache_v[:, :, :s], kb, vb]
    return [a.astype(dtype) for a in arrays]


@pytest.mark.parametrize("s", [0, 1, 17, 300])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("block_len", [1, 16])
def test_reference_matches_sdpa_on_concatenation(s, gqa, block_len):
    args = make_inputs(s, gqa=gqa, block_len=block_len)
    got = reference_attention(*args, scale=0.125)
    want = sdpa_on_concat(*args, scale=0.125)
    assert got.shape == args[0].shape and got.dtype == mx.float32
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()


@pytest.mark.parametrize("dtype,tol", [(mx.float16, 5e-3), (mx.bfloat16, 3e-2)])
def test_reference_half_precision_close_to_fp32(dtype, tol):
    args = make_inputs(200, dtype=dtype)
    got = reference_attention(*args, scale=0.125)
    want = sdpa_on_concat(*[a.astype(mx.float32) for a in args], scale=0.125)
    assert got.dtype == dtype
    assert mx.abs(got.astype(mx.float32) - want).max().item() < tol


@pytest.fixture
def fresh_selection(monkeypatch):
    """Forget the per-process self-check result and any env override."""
    monkeypatch.setattr(kernels, "_self_check", {})
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


def test_backend_without_metal(fresh_selection, monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert kernels.active_backend() == "reference"
    assert kernels.active_backend("reference") == "reference"
    with pytest.raises(RuntimeError, match="not available"):
        kernels.active_backend("metal")
    monkeypatch.setenv(kernels.ENV_VAR, "metal")
    with pytest.raises(RuntimeError):
        kernels.block_attention(*make_inputs(5), scale=0.125)
    # An explicit argument wins over the environment's default.
    assert kernels.active_backend("reference") == "reference"


def test_unknown_backend_rejected(fresh_selection, monkeypatch):
    with pytest.raises(ValueError, match="Unknown kernels backend"):
        kernels.active_backend("cuda")
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ValueError):
        kernels.block_attention(*make_inputs(5), scale=0.125)


def test_env_reference_skips_self_check(fresh_selection, monkeypatch):
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(metal, "self_check", lambda: pytest.fail("self-check must not run"))
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    assert kernels.active_backend() == "reference"
    args = make_inputs(9)
    assert mx.array_equal(
        kernels.block_attention(*args, scale=0.5), reference_attention(*args, 0.5)
    )


@pytest.mark.parametrize(
    "gqa,block_len,head_dim,rb,tk,n_groups",
    [
        (1, 1, 64, 8, 32, 1),
        (1, 16, 64, 16, 32, 1),
        (4, 16, 64, 32, 32, 2),
        (8, 16, 128, 16, 16, 8),
        (3, 16, 64, 32, 32, 2),
        (8, 16, 256, 8, 8, 16),
        (2, 5, 32, 16, 32, 1),
    ],
)
def test_launch_config(gqa, block_len, head_dim, rb, tk, n_groups):
    template, grid, threadgroup = metal.launch_config(
        2, 3 * gqa, 3, block_len, head_dim, mx.float16
    )
    t = dict(template)
    assert t == {"T": mx.float16, "D": head_dim, "TK": tk, "RB": rb, "NT": metal.THREADS}
    assert threadgroup == (metal.THREADS, 1, 1)
    assert grid == (metal.THREADS * n_groups, 3, 2)
    # Invariants the kernel body relies on.
    n_simd = t["NT"] // 32
    assert t["RB"] % n_simd == 0 and (t["RB"] * t["D"]) % t["NT"] == 0 and t["TK"] <= 32
    assert n_groups * t["RB"] >= gqa * block_len
    tg_floats = (t["RB"] + 2 * t["TK"]) * t["D"] + t["RB"] * t["TK"] + 2 * t["RB"]
    assert tg_floats * 4 <= 32 * 1024


def test_supports():
    args = make_inputs(4)
    assert metal.supports(*args)
    assert not metal.supports(*[a.astype(mx.int32) for a in args])
    assert not metal.supports(args[0].astype(mx.float16), *args[1:])
    assert not metal.supports(*make_inputs(4, head_dim=80))


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs an Apple GPU (Metal)")
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-4), (mx.float16, 5e-3), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "s,gqa,head_dim,block_len", [(0, 1, 64, 16), (17, 8, 128, 3), (1000, 4, 64, 16)]
)
def test_metal_kernel_on_gpu(s, gqa, head_dim, block_len, dtype, tol):
    args = make_inputs(s, gqa=gqa, block_len=block_len, head_dim=head_dim, dtype=dtype)
    got = kernels.block_attention(*args, scale=head_dim**-0.5, backend="metal")
    want = sdpa_on_concat(*[a.astype(mx.float32) for a in args], scale=head_dim**-0.5)
    assert got.dtype == dtype
    assert mx.abs(got.astype(mx.float32) - want).max().item() < tol


def test_kernel_sources_are_package_data():
    """The wheel ships every file load_sources reads (pyproject's package-data globs)."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["dflash_mlx.native.kernels"]
    package_dir = Path(metal.__file__).parent
    shipped = {p.relative_to(package_dir) for g in globs for p in package_dir.glob(g)}
    needed = {(metal.SOURCE_DIR / n).relative_to(package_dir) for n in metal.SOURCE_FILES}
    assert needed <= shipped
    assert all("dflash" in source for source in metal.load_sources())
