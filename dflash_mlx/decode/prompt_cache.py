"""Target and drafter caches kept across calls, e.g. the turns of a chat."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from ..models.draft import DFlashDraft
from ..models.rollback import trim_caches
from ..models.target import TargetAdapter
from .adaptive import AdaptiveBlock, AdaptiveStrategy, AdaptiveTree


@dataclass
class PromptCache:
    """Target and drafter caches kept across calls, e.g. the turns of a chat.

    `tokens` are the positions both caches hold. A later prompt that starts with
    them is prefilled only from where it differs; anything beyond (a reply cut
    short, a re-rendered template) is trimmed away first. `block_policy` is what
    the adaptive block size (or tree size) learned so far, so the next call goes on from it.
    """

    target: list
    draft: list
    tokens: list[int] = field(default_factory=list)
    block_policy: AdaptiveBlock | AdaptiveTree | AdaptiveStrategy | None = None

    def reuse(self, prompt: list[int]) -> int:
        """Trim both caches to the longest prefix shared with `prompt`; return its length.

        The length is 0 (a full prefill) when a recurrent, sliding-window or quantized
        cache cannot go back that far.
        """
        shared = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while shared < limit and self.tokens[shared] == prompt[shared]:
            shared += 1
        shared = trim_caches(self.target + self.draft, shared)
        self.tokens = self.tokens[:shared]
        return shared


# The `stream_generate` settings that make the target's caches (mlx-lm's `generate_step`'s).
CACHE_SETTINGS = ("max_kv_size", "kv_bits", "kv_group_size", "quantized_kv_start")


def make_prompt_cache(
    model: nn.Module,
    draft: DFlashDraft | None,
    *,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
) -> PromptCache:
    """An empty cache to pass as `prompt_cache=` to successive `stream_generate` calls, made
    with the `CACHE_SETTINGS` those calls use (their meanings: `TargetAdapter.make_cache`)."""
    target = TargetAdapter(model).make_cache(
        max_kv_size, kv_bits, kv_group_size, quantized_kv_start
    )
    return PromptCache(target, draft.make_cache() if draft else [])


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PromptCacheStore:
    """The prompt caches of several conversations, least recently used first out.

    A server keeps one per conversation prefix it has answered: the next turn of any of
    them reuses its cache and is prefilled only from where it differs. Bounded by
    `max_size` caches and `max_bytes` of cached arrays (target and drafter together).
    """

    def __init__(self, make: Callable[[], PromptCache], max_size: int, max_bytes: int):
        self.make, self.max_size, self.max_bytes = make, max_size, max_bytes
        self.entries: list[PromptCache] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(map(cache_bytes, self.entries))

    def take(self, prompt: list[int]) -> PromptCache:
        """The cache sharing the longest prefix with `prompt` (or a new one), for the caller
        to generate with and `put` back. One holding more than the shared prefix stays
        here for its own conversation: the caller gets a copy (its `reuse` trims it)."""
        best = max(self.entries, key=lambda e: shared_prefix(e.tokens, prompt), default=None)
        shared = shared_prefix(best.tokens, prompt) if best else 0
        if not shared:  # a new conversation: it goes on from what the last one learned
            fresh = self.make()
            fresh.block_policy = self.entries[-1].block_policy if self.entries else None
            return fresh
        if shared < len(best.tokens):
            return copy.deepcopy(best)
        self.entries.remove(best)
        return best

    def put(self, cache: PromptCache) -> None:
        """Keep `cache` as the most recently used, dropping the caches it extends and then
        the least recently used while over the bounds."""
        self.entries = [
            e for e in self.entries if shared_prefix(e.tokens, cache.tokens) < len(e.tokens)
        ]
        self.entries.append(cache)
        while len(self.entries) > self.max_size or (
            len(self.entries) > 1 and self.nbytes > self.max_bytes
        ):
            self.entries.pop(0)
        if self.nbytes > self.max_bytes:
            self.entries.clear()


def cache_bytes(cache: PromptCache) -> int:
    """Bytes of the arrays `cache` holds, target and drafter."""
    return sum(c.nbytes for c in cache.target + cache.draft)
