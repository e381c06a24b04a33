"""DFlash block-diffusion speculative decoding for MLX."""

import warnings

# `python -m dflash_mlx.generate` or `python -m dflash_mlx.cli.<command>` runs a module its
# package imports: runpy warns that it then exists twice, which is moot here, as that
# module hands its command line to the CLI at once.
warnings.filterwarnings(
    "ignore", r"'dflash_mlx\.(generate|cli\.\w+)' found in sys\.modules", RuntimeWarning
)

from .native.blas import active_blas, use_fast_cpu  # noqa: E402

use_fast_cpu()  # before anything imports mlx: see blas.py

from .decode.prompt_cache import PromptCache, make_prompt_cache  # noqa: E402
from .decode.scheduler import make_batch  # noqa: E402
from .decode.settings import GenerationSettings  # noqa: E402
from .generate import generate, stream_generate  # noqa: E402
from .models.checkpoint import load_draft  # noqa: E402
from .models.draft import DFlashConfig, DFlashDraft  # noqa: E402
from .models.target import TargetAdapter, load  # noqa: E402
from .response import GenerationResponse  # noqa: E402

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
