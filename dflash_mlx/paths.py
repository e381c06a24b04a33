"""Where dflash-mlx keeps what it makes once: converted models, training data, built kernels.

A leaf module (no mlx import): `native/blas.py` needs it before mlx is first imported.
"""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED_DRAFTER = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Cache root: ``$DFLASH_MLX_CACHE`` or ``~/.cache/dflash-mlx``."""
    root = os.environ.get("DFLASH_MLX_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "dflash-mlx"
