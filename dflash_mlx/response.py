"""What `stream_generate` yields, one per verify cycle."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


@dataclass
class Drafting:
    """How a reply's cycles so far were decoded: chains, trees or plain steps, and, where
    drafting was off, since which cycle and why.

    Drafting is off when a cycle verifies no draft: the reply has no drafter, or the
    cost-measuring default found that drafting did not pay for this cycle on this machine
    (a busy machine, a long context or a drafter the text defeats make a cycle dearer or
    its drafts rarer); it keeps probing and drafts again once it pays.
    """

    chains: int = 0
    trees: int = 0
    plain: int = 0
    shared: int = 0  # cycles verified in one forward with other replies'
    shared_trees: int = 0  # of which this reply's part was a tree
    off_since: int | None = None  # the first cycle of the current run of plain steps
    reason: str | None = None  # why cycles were plain, where any were
    note: str | None = None  # what limited the strategy (e.g. a target that cannot take trees)

    @property
    def cycles(self) -> int:
        return self.chains + self.trees + self.plain

    @property
    def strategy(self) -> str:
        """The kinds of cycle run, most frequent first, e.g. "trees 40, chains 3, plain 2"."""
        kinds = {"trees": self.trees, "chains": self.chains, "plain": self.plain}
        ran = sorted((n, kind) for kind, n in kinds.items() if n)
        return ", ".join(f"{kind} {n}" for n, kind in reversed(ran)) or "none"

    def record(
        self, proposed: int, accepted: int, tree: bool, last: bool = False, rows: int = 1
    ) -> None:
        """One cycle after the prefill: `proposed` drafts verified, as a tree or a chain, of
        which `accepted` were taken, in a cycle of `rows` replies. A reply's `last` cycle may
        have room for one token only, so its plain step says nothing of drafting; a drafted
        cycle among plain steps that accepts nothing is a probe, and drafting stays off."""
        if rows > 1:
            self.shared += 1
            self.shared_trees += tree
        if not proposed:
            if self.off_since is None and not last:
                self.off_since = self.cycles
            self.plain += 1
            return
        if accepted:
            self.off_since = None
        if tree:
            self.trees += 1
        else:
            self.chains += 1

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "chain_cycles": self.chains,
            "tree_cycles": self.trees,
            "plain_cycles": self.plain,
            "shared_cycles": self.shared,
            "shared_tree_cycles": self.shared_trees,
            "drafting_off_since_cycle": None if self.off_since is None else self.off_since + 1,
            "drafting_off_reason": self.reason if self.plain else None,
            "drafting_note": self.note,
        }

    def summary(self) -> str:
        """One line for a stats display."""
        line = self.strategy
        if self.off_since is not None:
            line += f"; off since cycle {self.off_since + 1}: {self.reason}"
        return f"{line}; {self.note}" if self.note else line


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
        drafting: the reply's cycles so far by kind, and why drafting was off where it was.
        sources: where `text` came from, in order: runs of (characters, whether the cycle's
            accepted drafts made them readable, else the target's own token); a cycle's
            drafts come before its token, so it has at most one run of each.
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
    drafting: Drafting | None = None
    sources: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def token(self) -> int:
        """The last committed token, as in mlx-lm's response."""
        return self.tokens[-1]


def cut_sources(
    sources: list[tuple[int, bool]], chars: int
) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """`sources` (runs of characters, as `GenerationResponse.sources`) split after the first
    `chars` characters: what is kept of a text cut there, and what is held back."""
    head, tail = [], []
    for count, drafted in sources:
        taken = min(count, max(chars, 0))
        chars -= taken
        head += [(taken, drafted)] if taken else []
        tail += [(count - taken, drafted)] if count > taken else []
    return head, tail


RULE = "=" * 10  # what mlx_lm.generate prints before and after the reply when verbose


@dataclass
class ReplyStats:
    """Counters over one reply's responses.

    The first response carries the prefill's token, so τ (committed tokens per
    verify cycle) counts the responses after it.
    """

    start: float = field(default_factory=time.perf_counter)
    ttft: float = 0.0
    cycles: int = 0
    accepted: int = 0
    proposed: int = 0
    text: str = ""
    last: GenerationResponse | None = None

    def add(self, response: GenerationResponse) -> None:
        if self.last is None:
            self.ttft = time.perf_counter() - self.start
        else:
            self.cycles += 1
        self.accepted += response.accepted
        self.proposed += response.proposed
        self.text += response.text
        self.last = response

    @property
    def tokens(self) -> int:
        return self.last.generation_tokens if self.last else 0

    @property
    def tau(self) -> float:
        return (self.tokens - 1) / self.cycles if self.cycles else 0.0

    def as_dict(self) -> dict[str, Any]:
        last = self.last
        return {
            "prompt_tokens": last.prompt_tokens if last else 0,
            "prompt_tps": last.prompt_tps if last else 0.0,
            "generation_tokens": self.tokens,
            "generation_tps": last.generation_tps if last else 0.0,
            "ttft": self.ttft,
            "cycles": self.cycles,
            "tau": self.tau,
            "accepted": self.accepted,
            "proposed": self.proposed,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "peak_memory_gb": last.peak_memory if last else 0.0,
            "finish_reason": last.finish_reason if last else None,
            **(last.drafting.as_dict() if last and last.drafting else {}),
        }

    def verbose_report(self) -> str:
        """What follows the reply where mlx_lm.generate is verbose: its rule, then its three
        stats lines as it words and rounds them (or its note that there was no text), so
        that what parses its output parses ours; then a line on what drafting did."""
        if not self.text:
            return f"{RULE}\nNo text generated for this prompt"
        d = self.as_dict()
        return (
            f"{RULE}\n"
            f"Prompt: {d['prompt_tokens']} tokens, {d['prompt_tps']:.3f} tokens-per-sec\n"
            f"Generation: {d['generation_tokens']} tokens, "
            f"{d['generation_tps']:.3f} tokens-per-sec\n"
            f"Peak memory: {d['peak_memory_gb']:.3f} GB\n"
            f"{self.speculation()}"
        )

    def speculation(self) -> str:
        """What drafting did, in plain words: tokens per verify cycle, how many of the reply's
        tokens came from accepted drafts, the kinds of cycle, the time to the first token."""
        return (
            f"Speculation: {self.tau:.2f} tokens per verify cycle over {self.cycles} cycles, "
            f"{self.accepted} of {self.tokens} tokens from accepted drafts{self.drafting()}, "
            f"first token after {self.ttft * 1000:.0f} ms"
        )

    def summary(self) -> str:
        """One line for a turn of `chat`."""
        d = self.as_dict()
        return (
            f"{d['generation_tokens']} tokens, {d['generation_tps']:.1f} tok/s, "
            f"τ {d['tau']:.2f}, {self.accepted} from accepted drafts{self.drafting()}, "
            f"TTFT {d['ttft'] * 1000:.0f} ms, prompt {d['prompt_tokens']} tokens"
        )

    def drafting(self) -> str:
        """The cycles by kind, and when and why drafting was off, as " (...)" ("" if unknown)."""
        drafting = self.last.drafting if self.last else None
        return f" ({drafting.summary()})" if drafting else ""
