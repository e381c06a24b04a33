"""Target and drafter caches kept across calls, e.g. the turns of a chat."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.nn as nn

from .adaptive import AdaptiveBlock, AdaptiveTree
from .draft import DFlashDraft
from .rollback import trim_caches
from .target import TargetAdapter


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
    block_policy: AdaptiveBlock | AdaptiveTree | None = None

    def reuse(self, prompt: list[int]) -> int:
        """Trim both caches to the longest prefix shared with `prompt`; return its length.

        The length is 0 (a full prefill) when a recurrent or sliding-window cache
        cannot go back that far.
        """
        shared = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while shared < limit and self.tokens[shared] == prompt[shared]:
            shared += 1
        shared = trim_caches(self.target + self.draft, shared)
        self.tokens = self.tokens[:shared]
        return shared


def make_prompt_cache(model: nn.Module, draft: DFlashDraft | None) -> PromptCache:
    """An empty cache to pass as `prompt_cache=` to successive `stream_generate` calls."""
    return PromptCache(TargetAdapter(model).make_cache(), draft.make_cache() if draft else [])
