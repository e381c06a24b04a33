"""`GenerationSettings` where the library's users import it from; it lives with the loop
it configures (`decode/settings.py`)."""

from .decode.settings import PREFILL_STEP, GenerationSettings

__all__ = ["PREFILL_STEP", "GenerationSettings"]
