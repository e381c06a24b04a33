"""What `stream_generate` yields, one per verify cycle."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class GenerationResponse:
    """One verify cycle's output (the first response carries the prefill's token).

    Args:
        text: the new text segment.
        tokens: token ids committed in this cycle (an EOS that stopped generation included).
        accepted: draft tokens accepted in this cycle.
        proposed: draft tokens proposed in this cycle (block size - 1; 0 for the prefill).
        prompt_tokens, prompt_tps: prompt length and prefill speed.
        generation_tokens, generation_tps: tokens generated so far and their rate.
        peak_memory: peak memory so far in GB.
        finish_reason: None, "stop" (EOS) or "length" (max_tokens).
        logprobs: (len(tokens), vocab) the target's log-probabilities (after the logits
            processors, before temperature) at each token's position, as mlx-lm's
            `logprobs`; lazy, so computed only if read.
    """

    text: str
    tokens: list[int]
    accepted: int
    proposed: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: str | None = None
    logprobs: mx.array | None = None

    @property
    def token(self) -> int:
        """The last committed token, as in mlx-lm's response."""
        return self.tokens[-1]
