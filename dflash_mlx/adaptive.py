"""Adaptive drafting: decode plainly while drafting does not pay, probe back later.

A speculative cycle pays when the tokens it commits (τ) would have cost more as
autoregressive steps than the cycle itself: τ × t_AR > t_cycle. The policy keeps
running averages of τ, of the speculative cycle time and of the plain (block 1)
step time, all measured by the loop as it goes. When drafting stops paying it
switches to block 1 for a stretch of tokens, then drafts again to re-measure;
each failed probe doubles the stretch. The block size never changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveBlock:
    block_size: int
    smoothing: float = 0.3  # weight of the newest cycle in the running averages
    warmup: int = 2  # speculative cycles before the first judgement
    probe: int = 1  # speculative cycles that re-judge after a plain stretch
    min_backoff: int = 16  # plain tokens after the first failed judgement
    max_backoff: int = 256
    tau: float | None = None
    cycle_seconds: float | None = None
    step_seconds: float | None = None
    plain_left: int = 0
    backoff: int = 0
    judged_cycles: int = 0
    measuring: bool = False

    def __post_init__(self) -> None:
        self.backoff = self.min_backoff

    def next_block_size(self) -> int:
        if self.plain_left > 0:
            return 1
        if self.step_seconds is None and self.judged_cycles >= self.warmup:
            self.plain_left, self.measuring = 2, True  # what does a plain step cost here?
            return 1
        return self.block_size

    def record(self, block_size: int, committed: int, seconds: float) -> None:
        """One finished cycle: its block size, the tokens it committed and its wall time."""
        if block_size == 1:
            self.step_seconds = self._average(self.step_seconds, seconds)
            self.plain_left = max(0, self.plain_left - 1)
            if self.plain_left == 0 and self.measuring:
                self.measuring = False
                self._judge()
            elif self.plain_left == 0:  # a plain stretch ended: probe afresh
                self.judged_cycles = self.warmup - self.probe
                self.tau, self.cycle_seconds = None, None
            return
        self.tau = self._average(self.tau, committed)
        self.cycle_seconds = self._average(self.cycle_seconds, seconds)
        self.judged_cycles += 1
        if self.judged_cycles >= self.warmup and self.step_seconds is not None:
            self._judge()

    def _judge(self) -> None:
        if self.pays():
            self.backoff = self.min_backoff
        else:
            self.plain_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)

    def pays(self) -> bool:
        return self.tau * self.step_seconds >= self.cycle_seconds

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new
