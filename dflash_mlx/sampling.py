"""How drafts are proposed and accepted: pure math on logits.

Three rules, all lossless:
- greedy (temperature 0): drafts and the target's choices are argmaxes; a draft
  is accepted when it equals the target's choice.
- "match": drafts and the target's tokens are sampled; a draft is accepted when
  it equals the target's sample. Correct, but accepts less than it could.
- "speculative" (the default when sampling): standard speculative sampling with
  the drafter's distribution q and the target's p, both after the same
  temperature / top-p / min-p / top-k transform: accept draft x with
  probability min(1, p(x)/q(x)); at the first rejection emit a sample of
  normalize(max(0, p - q)); if all are accepted the bonus token comes from p.
  Every emitted token is then distributed exactly as the target's own sample.

A verifier draws from MLX's global random state, or from its own stream (`key`)
when it has one: a seeded reply then draws the same whatever else samples
beside it.

Everything stays on the device, the token after the accepted drafts included;
the loop reads a cycle's drafts, accepted count and that token in one read.
Full-vocabulary work is kept to what a cycle needs: on a CPU an `exp` costs
~50 additions (`benchmarks/README.md`), so acceptance reads p and q only at the
drafted tokens, the residual is drawn for the one rejected position (chosen on the
device) instead of for all of them, and the normalisations (`logsumexp`) take their
exps from `cpu_math` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from . import cpu_math

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # mlx-lm's: (tokens, logits) -> logits
RULES = ("speculative", "match")
MAX_SEED = 2**32 - 1  # a seed is a uint32, as `mx.random.key` takes it


def make_logprobs_transform(
    temperature: float, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0
) -> Callable[[mx.array], mx.array]:
    """Logits -> the normalized log-probabilities mlx-lm's `make_sampler` samples from.

    mlx-lm filters the log-softmax (top-p, then min-p, then top-k) and samples
    categorical(filtered / temperature); the same chain, renormalized, gives p.
    """

    filtered = 0 < top_p < 1.0 or min_p != 0.0 or top_k > 0

    def transform(logits: mx.array) -> mx.array:
        if not filtered:  # one normalisation instead of two: softmax(logits / T)
            scaled = logits * (1.0 / temperature)
            return scaled - logsumexp(scaled)
        logprobs = logits - logsumexp(logits)
        if 0 < top_p < 1.0:
            logprobs = nucleus(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:  # a top-k as wide as the row filters nothing
            logprobs = apply_top_k(logprobs, top_k)
        scaled = logprobs * (1.0 / temperature)
        return scaled - logsumexp(scaled)

    return transform


def logsumexp(x: mx.array) -> mx.array:
    """`mx.logsumexp` over the last axis, kept; float32 rows on the CPU through
    `cpu_math`, whose exp vectorises (MLX's CPU exp is scalar: ~15 ms for a 5-row
    cycle's full-vocabulary normalisations of 49k logits)."""
    if mx.default_device() == mx.cpu and x.dtype == mx.float32:
        return cpu_math.logsumexp(x)
    return mx.logsumexp(x, axis=-1, keepdims=True)


def nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's `apply_top_p`, bit for bit, with the sort done by numpy on the CPU.

    The rule reads only the sorted values, never their order among equals, so any
    correct sort gives the same bits. MLX's CPU sort takes ~75 ms for a cycle's 16 rows
    of 49,152 logprobs, numpy's ~5 (`benchmarks/README.md`); elsewhere MLX's is kept.
    """
    if mx.default_device() != mx.cpu or logprobs.dtype != mx.float32:
        return apply_top_p(logprobs, top_p)
    ascending = mx.array(np.sort(np.array(logprobs), axis=-1))
    probs = mx.exp(ascending)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def speculative_accept(
    drafts: mx.array,
    draft_logprobs: mx.array,
    target_logprobs: mx.array,
    key: mx.array | None = None,
) -> mx.array:
    """matches[i]: draft i is accepted, with probability min(1, p(x) / q(x)) (uniforms
    drawn with `key`, or from the global state without one)."""
    index = drafts[:, None]
    p_x = mx.exp(mx.take_along_axis(target_logprobs[: len(drafts)], index, axis=-1)[:, 0])
    q_x = mx.exp(mx.take_along_axis(draft_logprobs, index, axis=-1)[:, 0])
    return mx.random.uniform(shape=p_x.shape, key=key) * q_x < p_x


def residual_sample(
    target_logprobs: mx.array, draft_logprobs: mx.array, key: mx.array | None = None
) -> mx.array:
    """A sample of normalize(max(0, p - q)): the token emitted where a draft was rejected."""
    p, q = mx.exp(target_logprobs), mx.exp(draft_logprobs)
    residual = mx.maximum(p - q, 0.0)
    # p == q leaves no residual, but then the draft is always accepted: sample p instead.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p)
    return mx.random.categorical(mx.log(residual), key=key)


def leading(matches: mx.array) -> mx.array:
    """How many of `matches` hold before the first that does not (a scalar, on the device)."""
    return mx.cumprod(matches.astype(mx.int32)).sum()


@dataclass
class Verdict:
    """The target's verdict on k drafts, all on the device until the host reads it.

    `matches[i]` accepts draft i; `accepted` counts the leading accepted drafts and
    `token` is the one committed after them: the target's own choice there, or for
    speculative sampling the residual sample at the rejected position (the bonus
    sample if all were accepted). `logits` are the target's, after the logits
    processors, at each position. The host reads `accepted` and `token` together
    with the drafts, once per cycle.
    """

    matches: mx.array
    accepted: mx.array
    token: mx.array
    logits: mx.array


@dataclass
class Verifier:
    """Proposes draft tokens from drafter logits and verifies them against target logits.

    With logits processors, row i of a block's logits is processed as mlx-lm
    processes the logits it samples from at that position: seeing every token
    before it, i.e. `context` (the tokens before row 0) + the block's tokens
    before row i. Drafts are then proposed one row after another through the
    same processors, so they follow what the target will choose.

    With a `key` (`mx.random.key(seed)`) the verifier owns a random stream: every draw
    it makes takes a fresh subkey split from it, on the device, so its draws do not
    depend on what else samples in between. Without one it draws from MLX's global
    state (`mx.random.seed`). A custom `sampler` draws wherever it draws.
    """

    transform: Callable[[mx.array], mx.array] | None = None  # None: greedy
    rule: str = "speculative"
    sampler: Sampler | None = None  # a user's own sampler (match rule only)
    processors: list[LogitsProcessor] = field(default_factory=list)
    key: mx.array | None = None  # its own random stream; None: MLX's global state

    def propose(
        self, logits: mx.array, context: list[int] | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Draft tokens from rows of scores and, for speculative sampling, their log-probs q.

        The rows are drafter logits, proposed through the processors after
        `context` when one is given, or (DFlash 2) one walk step's candidate scores.
        """
        if not self.processors or context is None:
            return self._choose(logits)
        seen, tokens, logprobs = mx.array(context, dtype=mx.uint32), [], []
        for row in range(logits.shape[0]):
            token, row_logprobs = self._choose(self._process(seen, logits[row : row + 1]))
            seen = mx.concatenate([seen, token.astype(mx.uint32)])
            tokens.append(token)
            logprobs.append(row_logprobs)
        q = None if logprobs[0] is None else mx.concatenate(logprobs)
        return mx.concatenate(tokens), q

    def process(self, logits: mx.array, context: list[int] | None, tokens: mx.array) -> mx.array:
        """Row i of `logits` through the processors, seeing `context` + `tokens[:i]`."""
        if not self.processors:
            return logits
        seen = mx.concatenate([mx.array(context, dtype=mx.uint32), tokens.astype(mx.uint32)])
        rows = [
            self._process(seen[: len(context) + i], logits[i : i + 1])
            for i in range(logits.shape[0])
        ]
        return mx.concatenate(rows)

    def _process(self, seen: mx.array, row: mx.array) -> mx.array:
        for processor in self.processors:
            row = processor(seen, row)
        return row

    def _choose(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        if self.sampler is not None:
            return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)), None
        if self.transform is None:
            return mx.argmax(logits, axis=-1), None
        logprobs = self.transform(logits)
        return mx.random.categorical(logprobs, key=self._next_key()), logprobs

    def _next_key(self) -> mx.array | None:
        """A fresh subkey for one draw, the stream keeping the other half (lazily: no
        host read); None without a stream, to draw from the global state."""
        if self.key is None:
            return None
        self.key, subkey = mx.random.split(self.key)
        return subkey

    def verify(
        self,
        drafts: mx.array,
        draft_logprobs: mx.array | None,
        target_logits: mx.array,
        context: list[int] | None = None,
    ) -> Verdict:
        """The verdict on `drafts` given the target's logits at [last token] + drafts
        (`context`: every token up to the last, for the logits processors)."""
        target_logits = self.process(target_logits, context, drafts)
        if draft_logprobs is not None and self.rule == "speculative" and drafts.size:
            target_logprobs = self.transform(target_logits)
            matches = speculative_accept(drafts, draft_logprobs, target_logprobs, self._next_key())
            bonus = mx.random.categorical(target_logprobs[-1], key=self._next_key())
            accepted = leading(matches)
            row = mx.minimum(accepted, drafts.size - 1)  # the rejected position, if any
            residual = residual_sample(
                mx.take(target_logprobs, row, axis=0),
                mx.take(draft_logprobs, row, axis=0),
                self._next_key(),
            )
            token = mx.where(accepted < drafts.size, residual, bonus)
            return Verdict(matches, accepted, token, target_logits)
        choices, _ = self._choose(target_logits)
        matches = drafts == choices[:-1].astype(drafts.dtype)
        accepted = leading(matches)
        return Verdict(matches, accepted, mx.take(choices, accepted), target_logits)


def make_verifier(
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Sampler | None = None,
    acceptance: str = "speculative",
    processors: list[LogitsProcessor] | None = None,
    seed: int | None = None,
) -> Verifier:
    """The verifier for mlx-lm-style sampling settings (greedy at temperature 0) and
    logits processors (mlx-lm's `make_logits_processors`); with a `seed`, one that draws
    from its own stream from that seed."""
    if acceptance not in RULES:
        raise ValueError(f"acceptance must be one of {RULES}, got {acceptance!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")
    if seed is not None and sampler is not None:
        raise ValueError("a seed cannot reach a custom sampler's draws; seed it yourself")
    processors = list(processors or [])
    if sampler is not None:
        return Verifier(rule="match", sampler=sampler, processors=processors)
    key = None if seed is None else mx.random.key(seed)
    if temperature == 0:
        return Verifier(processors=processors, key=key)
    transform = make_logprobs_transform(temperature, top_p, top_k, min_p)
    return Verifier(transform, acceptance, processors=processors, key=key)
