"""The few-row sgemm kernel bound in front of OpenBLAS (`few_rows_sgemm.c`, `blas.py`)."""

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx  # conftest imported dflash_mlx first: the BLAS is bound
import numpy as np
import pytest

from dflash_mlx.native import blas

OPENBLAS = any(os.path.exists(p) for p in blas.CANDIDATES)
BUILDABLE = sys.platform.startswith("linux") and OPENBLAS and shutil.which("cc") is not None
needs_kernel = pytest.mark.skipif(not BUILDABLE, reason="needs Linux, OpenBLAS and a C compiler")


def rel_error(got: mx.array, want: np.ndarray) -> float:
    return float(np.abs(np.array(got, dtype=np.float64) - want).max() / np.abs(want).max())


@needs_kernel
def test_the_kernel_is_what_mlx_calls():
    """`cblas_sgemm` in the global scope (where MLX's library finds it) is the kernel's."""
    assert blas._kernel is not None, blas._kernel_reason
    kernel = ctypes.CDLL(blas._kernel)
    address = ctypes.cast(kernel.cblas_sgemm, ctypes.c_void_p).value
    assert ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value == address
    assert "few-row kernel in front" in blas.active_blas()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 24, 32, 33])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (37, 100), (300, 7)])
def test_products_with_few_rows_match_float64(rows, shape):
    """Both ways round (few rows of x against W's rows, and W against few rows), odd K and N
    (lane and tile remainders), 1-4 rows (dot products), 5-16 and 17-32 (one or two packed
    vectors on AVX-512), 33 rows (past the kernel's limit): float64's result."""
    rng = np.random.default_rng(rows * 1000 + shape[1])
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((rows, shape[1])).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert rel_error(mx.array(x) @ mx.array(w).T, want) < 1e-5
    assert rel_error(mx.array(w) @ mx.array(x).T, want.T) < 1e-5


@needs_kernel
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("shape", [(1536, 576), (300, 37), (4, 64), (3, 100)])
def test_every_row_of_a_product_has_the_bits_it_has_alone(rows, shape):
    """A verify forward's products against a decoding step's: each row of x @ W.T (and of
    W @ x.T) bit for bit what that row alone gives, at every row count, odd K (lane
    remainders), fewer rows of W than of x (a MoE gate's 4 experts) and square products.
    Greedy output equal to mlx-lm's rests on it where two tokens nearly tie."""
    rng = np.random.default_rng(rows + shape[0])
    x = mx.array(rng.standard_normal((rows, shape[1])).astype(np.float32))
    w = mx.array(rng.standard_normal(shape).astype(np.float32))
    alone = mx.concatenate([x[i : i + 1] @ w.T for i in range(rows)])
    assert mx.array_equal(x @ w.T, alone).item()
    alone = mx.concatenate([w @ x[i : i + 1].T for i in range(rows)], axis=1)
    assert mx.array_equal(w @ x.T, alone).item()


def test_scaled_accumulating_batched_and_strided_products():
    """addmm's alpha and beta (C is read only when beta is not 0), a batch of products
    (attention's scores: few queries against many keys per head), a sliced operand."""
    rng = np.random.default_rng(0)
    for rows in (7, 20, 3):  # the last one's a is used below
        a = rng.standard_normal((rows, 200)).astype(np.float32)
        b = rng.standard_normal((500, 200)).astype(np.float32)
        c = rng.standard_normal((rows, 500)).astype(np.float32)
        want = 0.5 * (a.astype(np.float64) @ b.T) + 2.0 * c
        got = mx.addmm(mx.array(c), mx.array(a), mx.array(b).T, alpha=0.5, beta=2.0)
        assert rel_error(got, want) < 1e-5
    q = rng.standard_normal((2, 9, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, 9, 260, 64)).astype(np.float32)
    want = q.astype(np.float64) @ k.swapaxes(-1, -2)
    assert rel_error(mx.array(q) @ mx.array(k).swapaxes(-1, -2), want) < 1e-5
    wide = rng.standard_normal((700, 300)).astype(np.float32)
    got = mx.array(a) @ mx.array(wide)[:, 50:250].T
    assert rel_error(got, a.astype(np.float64) @ wide[:, 50:250].T) < 1e-5


