"""DFlash block-diffusion speculative decoding for MLX."""

from . import blas  # noqa: F401  (must bind the system BLAS before mlx is imported)
from .blas import active_blas
from .checkpoint import load_draft
from .draft import DFlashConfig, DFlashDraft
from .generate import (
    GenerationResponse,
    PromptCache,
    generate,
    make_prompt_cache,
    stream_generate,
)
from .target import TargetAdapter, load

__version__ = "0.1.0"
__all__ = [
    "DFlashConfig",
    "DFlashDraft",
    "GenerationResponse",
    "PromptCache",
    "TargetAdapter",
    "active_blas",
    "generate",
    "load",
    "load_draft",
    "make_prompt_cache",
    "stream_generate",
]
