"""Bind MLX's CPU matmuls to an optimized system BLAS on Linux.

MLX's Linux CPU wheel bundles a reference BLAS (~4-6 GF/s on a 2048² fp32
matmul here). Loading Debian's OpenBLAS with RTLD_GLOBAL *before* mlx is first
imported makes MLX's `cblas_sgemm` calls resolve to it (~135-210 GF/s).

It cannot happen later, on first use: Python loads extension modules with
RTLD_NOW, so MLX's library resolves its BLAS symbols when `mlx.core` is first
imported, and a library loaded after that is never consulted (benchmarks/README.md,
"Import order").
So `dflash_mlx/__init__.py` calls `use_fast_cpu()` before anything imports mlx,
and a program must import dflash_mlx before mlx; otherwise everything works on
MLX's bundled BLAS, and `active_blas()` (`dflash-mlx info`) says why. Set
DFLASH_MLX_NO_BLAS=1 to keep MLX's bundled BLAS.

In front of OpenBLAS goes `few_rows_sgemm.c`, built once per machine with the
system C compiler, with OpenMP where it has it (cached by `native.py`):
products of up to 32 rows against a weight matrix, a decoding step's and a verify
forward's, are 2-3x cheaper there than through OpenBLAS, which copies the whole
weight matrix on every call. Everything else goes on to OpenBLAS. Set
DFLASH_MLX_NO_FEW_ROWS=1 to bind OpenBLAS alone.

How many threads each product takes, and whether it splits at all, is chosen by its measured
cost (`threads.h`): a product split over both cores of a machine where another process keeps
one busy waits for the thread that shares that core. DFLASH_MLX_THREADS=n takes up to n instead.

Both thread pools are told to sleep, not spin, while they wait for work (`QUIET_THREADS`,
unless the environment sets them, or sets GOMP_SPINCOUNT): OpenMP's idle threads otherwise
spin a while after each product and OpenBLAS's ~0.1 s after each call (a verify forward's
attention products are such calls), holding cores that the main thread, or other programs,
need. On a machine that other programs keep busy, spinning threads made decoding several
times slower (benchmarks/README.md, "A busy machine"). These are read once, when each
library starts, so they are set before either is loaded.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from . import native

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

KERNEL_SOURCE = Path(__file__).with_name("few_rows_sgemm.c")
KERNEL_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC")

_active: str | None = None
_reason = "not attempted"
_kernel: str | None = None
_kernel_reason = "not attempted"
_spinning = ""  # why idle OpenMP threads still spin, where they do
THREADED = "in front"  # the kernel's state where it runs on OpenMP's threads

# Idle threads sleep at once instead of spinning (OpenBLAS: 2**4 cycles instead of 2**28).
QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_THREAD_TIMEOUT": "4"}


def use_fast_cpu() -> None:
    """Bind OpenBLAS, with the few-row kernel in front, for MLX's CPU matmuls; only effective
    before mlx is first imported (see the module docstring)."""
    global _active, _reason
    if _active:
        return
    if not sys.platform.startswith("linux"):
        _reason = "not Linux: MLX uses Accelerate/Metal"
        return
    if os.environ.get("DFLASH_MLX_NO_BLAS", "") not in ("", "0"):
        _reason = "disabled by DFLASH_MLX_NO_BLAS"
        return
    if "mlx.core" in sys.modules:
        _reason = "mlx was imported before dflash_mlx; import dflash_mlx first"
        return
    global _spinning
    if "OMP_WAIT_POLICY" not in os.environ and _loaded("libgomp"):
        _spinning = "OpenMP started before dflash_mlx: idle threads spin (import dflash_mlx first)"
    for name, value in QUIET_THREADS.items():
        if not (name == "OMP_WAIT_POLICY" and "GOMP_SPINCOUNT" in os.environ):
            os.environ.setdefault(name, value)  # before OpenMP and OpenBLAS start
    for path in CANDIDATES:
        if os.path.exists(path):
            try:  # locally first: the kernel must come before it in the global scope
                openblas = ctypes.CDLL(path)
            except OSError as exc:
                _reason = f"failed to load {path}: {exc}"
                continue
            kernel = _kernel_library()
            if kernel is not None:
                kernel.dflash_set_fallback(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p))
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # the rest of BLAS and LAPACK for MLX
            _active = path
            _reason = "loaded"
            return
    _reason = "no OpenBLAS found (apt-get install libopenblas0-pthread)"


def _loaded(name: str) -> bool:
    """Whether a library whose file name starts with `name` is loaded in this process."""
    try:
        with open("/proc/self/maps") as maps:
            return any(f"/{name}" in line for line in maps)
    except OSError:
        return False


def _kernel_library() -> ctypes.CDLL | None:
    """The few-row kernel, built for this machine if need be and loaded globally; None
    (with the reason kept for `active_blas`) where it is disabled or cannot be built."""
    global _kernel, _kernel_reason
    if os.environ.get("DFLASH_MLX_NO_FEW_ROWS", "") not in ("", "0"):
        _kernel_reason = "disabled by DFLASH_MLX_NO_FEW_ROWS"
        return None
    try:
        path, threaded = _built_kernel()
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _kernel_reason = f"not built: {exc}"
        return None
    _kernel = str(path)
    _kernel_reason = THREADED if threaded else "in front, on one thread (no OpenMP)"
    return library


def _built_kernel() -> tuple[Path, bool]:
    """(the compiled kernel for this source, compiler and CPU, whether it is threaded),
    built once: with OpenMP, or on one thread where the compiler has none."""
    cc, source = native.compiler(), KERNEL_SOURCE.read_text()
    builds = []
    for flags in ([*KERNEL_FLAGS, "-fopenmp"], list(KERNEL_FLAGS)):
        builds.append((flags, native.cached_path("few_rows_sgemm", [source, cc, *flags])))
    for flags, path in builds:
        if path.exists():
            return path, "-fopenmp" in flags
    errors = []
    for flags, path in builds:
        try:
            _compile(cc, flags, path)
            return path, "-fopenmp" in flags
        except RuntimeError as exc:
            errors.append(str(exc))
    raise RuntimeError(errors[0])


def _compile(compiler: str, flags: list[str], path: Path) -> None:
    native.build(path, lambda out, _: [[compiler, *flags, "-o", out, str(KERNEL_SOURCE)]])


def calls_by_threads() -> list[int]:
    """How many of this process's few-row products took 1, 2, ... threads (the last entry: 16
    or more); empty where the kernel is not in front."""
    if _kernel is None:
        return []
    calls = (ctypes.c_long * 16)()
    ctypes.CDLL(_kernel).dflash_sgemm_calls_by_threads(calls, 16)
    return list(calls)


def force_threads(n: int) -> None:
    """From now on every few-row product takes up to `n` threads (0: as measured), as
    DFLASH_MLX_THREADS=n would have had it from the start: for benchmarks that compare the
    settings side by side in one process."""
    if _kernel is not None:
        ctypes.CDLL(_kernel).dflash_sgemm_force_threads(n)


def threads_setting() -> str:
    """How the kernels choose their threads, in words."""
    forced = os.environ.get("DFLASH_MLX_THREADS", "")
    if forced.isdigit() and int(forced) > 0:
        return f"threads: up to {forced} (DFLASH_MLX_THREADS)"
    return "threads chosen by measured cost"


def active_blas() -> str:
    """Which BLAS MLX's CPU matmuls use, in words (for `dflash-mlx info`)."""
    if _active:
        spinning = f"; {_spinning}" if _spinning else ""
        threads = f", {threads_setting()}" if _kernel_reason == THREADED else ""
        return f"OpenBLAS ({_active}); few-row kernel {_kernel_reason}{threads}{spinning}"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return f"MLX bundled reference BLAS ({_reason})"
