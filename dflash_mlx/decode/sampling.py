"""How drafts are proposed and accepted: pure math on logits.

Four rules, all lossless:
- greedy (temperature 0): drafts and the target's choices are argmaxes; a draft
  is accepted when it equals the target's choice.
- "match": drafts and the target's tokens are sampled; a draft is accepted when
  it equals the target's sample. Correct, but accepts less than it could.
- "speculative": standard speculative sampling with
  the drafter's distribution q and the target's p, both after the same
  temperature / top-p / min-p / XTC / top-k transform: accept draft x with
  probability min(1, p(x)/q(x)); at the first rejection emit a sample of
  normalize(max(0, p - q)); if all are accepted the bonus token comes from p.
  Every emitted token is then distributed exactly as the target's own sample.
- "coupled" (the default when sampling; Gumbel-max coupling keyed by position): a
  reply has a noise seed, and every sequence position t its own Gumbel noise G_t
  over the vocabulary, from a key of (seed, t) alone. The target's token at t is
  argmax(log p_t + G_t): an exact sample of p_t, as G_t is fresh at every position
  whatever was drafted.
  Drafts use the same noise: a chain's draft at t is argmax(log q_t + G_t), a
  tree's children at t the drafter's best of log q_t + G_t (a sample without
  replacement), so they agree with the target far more often than independent
  samples; a draft is accepted when it equals the target's choice. The reply is
  then a function of the seed, the prompt and the settings alone, whatever the
  cycles' shapes, sizes, timing or batching: the clock may choose them.

A verifier draws from MLX's global random state, or from its own stream (`key`)
when it has one: a seeded reply then draws the same whatever else samples
beside it.

Everything stays on the device, the token after the accepted drafts included;
the loop reads a cycle's drafts, accepted count and that token in one read.
Full-vocabulary work is kept to what a cycle needs: on a CPU an `exp` costs
~50 additions (`benchmarks/README.md`), so acceptance reads p and q only at the
drafted tokens, the residual is drawn for the one rejected position (chosen on the
device) instead of for all of them, and the normalisations (`logsumexp`) take their
exps from `cpu_math` on the CPU. Under the coupled rule the drafter's rows rank only
their near candidates (`make_draft_ranking`: any proposal keeps the reply exact), the
noise comes from numpy's vectorised logs (`position_noise`), the target's choice skips
the nucleus's sort where it cannot matter (`make_coupled_choice`), and on the CPU a
chain's rows are chosen one by one up to the first rejection (`Verifier._verify_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..native import cpu_math

Sampler = Callable[[mx.array], mx.array]
# A drafter's rows -> (column indices (rows, W), their log q (rows, W)); padding columns
# are the row width and -inf
DraftRanking = Callable[[mx.array], tuple[np.ndarray, np.ndarray]]
CoupledChoice = Callable[[mx.array, mx.array], mx.array]  # (logits, noise) -> choices
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # mlx-lm's: (tokens, logits) -> logits
RULES = ("speculative", "match", "coupled")
MAX_SEED = 2**32 - 1  # a seed is a uint32, as `mx.random.key` takes it
# What a drafted row ranks under the coupled rule: its tokens within CANDIDATE_GAP of its best
# (log q after the temperature), the MAX_CANDIDATES best of them
CANDIDATE_GAP = 16.0
MAX_CANDIDATES = 64
# Float rounding in the nucleus's sums: ~49,152 ulps at most, relative, for 49,152 logits
NUCLEUS_MARGIN = 0.02


def is_filtered(
    top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0, xtc_probability: float = 0.0
) -> bool:
    """Whether mlx-lm's sampler filters the log-softmax (top-p, min-p, XTC or top-k)."""
    return 0 < top_p < 1.0 or min_p != 0.0 or top_k > 0 or xtc_probability > 0.0


