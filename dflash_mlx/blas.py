"""Bind MLX's CPU matmuls to an optimized system BLAS on Linux.

MLX's Linux CPU wheel bundles a reference BLAS (~4-6 GF/s on a 2048² fp32
matmul here). Loading Debian's OpenBLAS with RTLD_GLOBAL *before* mlx is first
imported makes MLX's `cblas_sgemm` calls resolve to it (~135-210 GF/s). This
module must therefore be imported before `mlx.core`; `dflash_mlx/__init__.py`
does so first thing. Set DFLASH_MLX_NO_BLAS=1 to keep MLX's bundled BLAS.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_active: str | None = None
_reason = "not attempted"


def _bind() -> None:
    global _active, _reason
    if not sys.platform.startswith("linux"):
        _reason = "not Linux: MLX uses Accelerate/Metal"
        return
    if os.environ.get("DFLASH_MLX_NO_BLAS", "") not in ("", "0"):
        _reason = "disabled by DFLASH_MLX_NO_BLAS"
        return
    if "mlx.core" in sys.modules:
        _reason = "mlx was imported before dflash_mlx; import dflash_mlx first"
        return
    for path in CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                _reason = f"failed to load {path}: {exc}"
                continue
            _active = path
            _reason = "loaded"
            return
    _reason = "no OpenBLAS found (apt-get install libopenblas0-pthread)"


def active_blas() -> str:
    """Which BLAS MLX's CPU matmuls use, in words (for `dflash-mlx info`)."""
    if _active:
        return f"OpenBLAS ({_active})"
    if sys.platform == "darwin":
        return "Accelerate (macOS)"
    return f"MLX bundled reference BLAS ({_reason})"


_bind()
