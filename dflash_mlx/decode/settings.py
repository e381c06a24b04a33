"""How a reply is decoded: block size, trees, adaptation, sampling, limits.

One `GenerationSettings` is validated when it is made, then handed as it is
from the CLI, the server, chat, bench and the demo to `stream_generate`; the
keyword arguments of `stream_generate` build one the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from ..models.distributed import world_group
from .prompt_cache import CACHE_SETTINGS
from .sampling import LogitsProcessor, Sampler, Verifier, make_verifier

PREFILL_STEP = 2048  # prompt tokens per prefill forward by default, as mlx-lm's


@dataclass(frozen=True)
class GenerationSettings:
    """`block_size` defaults to the drafter's (1: plain decoding through the same loop);
    `tree_budget` verifies trees of up to that many draft tokens instead of chains;
    `adaptive` sizes each cycle by measured cost; with none of the three set, each cycle
    chooses a chain or a tree by measured cost (`AdaptiveStrategy`); `prompt_lookup`
    grafts the prompt lookup's chain onto every tree.
    Sampling follows mlx-lm's `make_sampler`, XTC's `xtc_special_tokens` included (mlx-lm's
    commands pass a newline and the EOS tokens); `acceptance` is the rule for sampled
    drafts (`decode/sampling.py`; "coupled" leaves the reply independent of the cycles' shapes, so
    the clock may choose them); `logits_processors` are mlx-lm's. With a `seed` (0 to
    2**32 - 1) every random draw comes from these settings' own stream from that seed
    instead of MLX's global state, so a seeded reply is the same whatever samples beside
    it; replies made with one settings object continue its stream, and a copy with
    changes (`but`) starts its own.
    The target's caches and prefill take mlx-lm's `generate_step` keywords with their
    meanings and defaults: `max_kv_size` (a rotating cache of that many positions), `kv_bits`,
    `kv_group_size` and `quantized_kv_start` (the cache quantized once it holds that many
    positions), `prefill_step_size` (the prompt run in chunks of that many tokens)."""

    max_tokens: int = 256
    block_size: int | None = None
    tree_budget: int | None = None
    adaptive: bool | None = None
    prompt_lookup: bool = True
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()
    sampler: Sampler | None = None
    acceptance: str = "coupled"
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    seed: int | None = None
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    prefill_step_size: int = PREFILL_STEP
    # the rule that proposes drafts and accepts them under these sampling settings
    verifier: Verifier = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.tree_budget is not None and self.tree_budget < 1:
            raise ValueError(f"tree_budget must be at least 1, got {self.tree_budget}")
        check_cache_settings(self)
        object.__setattr__(self, "logits_processors", list(self.logits_processors or []))
        verifier = make_verifier(  # the sampling settings' own checks too
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.sampler,
            self.acceptance,
            self.logits_processors,
            self.seed,
            self.min_tokens_to_keep,
            self.xtc_probability,
            self.xtc_threshold,
            self.xtc_special_tokens,
        )
        object.__setattr__(self, "verifier", verifier)

    def but(self, **changes: Any) -> GenerationSettings:
        """A copy with `changes` (validated again)."""
        return replace(self, **changes) if changes else self

    @property
    def cache_options(self) -> dict[str, Any]:
        """The fields that make the target's caches, as `make_prompt_cache` takes them: a
        cache made elsewhere (a chat's, a server's) must be made with these to honour them."""
        return {name: getattr(self, name) for name in CACHE_SETTINGS}

    @property
    def timed(self) -> bool:
        """Whether measured times may choose the block sizes: only where the sizes change
        nothing but speed: greedy, or sampled under the coupled rule (keyed by position). A
        cycle sampled by another rule consumes random draws by its size, and ranks in
        lockstep (`mlx.launch`) must choose alike; both cost the sizes from a fixed table."""
        shapeless = self.temperature == 0 or self.acceptance == "coupled"
        return shapeless and self.sampler is None and world_group() is None


KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
MAX_POSITIONS = 2**31 - 1  # MLX indexes a cache's positions with 32-bit integers
KV_GROUP_SIZES = (32, 64, 128)


def check_cache_settings(settings: GenerationSettings) -> None:
    """Raise a one-line ValueError naming the first cache or prefill setting out of bounds."""
    if settings.max_kv_size is not None:
        check_count("max_kv_size", settings.max_kv_size, 1, MAX_POSITIONS)
    check_count("prefill_step_size", settings.prefill_step_size, 1)
    check_count("quantized_kv_start", settings.quantized_kv_start, 0, MAX_POSITIONS)
    bits, group_size = settings.kv_bits, settings.kv_group_size
    if bits is not None and not (is_int(bits) and bits in KV_BITS):
        raise ValueError(f"kv_bits must be one of {KV_BITS} (or None), got {bits!r}")
    if not (is_int(group_size) and group_size in KV_GROUP_SIZES):
        raise ValueError(f"kv_group_size must be one of {KV_GROUP_SIZES}, got {group_size!r}")


def check_count(name: str, value: Any, least: int, most: int | None = None) -> None:
    if not is_int(value) or value < least:
        raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be at most {most}, got {value!r}")


def is_int(value: Any) -> bool:
    """Whether `value` is an int proper (not 4.0, not True)."""
    return isinstance(value, int) and not isinstance(value, bool)