def make_scores_transform(
    temperature: float,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    *,
    min_tokens_to_keep: int = 1,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: tuple[int, ...] = (),
) -> Callable[[mx.array], mx.array]:
    """Logits -> mlx-lm's sampling log-probabilities up to a constant per row.

    mlx-lm filters the log-softmax (top-p, then min-p keeping `min_tokens_to_keep`, then
    XTC, then top-k) and samples categorical(filtered / temperature). A coupled choice,
    argmax(scores + noise), is the same for any constant per row: it skips the final
    normalisation. XTC drops the top choices (`without_top_choices`) with probability
    `xtc_probability`, drawn per token: what it samples from is the mixture of the two
    distributions, weighted so, which speculative sampling reads like any other.
    """
    check_xtc(min_tokens_to_keep, xtc_probability, xtc_threshold)
    filtered = is_filtered(top_p, top_k, min_p, xtc_probability)
    special = list(xtc_special_tokens)

    def tempered(logprobs: mx.array) -> mx.array:
        if 0 < top_k < logprobs.shape[-1]:  # a top-k as wide as the row filters nothing
            logprobs = apply_top_k(logprobs, top_k)
        return logprobs * (1.0 / temperature)

    def scores(logits: mx.array) -> mx.array:
        if not filtered:  # softmax(logits / T) needs no normalisation before it
            return logits * (1.0 / temperature)
        logprobs = logits - logsumexp(logits)
        if 0 < top_p < 1.0:
            logprobs = nucleus(logprobs, top_p)
        if min_p != 0.0:
            logprobs = apply_min_p(logprobs, min_p, min_tokens_to_keep)
        if xtc_probability == 0.0:
            return tempered(logprobs)
        cut = tempered(without_top_choices(logprobs, xtc_threshold, special))
        if xtc_probability == 1.0:
            return cut
        kept = tempered(logprobs)
        return mx.logaddexp(
            kept - logsumexp(kept) + math.log1p(-xtc_probability),
            cut - logsumexp(cut) + math.log(xtc_probability),
        )

    return scores


def check_xtc(min_tokens_to_keep: int, xtc_probability: float, xtc_threshold: float) -> None:
    """mlx-lm's bounds for min-p's and XTC's settings, checked before any sampling."""
    if not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be at least 1, got {min_tokens_to_keep!r}")
    if not 0 <= xtc_probability <= 1:
        raise ValueError(f"xtc_probability must be in [0, 1], got {xtc_probability}")
    if not 0 <= xtc_threshold <= 0.5:
        raise ValueError(f"xtc_threshold must be in [0, 0.5], got {xtc_threshold}")


def without_top_choices(logprobs: mx.array, threshold: float, special: list[int]) -> mx.array:
    """mlx-lm's `apply_xtc` when it applies: every token more likely than `threshold` but
    the least likely of them is dropped, `special` tokens (a newline, the EOS) never."""
    probs = mx.softmax(logprobs, axis=-1)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    top = probs > least
    if special:
        top[..., special] = False
    return mx.where(top, -mx.inf, logprobs)


def make_logprobs_transform(
    temperature: float, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0, **filters: Any
) -> Callable[[mx.array], mx.array]:
    """Logits -> the normalized log-probabilities mlx-lm's `make_sampler` samples from;
    `filters` are `make_scores_transform`'s keywords (min-p's floor, XTC)."""
    scores = make_scores_transform(temperature, top_p, top_k, min_p, **filters)

    def transform(logits: mx.array) -> mx.array:
        scaled = scores(logits)
        return scaled - logsumexp(scaled)

    return transform