def _in_process(code: str, **env: str) -> str:
    """`code`'s output in a fresh Python whose environment is this one's (less the thread
    settings importing dflash_mlx here made) with `env` over it."""
    own = {k: v for k, v in os.environ.items() if k not in blas.QUIET_THREADS}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**own, **env},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


PRODUCT = """
import dflash_mlx, mlx.core as mx
print(dflash_mlx.active_blas())
x, w = mx.arange(6.0).reshape(2, 3), mx.arange(12.0).reshape(4, 3)
print((x @ w.T).tolist())
"""


@needs_kernel
def test_disabled_or_unbuildable_kernel_leaves_openblas_alone(tmp_path):
    """DFLASH_MLX_NO_FEW_ROWS=1, or a compiler that fails (a fresh cache, so nothing cached
    is loaded): OpenBLAS is bound without the kernel, says why, and products are the same."""
    want = "[[5.0, 14.0, 23.0, 32.0], [14.0, 50.0, 86.0, 122.0]]"
    out = _in_process(PRODUCT, DFLASH_MLX_NO_FEW_ROWS="1").splitlines()
    assert out[0].startswith("OpenBLAS") and "disabled by DFLASH_MLX_NO_FEW_ROWS" in out[0]
    assert out[1] == want
    out = _in_process(PRODUCT, CC="false", DFLASH_MLX_CACHE=str(tmp_path)).splitlines()
    assert out[0].startswith("OpenBLAS") and "few-row kernel not built: false failed" in out[0]
    assert out[1] == want
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind
    out = _in_process(PRODUCT, DFLASH_MLX_CACHE=str(tmp_path)).splitlines()
    assert "few-row kernel in front" in out[0] and out[1] == want
    assert len(list(tmp_path.rglob("few_rows_sgemm-*.so"))) == 1


# a product the kernel takes (5 rows), against float64: its relative error
RANDOM_PRODUCT = """
import numpy as np
rng = np.random.default_rng(1)
x, w = (rng.standard_normal(shape).astype(np.float32) for shape in ((5, 300), (700, 300)))
got, want = np.array(mx.array(x) @ mx.array(w).T, np.float64), x.astype(np.float64) @ w.T
print(np.abs(got - want).max() / np.abs(want).max())
"""


