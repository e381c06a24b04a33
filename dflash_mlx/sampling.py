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

Everything stays on the device; the loop reads `matches` and `choices` once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

Sampler = Callable[[mx.array], mx.array]
RULES = ("speculative", "match")


def make_logprobs_transform(
    temperature: float, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0
) -> Callable[[mx.array], mx.array]:
    """Logits -> the normalized log-probabilities mlx-lm's `make_sampler` samples from.

    mlx-lm filters the log-softmax (top-p, then min-p, then top-k) and samples
    categorical(filtered / temperature); the same chain, renormalized, gives p.
    """

    def transform(logits: mx.array) -> mx.array:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        scaled = logprobs * (1.0 / temperature)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

    return transform


def speculative_verify(
    drafts: mx.array, draft_logprobs: mx.array, target_logprobs: mx.array
) -> tuple[mx.array, mx.array]:
    """(choices, matches) for k drafts: matches[i] accepts draft i; choices[j] is the
    token emitted at j if draft j is the first rejected (j = k: the bonus token)."""
    p = mx.exp(target_logprobs)
    q = mx.exp(draft_logprobs)
    index = drafts[:, None]
    p_x = mx.take_along_axis(p[:-1], index, axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, index, axis=-1)[:, 0]
    matches = mx.random.uniform(shape=p_x.shape) * q_x < p_x
    residual = mx.maximum(p[:-1] - q, 0.0)
    # p == q leaves no residual, but then every draft is accepted: sample p instead.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[:-1])
    resampled = mx.random.categorical(mx.log(residual))
    bonus = mx.random.categorical(target_logprobs[-1:])
    return mx.concatenate([resampled, bonus]), matches


@dataclass
class Verifier:
    """Proposes draft tokens from drafter logits and verifies them against target logits."""

    transform: Callable[[mx.array], mx.array] | None = None  # None: greedy
    rule: str = "speculative"
    sampler: Sampler | None = None  # a user's own sampler (match rule only)

    def propose(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """Draft tokens and, for speculative sampling, their log-probabilities q."""
        if self.sampler is not None:
            return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)), None
        if self.transform is None:
            return mx.argmax(logits, axis=-1), None
        logprobs = self.transform(logits)
        return mx.random.categorical(logprobs), logprobs

    def verify(
        self, drafts: mx.array, draft_logprobs: mx.array | None, target_logits: mx.array
    ) -> tuple[mx.array, mx.array]:
        """(choices, matches): the accepted count is the number of leading matches,
        and the token after them is `choices[accepted]`."""
        if draft_logprobs is not None and self.rule == "speculative" and drafts.size:
            return speculative_verify(drafts, draft_logprobs, self.transform(target_logits))
        choices, _ = self.propose(target_logits)
        return choices, drafts == choices[:-1].astype(drafts.dtype)


def make_verifier(
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Sampler | None = None,
    acceptance: str = "speculative",
) -> Verifier:
    """The verifier for mlx-lm-style sampling settings (greedy at temperature 0)."""
    if acceptance not in RULES:
        raise ValueError(f"acceptance must be one of {RULES}, got {acceptance!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if sampler is not None:
        return Verifier(rule="match", sampler=sampler)
    if temperature == 0:
        return Verifier()
    return Verifier(make_logprobs_transform(temperature, top_p, top_k, min_p), acceptance)