def make_coupled_choice(
    temperature: float, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0, **filters: Any
) -> CoupledChoice:
    """(logits, noise) -> each row's coupled choice argmax(scores + noise), bit for bit,
    without the nucleus's sort where it cannot matter (top-p alone, on the CPU).

    The best token of the whole row, argmax(logprobs / T + noise), is the nucleus's best
    whenever it is in the nucleus: sure when the tokens at least as likely as it hold less
    than top_p of the mass, with a margin for rounding in the rule's own sums. One exp
    (`cpu_math`) and a few sums a row instead of a sort and a scalar exp, most of a
    filtered row's cost on the CPU (see benchmarks/README.md, "Sampling"); the other rows
    (~1 - top_p of them) take the full transform.
    """
    scores = make_scores_transform(temperature, top_p, top_k, min_p, **filters)

    def full(logits: mx.array, noise: mx.array) -> mx.array:
        return mx.argmax(scores(logits) + noise, axis=-1)

    if not 0 < top_p < 1.0 or is_filtered(0.0, top_k, min_p, filters.get("xtc_probability", 0)):
        return full

    def choice(logits: mx.array, noise: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu or logits.dtype != mx.float32:
            return full(logits, noise)
        logprobs = logits - logsumexp(logits)
        best = mx.argmax(logprobs * (1.0 / temperature) + noise, axis=-1, keepdims=True)
        probs = cpu_math.exp_nonpositive(logprobs)
        likelier = logprobs >= mx.take_along_axis(logprobs, best, axis=-1)
        mass = mx.where(likelier, probs, 0.0).sum(axis=-1)
        sure = np.array(mass < top_p * (1 - NUCLEUS_MARGIN) * probs.sum(axis=-1))
        if sure.all():
            return best[:, 0]
        unsure = mx.array(np.flatnonzero(~sure))
        chosen = np.array(best[:, 0])
        chosen[~sure] = np.array(full(logits[unsure], noise[unsure]))
        return mx.array(chosen)

    return choice


def make_draft_ranking(
    temperature: float, top_p: float = 0.0, top_k: int = 0, min_p: float = 0.0, **filters: Any
) -> DraftRanking:
    """The drafter's cheap log q under the coupled rule: `transform` over each row's near
    candidates (`near_candidates`), not over the vocabulary.

    A coupled draft is accepted iff it equals the target's choice, so any proposal keeps
    the reply exact: a cheaper one only changes how often drafts agree. The
    full-vocabulary transform of a drafted row (two normalisations, a sort, exps) is
    dear on the CPU; its near candidates (at most MAX_CANDIDATES) cost a fraction of it.
    XTC's spared tokens are vocabulary ids, not candidate columns: the ranking spares none.
    """
    filters = {**filters, "xtc_special_tokens": ()}
    transform = make_logprobs_transform(temperature, top_p, top_k, min_p, **filters)

    def ranking(logits: mx.array) -> tuple[np.ndarray, np.ndarray]:
        index, compact = near_candidates(np.array(logits.astype(mx.float32)), temperature)
        return index, np.array(transform(mx.array(compact)))

    return ranking


def near_candidates(rows: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's tokens within CANDIDATE_GAP * temperature of its best logit, at most the
    MAX_CANDIDATES best: (column indices, logits), padded with the row width and -inf.

    A token CANDIDATE_GAP below the best wins argmax(log q + G) with probability under
    e^-16 per token, and is then almost never in the nucleus.
    """
    near = rows >= rows.max(axis=-1, keepdims=True) - CANDIDATE_GAP * temperature
    row_ids, columns = np.nonzero(near)
    counts = np.bincount(row_ids, minlength=len(rows))
    width = min(1 << int(counts.max() - 1).bit_length(), rows.shape[-1])  # few widths
    slots = np.arange(len(columns)) - np.repeat(np.cumsum(counts) - counts, counts)
    index = np.full((len(rows), width), rows.shape[-1], dtype=np.int64)
    compact = np.full((len(rows), width), -np.inf, dtype=np.float32)
    index[row_ids, slots], compact[row_ids, slots] = columns, rows[row_ids, columns]
    if width > MAX_CANDIDATES:
        best = np.argpartition(-compact, MAX_CANDIDATES - 1, axis=-1)[:, :MAX_CANDIDATES]
        index, compact = (np.take_along_axis(a, best, axis=-1) for a in (index, compact))
    return index, compact


def logsumexp(x: mx.array) -> mx.array:
    """`mx.logsumexp` over the last axis, kept; float32 rows on the CPU through
    `cpu_math`, whose exp vectorises where MLX's CPU exp runs one element at a time
    (see benchmarks/README.md, "Sampled runs adapt too, and top-p sorts in numpy")."""
    if mx.default_device() == mx.cpu and x.dtype == mx.float32:
        return cpu_math.logsumexp(x)
    return mx.logsumexp(x, axis=-1, keepdims=True)


def nucleus(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's `apply_top_p`, bit for bit, with the sort done by numpy on the CPU.

    The rule reads only the sorted values, never their order among equals, so any
    correct sort gives the same bits. MLX's CPU sort is slow for a cycle's rows and
    numpy's is not (see benchmarks/README.md, "Sampled runs adapt too, and top-p sorts in
    numpy"); elsewhere MLX's is kept.
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


def position_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """Gumbel noise (vocab,) float32 at one sequence position of a reply: Philox keyed by
    (seed, position), so each position's noise is its own, drawn in any order. numpy's
    exponentials (float64 ziggurat: exact tails) and vectorised float32 log, cheaper on the
    CPU than `mx.random.gumbel`'s two scalar MLX logs an element."""
    generator = np.random.Generator(np.random.Philox(key=(seed << 32) | position))
    return -np.log(generator.standard_exponential(vocab).astype(np.float32))


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

    Under the coupled rule each reply has its own verifier (`for_reply`), and each cycle
    tells it where it starts (`at`): the drafter's rows and the target's rows after the
    root stand for consecutive positions from there, a tree's nodes for their depths.
    """

    transform: Callable[[mx.array], mx.array] | None = None  # None: greedy
    rule: str = "speculative"
    sampler: Sampler | None = None  # a user's own sampler (match rule only)
    processors: list[LogitsProcessor] = field(default_factory=list)
    key: mx.array | None = None  # its own random stream; None: MLX's global state
    # The coupled rule's cheaper ways: the target's choices (`make_coupled_choice`) and
    # the drafter's ranking over its near candidates (`make_draft_ranking`); None:
    # through `transform`
    coupled_choice: CoupledChoice | None = None
    draft_ranking: DraftRanking | None = None
    # Verify a coupled chain row by row on the CPU (`_verify_rows`): for filtered settings,
    # whose rows are read on the host anyway; unfiltered rows are cheap and stay lazy
    row_by_row: bool = False
    # The coupled rule's state for one reply (`for_reply`, `at`): its noise seed, the
    # position of the cycle's first row after the root and the vocabulary, the rows
    # proposed since, and the noise of the positions the cycle may read.
    seed: int | None = None
    position: int = 0
    vocab: int = 0
    drafted: int = 0
    noises: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def coupled(self) -> bool:
        """Whether sampled tokens are coupled by position (the "coupled" rule)."""
        return self.rule == "coupled" and self.transform is not None

    @property
    def chooses_per_row(self) -> bool:
        """Whether the target's choices are made one row at a time, as a verdict reads them
        (`row_by_row`, coupled, on the CPU): a cycle then pays for the rows it accepts + 1."""
        return self.row_by_row and self.coupled and mx.default_device() == mx.cpu

    def for_reply(self) -> Verifier:
        """The verifier one reply uses: itself, or under the coupled rule a copy with the
        reply's own noise seed, drawn from this stream (or MLX's global state) as the reply
        starts, so replies of one settings object differ and their seed decides each."""
        if not self.coupled:
            return self
        seed = mx.random.randint(0, 2**31 - 1, key=self._next_key()).item()
        return replace(self, key=mx.random.key(seed), seed=seed, noises={})

    def at(self, position: int, vocab: int) -> None:
        """The next cycle's first row after the root stands for sequence `position` (rows of
        `vocab` logits): the coupled rule keys its noise by it. Earlier noise is dropped."""
        self.position, self.vocab, self.drafted = position, vocab, 0
        for done in [p for p in self.noises if p < position]:
            del self.noises[done]

    def noise(self, positions: list[int], vocab: int) -> np.ndarray:
        """The reply's Gumbel noise (len(positions), vocab), kept for the cycle: a position's
        noise serves the drafter's row, the target's and every tree node at that depth."""
        if not self.vocab:  # the same noise for every cycle would not be a sample
            raise ValueError("a coupled verifier needs at(position, vocab) before each cycle")
        if self.seed is None:  # a verifier used without `for_reply`: a seed of its own
            self.seed = mx.random.randint(0, 2**31 - 1, key=self._next_key()).item()
        for position in positions:
            if position not in self.noises:
                self.noises[position] = position_noise(self.seed, position, vocab)
        return np.stack([self.noises[position] for position in positions])

    def tree_scores(self, logits: mx.array, token_ids: np.ndarray | None) -> mx.array:
        """What a coupled drafter tree ranks each depth's candidates by: log q + that depth's
        noise, rows for depths 1, 2, ... (columns `token_ids` of the vocabulary, for a draft
        vocabulary); the tree then holds the target's likely coupled choices."""
        positions = list(range(self.position, self.position + logits.shape[0]))
        noise = self.noise(positions, self.vocab)
        if token_ids is not None:
            noise = noise[:, token_ids]
        if self.draft_ranking is None:
            return self.transform(logits) + mx.array(noise)
        index, perturbed = self._perturbed_ranking(logits, noise)
        scores = np.full((len(index), logits.shape[-1] + 1), -np.inf, dtype=np.float32)
        np.put_along_axis(scores, index, perturbed, axis=-1)  # padding: the extra column
        return mx.array(scores[:, :-1])

    def _perturbed_ranking(
        self, logits: mx.array, noise: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The drafter's near candidates (column indices) and their log q + noise."""
        index, logq = self.draft_ranking(logits)
        columns = np.minimum(index, noise.shape[-1] - 1)  # padding's log q is -inf
        return index, logq + np.take_along_axis(noise, columns, axis=-1)

    def propose(
        self, logits: mx.array, context: list[int] | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Draft tokens from rows of scores and, for speculative sampling, their log-probs q.

        The rows are drafter logits, proposed through the processors after
        `context` when one is given, or (DFlash 2) one walk step's candidate scores.
        """
        if not self.processors or context is None:
            return self._draft(logits)
        seen, tokens, logprobs = mx.array(context, dtype=mx.uint32), [], []
        for row in range(logits.shape[0]):
            processed = self._process(seen, logits[row : row + 1])
            token, row_logprobs = self._draft(processed)
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

    def _draft(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """Drafts from the drafter's rows: under the coupled rule with a `draft_ranking`,
        the best of its near candidates' log q + noise (no log q returned: the rule never
        reads it)."""
        positions = self._drafting(logits)
        if positions is None or self.draft_ranking is None:
            return self._choose(logits, positions)
        noise = self.noise(positions, logits.shape[-1])
        index, perturbed = self._perturbed_ranking(logits, noise)
        best = np.take_along_axis(index, perturbed.argmax(axis=-1)[:, None], axis=-1)[:, 0]
        return mx.array(best, dtype=mx.uint32), None

    def _drafting(self, logits: mx.array) -> list[int] | None:
        """The positions of the next drafted rows, for the coupled rule (None: a draw). A DFlash
        2 walk's step scores its candidates, not the vocabulary: drawn from the stream."""
        if not self.coupled or logits.ndim != 2:
            return None
        start = self.position + self.drafted
        self.drafted += logits.shape[0]
        return list(range(start, start + logits.shape[0]))

    def choices(
        self, logits: mx.array, positions: list[int], rows: mx.array | None = None
    ) -> mx.array:
        """The target's token after each row (a tree's nodes, at sequence `positions`, or at
        `positions[rows[i]]` for row i: a tree's depths, on the device): its argmax, its
        coupled choice, or its sample."""
        return self._choose(logits, positions, rows)[0]

    def _choose(
        self, logits: mx.array, positions: list[int] | None = None, rows: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        if self.sampler is not None:
            return self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)), None
        if self.transform is None:
            return mx.argmax(logits, axis=-1), None
        if self.coupled and positions is not None:  # no log q: the rule never reads it
            noise = mx.array(self.noise(positions, logits.shape[-1]))
            if rows is not None:
                noise = noise[rows]
            if self.coupled_choice is not None:
                return self.coupled_choice(logits, noise), None
            return mx.argmax(self.transform(logits) + noise, axis=-1), None
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
        if self.chooses_per_row and drafts.size:
            return self._verify_rows(drafts, target_logits)
        positions = list(range(self.position, self.position + target_logits.shape[0]))
        choices, _ = self._choose(target_logits, positions)
        matches = drafts == choices[:-1].astype(drafts.dtype)
        accepted = leading(matches)
        return Verdict(matches, accepted, mx.take(choices, accepted), target_logits)

    def _verify_rows(self, drafts: mx.array, target_logits: mx.array) -> Verdict:
        """The coupled verdict on the CPU: the target's choices row by row, up to the first
        that rejects its draft. A filtered row is read on the host anyway (the nucleus's
        numpy sort, or `make_coupled_choice`'s check), so a cycle pays for accepted + 1 rows'
        full-vocabulary work, not every row's; `matches` holds only the leading acceptances."""
        proposed, accepted = drafts.tolist(), 0
        while True:
            row = target_logits[accepted : accepted + 1]
            choice = self.choices(row, [self.position + accepted]).item()
            if accepted == len(proposed) or choice != proposed[accepted]:
                break
            accepted += 1
        matches = mx.arange(len(proposed)) < accepted
        token = mx.array(choice, dtype=mx.uint32)
        return Verdict(matches, mx.array(accepted, dtype=mx.int32), token, target_logits)


def make_verifier(
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    min_p: float = 0.0,
    sampler: Sampler | None = None,
    acceptance: str = "coupled",
    processors: list[LogitsProcessor] | None = None,
    seed: int | None = None,
    min_tokens_to_keep: int = 1,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: tuple[int, ...] = (),
) -> Verifier:
    """The verifier for mlx-lm-style sampling settings (greedy at temperature 0) and
    logits processors (mlx-lm's `make_logits_processors`); with a `seed`, one that draws
    from its own stream from that seed."""
    check_xtc(min_tokens_to_keep, xtc_probability, xtc_threshold)
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
    setting = dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        min_tokens_to_keep=min_tokens_to_keep,
        xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold,
        xtc_special_tokens=tuple(xtc_special_tokens),
    )
    # Unfiltered, a row's coupled choice is one scaling and an argmax: nothing to save
    filtered = is_filtered(top_p, top_k, min_p, xtc_probability)
    return Verifier(
        make_logprobs_transform(**setting),
        acceptance,
        processors=processors,
        key=key,
        coupled_choice=make_coupled_choice(**setting),
        draft_ranking=make_draft_ranking(**setting) if filtered else None,
        row_by_row=filtered,
    )