@needs_kernel
def test_a_compiler_without_openmp_builds_a_one_thread_kernel(tmp_path):
    """A compiler that refuses -fopenmp (clang without libomp): the kernel is built without
    it, runs on one thread, says so, and is found in the cache by the next import."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(
        '#!/bin/sh\nfor a in "$@"; do\n'
        '  [ "$a" = -fopenmp ] && { echo "no omp.h" >&2; exit 1; }\ndone\n'
        f'exec {shutil.which("cc")} "$@"\n'
    )
    cc.chmod(0o755)
    env = {"CC": str(cc), "DFLASH_MLX_CACHE": str(tmp_path / "cache")}
    for _ in range(2):  # built, then found in the cache
        out = _in_process(PRODUCT + RANDOM_PRODUCT, **env).splitlines()
        assert "few-row kernel in front, on one thread (no OpenMP)" in out[0]
        assert out[1] == "[[5.0, 14.0, 23.0, 32.0], [14.0, 50.0, 86.0, 122.0]]"
        assert float(out[2]) < 1e-5
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 1


@needs_kernel
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 vector extensions")
def test_the_kernel_built_for_avx2_alone_matches_float64(tmp_path):
    """The kernel as an x86 machine without AVX-512 builds it (8 lanes: dot products for 1-4
    and 17-32 rows, packed columns for 5-16), loaded on its own and called directly: float64's
    result, and each row's bits those of that row alone."""
    path = tmp_path / "avx2.so"
    blas._compile(shutil.which("cc"), [*blas.KERNEL_FLAGS, "-mno-avx512f"], path)
    kernel = ctypes.CDLL(str(path))
    openblas = ctypes.CDLL(next(p for p in blas.CANDIDATES if os.path.exists(p)))
    kernel.dflash_set_fallback(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p))
    pointer, size = np.ctypeslib.ndpointer(np.float32, flags="C"), ctypes.c_int
    kernel.cblas_sgemm.argtypes = [size] * 6 + [ctypes.c_float, pointer, size, pointer, size]
    kernel.cblas_sgemm.argtypes += [ctypes.c_float, pointer, size]
    rng = np.random.default_rng(2)
    for rows in (1, 4, 5, 8, 9, 13, 16, 17, 32):
        for n, k in ((300, 100), (37, 7)):
            a = rng.standard_normal((rows, k)).astype(np.float32)
            b = rng.standard_normal((n, k)).astype(np.float32)
            c = rng.standard_normal((rows, n)).astype(np.float32)
            want = 0.5 * (a.astype(np.float64) @ b.T) + 2.0 * c
            alone = [c[i : i + 1].copy() for i in range(rows)]
            for i, row in enumerate(alone):
                kernel.cblas_sgemm(101, 111, 112, 1, n, k, 0.5, a[i : i + 1], k, b, k, 2.0, row, n)
            kernel.cblas_sgemm(101, 111, 112, rows, n, k, 0.5, a, k, b, k, 2.0, c, n)
            assert np.abs(c - want).max() / np.abs(want).max() < 1e-5, (rows, n, k)
            assert np.array_equal(c, np.concatenate(alone)), (rows, n, k)  # bit for bit


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCHMARKS,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@needs_kernel
def test_blas_matmul_benchmark_times_both_bindings():
    out = _script("blas_matmul.py", "--rounds", "1", "--rows", "1,2", "--no-bundled")
    rows = {line[:26].strip(): line for line in out.splitlines()[1:]}
    assert set(rows) == {"OpenBLAS alone", "OpenBLAS + few-row kernel"}
    for line in rows.values():  # GF/s, then 2 sizes x 3 weight shapes in ms
        numbers = [float(v) for v in line[26:].replace("GF/s", "").replace("|", " ").split()]
        assert len(numbers) == 7 and all(v > 0 for v in numbers)


def test_verify_forward_benchmark_runs_on_a_model_dir(make_pair):
    target, _ = make_pair("llama-tied-gqa")
    out = _script(
        "verify_forward.py",
        "--model",
        str(target),
        "--rounds",
        "1",
        "--sizes",
        "1,3",
        "--context",
        "20",
    )
    assert out.startswith("BLAS: ")
    for variant in ("mlx-lm forward", "verify forward"):
        for stat in ("median", "min"):
            assert re.search(rf"{variant}, {stat} +[\d.]+ \(1\.00\) +[\d.]+ \([\d.]+\)", out)


IDLE = """
import os, resource, time
import dflash_mlx, mlx.core as mx
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
print(dflash_mlx.active_blas())
a, w = mx.ones((4, 1536)), mx.ones((4608, 1536))  # the few-row kernel, threaded
big = mx.ones((256, 1536))  # OpenBLAS, threaded
for _ in range(3):
    mx.eval(a @ w.T, big @ w.T)
used = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
before = used()
time.sleep(0.5)
print(used() - before)
"""


@needs_kernel
def test_idle_kernel_threads_sleep_instead_of_spinning():
    """Between products the few-row kernel's and OpenBLAS's threads sleep (a busy machine's
    cores go to whoever needs them), unless the environment chose otherwise."""
    quiet, binding, idle_cpu = _in_process(IDLE).splitlines()
    assert quiet == "PASSIVE 4" and "few-row kernel in front" in binding
    assert float(idle_cpu) < 0.05  # CPU seconds used by the process while it slept 0.5 s
    chosen = _in_process(IDLE, OMP_WAIT_POLICY="active", OPENBLAS_THREAD_TIMEOUT="20")
    assert chosen.splitlines()[0] == "active 20"
    assert _in_process(IDLE, GOMP_SPINCOUNT="1000").splitlines()[0] == "None 4"
    first = "import ctypes.util, ctypes; ctypes.CDLL(ctypes.util.find_library('gomp'))\n"
    late = _in_process(first + IDLE).splitlines()[1]
    assert "OpenMP started before dflash_mlx" in late
