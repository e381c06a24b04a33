"""DFlash block-diffusion speculative decoding for MLX."""

from .blas import active_blas, use_fast_cpu

use_fast_cpu()  # before anything imports mlx: see blas.py

from .checkpoint import load_draft  # noqa: E402
from .draft import DFlashConfig, DFlashDraft  # noqa: E402
from .generate import generate, stream_generate  # noqa: E402
from .loop import make_batch  # noqa: E402
from .prompt_cache import PromptCache, make_prompt_cache  # noqa: E402
from .response import GenerationResponse  # noqa: E402
from .settings import GenerationSettings  # noqa: E402
from .target import TargetAdapter, load  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "DFlashConfig",
    "DFlashDraft",
    "GenerationResponse",
    "GenerationSettings",
    "PromptCache",
    "TargetAdapter",
    "active_blas",
    "generate",
    "load",
    "load_draft",
    "make_batch",
    "make_prompt_cache",
    "stream_generate",
]
