"""Sampling: the transform equals mlx-lm's sampler, and speculative sampling is exact in
distribution (chi-square against exactly computed target probabilities, p-value > 1e-3)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import BlockByBlock
from mlx_lm.sample_utils import apply_top_p, make_presence_penalty, make_sampler
from scipy.stats import chisquare, gumbel_r, kstest

from dflash_mlx import stream_generate
from dflash_mlx.decode.sampling import (
    Verifier,
    logsumexp,
    make_coupled_choice,
    make_draft_ranking,
    make_logprobs_transform,
    make_scores_transform,
    make_verifier,
    nucleus,
    position_noise,
)
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.tree import ranked_tree, walk

SIGNIFICANCE = 1e-3  # a correct sampler fails each check with this probability


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, pooling cells expected to hold fewer than 5 samples."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    expected = probs * len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(float)
    big = expected >= 5
    assert observed[probs == 0].sum() == 0, "sampled a token of probability 0"
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()  # float rounding of the total
    return chisquare(obs[keep], exp).pvalue


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=4, min_p=0.05),
    dict(temperature=1.0, min_p=0.6, min_tokens_to_keep=4),
    # XTC: the top choices dropped for some tokens (token 5, one of them, spared as special)
    dict(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.05),
    dict(temperature=1.2, top_p=0.95, top_k=6, xtc_probability=0.3, xtc_threshold=0.1),
    dict(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.05, xtc_special_tokens=(5,)),
]
XTC_SAMPLES = 6000  # mlx-lm's XTC draws once per call, for all rows: one row a call


@pytest.mark.parametrize("setting", SETTINGS)
def test_transform_is_the_distribution_mlx_lm_samples(setting):
    mx.random.seed(0)
    logits = mx.random.normal((12,)) * 2
    transform = make_logprobs_transform(**setting)
    probs = np.array(mx.exp(transform(logits)))
    assert abs(probs.sum() - 1) < 1e-5
    sampler = make_sampler(
        setting["temperature"],
        setting.get("top_p", 0.0),
        setting.get("min_p", 0.0),
        setting.get("min_tokens_to_keep", 1),
        top_k=setting.get("top_k", 0),
        xtc_probability=setting.get("xtc_probability", 0.0),
        xtc_threshold=setting.get("xtc_threshold", 0.1),
        xtc_special_tokens=list(setting.get("xtc_special_tokens", ())),
    )
    logprobs = logits - mx.logsumexp(logits)
    if setting.get("xtc_probability"):
        samples = np.array([sampler(logprobs[None]).item() for _ in range(XTC_SAMPLES)])
        plain = make_logprobs_transform(setting["temperature"], setting.get("top_p", 0.0))
        assert np.abs(probs - np.array(mx.exp(plain(logits)))).max() > 0.1  # XTC cut here
    else:
        samples = np.array(sampler(mx.broadcast_to(logprobs, (20000, 12))))
    assert chi2_pvalue(samples, probs) > SIGNIFICANCE
    if setting.get("xtc_special_tokens"):  # the likeliest dropped, the special token kept
        assert probs[int(mx.argmax(logits))] == 0 and probs[5] > 0.2


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_nucleus_is_mlx_lms_top_p_bit_for_bit(top_p):
    mx.random.seed(1)
    for shape, scale in [((16, 49152), 3.0), ((1, 300), 1.0), ((5, 7), 0.1)]:
        logits = mx.random.normal(shape) * scale
        logits[..., :3] = -mx.inf  # filtered tokens, ties among them
        logits[..., 3:5] = logits[..., 5:6]  # ties among live ones
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ours, theirs = np.array(nucleus(logprobs, top_p)), np.array(apply_top_p(logprobs, top_p))
        assert np.array_equal(ours.view(np.int32), theirs.view(np.int32)), shape


@pytest.mark.parametrize("seed", [None, 9])
def test_speculative_verify_emits_the_target_distribution(seed):
    """From the global random state, and from a verifier's own stream (`key`)."""
    rng = np.random.default_rng(0)
    vocab, k = 6, 2
    p = rng.dirichlet(np.ones(vocab), size=k + 1)
    q = rng.dirichlet(np.ones(vocab), size=k)
    p_log, q_log = mx.log(mx.array(p, mx.float32)), mx.log(mx.array(q, mx.float32))
    key = None if seed is None else mx.random.key(seed)
    verifier = Verifier(transform=lambda logits: logits, key=key)  # "logits": log p already
    mx.random.seed(1)
    first, second, third, accepted = [], [], [], []
    for _ in range(6000):
        drafts = mx.random.categorical(q_log)
        verdict = verifier.verify(drafts, q_log, p_log)
        d, m = drafts.tolist(), verdict.matches.tolist()
        n = 0 if not m[0] else 1 if not m[1] else 2
        assert verdict.accepted.item() == n
        tokens = d[:n] + [verdict.token.item()]
        first.append(tokens[0])
        if n >= 1:
            second.append(tokens[1])
        if n == 2:
            third.append(tokens[2])  # the bonus token, drawn from the last row of p
        accepted.append(m[0])
    assert chi2_pvalue(np.array(first), p[0]) > SIGNIFICANCE
    assert chi2_pvalue(np.array(second), p[1]) > SIGNIFICANCE
    assert chi2_pvalue(np.array(third), p[2]) > SIGNIFICANCE
    expected_rate = np.minimum(p[0], q[0]).sum()  # speculative acceptance: sum of min(p, q)
    assert abs(np.mean(accepted) - expected_rate) < 4 * np.sqrt(expected_rate / 6000)


def coupled_verifier(seed: int, position: int, vocab: int) -> Verifier:
    """A coupled verifier whose "logits" are log-probabilities already, its noise from `seed`,
    its cycle starting at `position`."""
    verifier = Verifier(transform=lambda logits: logits, rule="coupled", seed=seed)
    verifier.at(position, vocab)
    return verifier


def test_coupled_chains_emit_the_target_distribution():
    """Drafts argmax(log q + G_t), the target's tokens argmax(log p + G_t): every emitted token
    follows its row of p, and coupled drafts agree far more often than independent ones."""
    rng = np.random.default_rng(0)
    vocab, k, trials = 6, 2, 4000
    p = rng.dirichlet(np.ones(vocab), size=k + 1)
    q = rng.dirichlet(np.ones(vocab), size=k)
    p_log, q_log = mx.log(mx.array(p, mx.float32)), mx.log(mx.array(q, mx.float32))
    emitted: list[list[int]] = [[], [], []]
    accepted = []
    for trial in range(trials):
        verifier = coupled_verifier(trial, 40 + trial % 7, vocab)
        drafts, logq = verifier.propose(q_log)
        verdict = verifier.verify(drafts, logq, p_log)
        n = verdict.accepted.item()
        for i, token in enumerate(drafts.tolist()[:n] + [verdict.token.item()]):
            emitted[i].append(token)
        accepted.append(verdict.matches[0].item())
    for row, tokens in enumerate(emitted):
        assert chi2_pvalue(np.array(tokens), p[row]) > SIGNIFICANCE, row
    independent = (p[0] * q[0]).sum()  # the match rule's acceptance
    assert np.mean(accepted) > independent + 4 * np.sqrt(independent / trials)


def test_coupled_trees_emit_the_target_distribution():
    """A tree of the drafter's 4 best coupled prefixes (`tree_scores`), walked by the target's
    coupled choice at each node's position: the first token follows p at the root and the
    second, given the first, the target's row after it, tree node or not."""
    rng = np.random.default_rng(1)
    vocab, trials = 5, 3000
    p_root = rng.dirichlet(np.ones(vocab))
    p_after = rng.dirichlet(np.ones(vocab), size=vocab)  # the target's row after each token
    q = rng.dirichlet(np.ones(vocab), size=2)
    q_log = mx.log(mx.array(q, mx.float32))
    seconds: dict[int, list[int]] = {x: [] for x in range(vocab)}
    firsts, deep = [], 0
    for trial in range(trials):
        verifier = coupled_verifier(trial, 9, vocab)
        root = mx.array([vocab])  # the root token is outside the vocabulary
        tree = ranked_tree(root, verifier.tree_scores(q_log, None), 4).read()
        rows = [p_root if node == 0 else p_after[tree.tokens[node]] for node in range(len(tree))]
        logits = mx.log(mx.array(np.array(rows), mx.float32))
        choices = verifier.choices(logits, [9 + depth for depth in tree.depths]).tolist()
        path, after = walk(tree, choices.__getitem__)
        tokens = [tree.tokens[node] for node in path[1:]] + [after]
        if len(tokens) == 1:  # the next cycle, at the next position
            verifier.at(10, vocab)
            row = mx.log(mx.array(p_after[tokens[0]][None], mx.float32))
            tokens.append(verifier.choices(row, [10]).item())
        deep += len(path) > 2
        firsts.append(tokens[0])
        seconds[tokens[0]].append(tokens[1])
    assert chi2_pvalue(np.array(firsts), p_root) > SIGNIFICANCE
    for first, tokens in seconds.items():
        if len(tokens) >= 100:
            assert chi2_pvalue(np.array(tokens), p_after[first]) > SIGNIFICANCE, first
    assert deep > trials / 20  # walks went past depth 1: the tree's own nodes were tested


def exact_second_token(model, prompt: list[int], transform) -> np.ndarray:
    """P(x2) = sum over x1 of p(x1 | prompt) p(x2 | prompt, x1), from the target itself."""
    p1 = np.array(mx.exp(transform(model(mx.array([prompt]))[0, -1])), dtype=np.float64)
    support = np.nonzero(p1)[0]
    batch = mx.array([prompt + [int(t)] for t in support])
    p2 = np.array(mx.exp(transform(model(batch)[:, -1])), dtype=np.float64)
    return p1[support] @ p2


class NoisyOracleDraft(BlockByBlock, DFlashDraft):
    """For the first cycle after `prompt`: the target's own next-token logits plus fixed noise,
    so the drafter's q overlaps the target's p without equalling it."""

    def __init__(self, draft: DFlashDraft, model, prompt: list[int]):
        super().__init__(draft.config)
        self.update(draft.parameters())
        object.__setattr__(self, "target", model)
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "noise", 1.5 * mx.random.normal((draft.config.vocab_size,)))

    def block_logits(self, block, embed, lm_head, cache):
        assert cache[0].offset == len(self.prompt) and block.shape[0] == 2
        context = mx.array([self.prompt + block[:1].tolist()])
        return self.target(context)[0, -1:] + self.noise


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9)])
def test_generation_is_exact_in_distribution(loaded, setting):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = [0, 39, 259, 28]  # a prompt whose next-token distribution is broad
    expected = exact_second_token(model, prompt, make_logprobs_transform(**setting))
    mx.random.seed(3)
    drafter = NoisyOracleDraft(draft, model, prompt)
    tokens, accepted = sample_runs(model, drafter, tokenizer, prompt, 2, **setting)
    assert 0.02 < np.mean(accepted) < 0.98  # both the accept and the resample paths ran
    assert chi2_pvalue(np.array([t[1] for t in tokens]), expected) > SIGNIFICANCE


def sample_runs(model, drafter, tokenizer, prompt, block_size: int, seeded=False, **setting):
    """The tokens of 600 generations of one full cycle after the prefill, and how many
    drafts each one's cycle accepted (`seeded`: generation i with seed i, its own stream).
    600 is enough: a residual drawn from p instead of max(p - q, 0) fails the block-of-four
    check with p-values of 1e-5 to 1e-12."""
    tokens, accepted = [], []
    for run in range(600):
        responses = list(
            stream_generate(
                model,
                drafter,
                tokenizer,
                prompt,
                block_size,
                max_tokens=block_size + 1,
                seed=run if seeded else None,
                **setting,
            )
        )
        tokens.append([t for r in responses for t in r.tokens])
        accepted.append(responses[1].accepted)
    return tokens, accepted


def test_speculative_rule_accepts_more_than_matching():
    """Acceptance of one draft: sum(min(p, q)) for speculative sampling, sum(p * q) for
    matching the target's own sample; the first is never smaller."""
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(8), size=2)
    q = rng.dirichlet(np.ones(8), size=1)
    p_log, q_log = mx.log(mx.array(p, mx.float32)), mx.log(mx.array(q, mx.float32))
    expected = {"speculative": np.minimum(p[0], q[0]).sum(), "match": (p[0] * q[0]).sum()}
    trials = 4000
    for rule, rate in expected.items():
        verifier = make_verifier(1.0, acceptance=rule)
        verifier.transform = lambda logits: logits  # the "logits" are log p already
        mx.random.seed(5)
        hits = sum(
            verifier.verify(mx.random.categorical(q_log), q_log, p_log).matches.item()
            for _ in range(trials)
        )
        assert abs(hits / trials - rate) < 4 * np.sqrt(rate * (1 - rate) / trials), rule
    assert expected["speculative"] > 1.5 * expected["match"]


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match="acceptance"):
        make_verifier(0.5, acceptance="eager")
    with pytest.raises(ValueError, match="temperature"):
        make_verifier(-1.0)


def test_speculative_sampling_with_a_processor_emits_the_processed_distribution():
    """With a processor that depends on earlier tokens, the first token follows the target
    processed after the context, and the next one, after an accepted draft a, the target
    processed after context + [a]: each position sees exactly the tokens before it."""
    rng = np.random.default_rng(4)
    vocab, context = 5, [0, 3]
    p = rng.dirichlet(np.ones(vocab), size=3)
    q = rng.dirichlet(np.ones(vocab), size=2)
    p_logits, q_logits = mx.log(mx.array(p, mx.float32)), mx.log(mx.array(q, mx.float32))
    penalty = 1.5
    processors = [make_presence_penalty(penalty, 20)]
    verifier = make_verifier(1.0, acceptance="speculative", processors=processors)

    def processed(row: np.ndarray, seen: list[int]) -> np.ndarray:
        out = np.log(row) - penalty * np.isin(np.arange(vocab), seen)
        return np.exp(out) / np.exp(out).sum()

    mx.random.seed(2)
    first, after = [], {a: [] for a in range(vocab)}
    for _ in range(6000):
        drafts, q_logprobs = verifier.propose(q_logits, context)
        verdict = verifier.verify(drafts, q_logprobs, p_logits, context)
        d, m = drafts.tolist(), verdict.matches.tolist()
        n = 0 if not m[0] else 1 if not m[1] else 2
        assert verdict.accepted.item() == n
        tokens = d[:n] + [verdict.token.item()]
        first.append(tokens[0])
        if n >= 1:
            after[d[0]].append(tokens[1])
    assert chi2_pvalue(np.array(first), processed(p[0], context)) > SIGNIFICANCE
    groups = [a for a in range(vocab) if len(after[a]) >= 300]
    assert len(groups) >= 2
    for a in groups:
        expected = processed(p[1], context + [a])
        assert chi2_pvalue(np.array(after[a]), expected) > SIGNIFICANCE / vocab


def exact_marginals(model, prompt: list[int], transform, depth: int) -> list[np.ndarray]:
    """P(x_k) for k = 1..depth, summing over every sampled path (support kept small by top-k)."""
    paths, weights, marginals = [prompt], np.ones(1), []
    for _ in range(depth):
        p = np.array(mx.exp(transform(model(mx.array(paths))[:, -1])), dtype=np.float64)
        marginals.append(weights @ p)
        rows, tokens = np.nonzero(p)
        paths = [paths[r] + [int(t)] for r, t in zip(rows, tokens)]
        weights = weights[rows] * p[rows, tokens]
    return marginals


class NoisyBlockOracleDraft(BlockByBlock, DFlashDraft):
    """First cycle after `prompt`: row j is the target's next-token logits along its greedy
    path plus fixed noise, so drafts are often but not always accepted at every depth.
    Later cycles draft from uniform logits (speculative sampling is exact for any q)."""

    def __init__(self, draft: DFlashDraft, model, prompt: list[int], seed: int):
        super().__init__(draft.config)
        self.update(draft.parameters())
        object.__setattr__(self, "target", model)
        object.__setattr__(self, "prompt", prompt)
        noise = mx.random.normal((16, draft.config.vocab_size), key=mx.random.key(seed))
        object.__setattr__(self, "noise", noise)
        object.__setattr__(self, "rows", {})  # per first token: the same rows every run

    def block_logits(self, block, embed, lm_head, cache):
        n = block.shape[0] - 1
        if cache[0].offset != len(self.prompt):
            return mx.zeros((n, self.config.vocab_size))
        path = self.prompt + block[:1].tolist()
        if (path[-1], n) not in self.rows:
            for _ in range(n - 1):
                path.append(int(mx.argmax(self.target(mx.array([path]))[0, -1])))
            rows = self.target(mx.array([path]))[0, -n:] + self.noise[:n]
            self.rows[path[len(self.prompt)], n] = mx.eval(rows) or rows
        return self.rows[block[:1].item(), n]


BLOCK4 = {
    "speculative": dict(temperature=0.8, top_k=5, min_p=0.05),
    "speculative-seeded": dict(temperature=0.8, top_k=5, min_p=0.05, seeded=True),
    "match": dict(temperature=1.0, top_k=4, acceptance="match"),
    "speculative-xtc": dict(temperature=0.9, top_k=5, xtc_probability=0.5, xtc_threshold=0.05),
    "coupled-xtc": dict(
        temperature=0.9, top_k=6, xtc_probability=0.5, xtc_threshold=0.05, acceptance="coupled"
    ),
    "custom-sampler": dict(sampler=make_sampler(1.0, top_k=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCK4)
def test_block_of_four_is_exact_in_distribution(loaded, name):
    """Tokens 3 and 4 come from accepted drafts, resamples or bonus tokens: each marginal
    must be the target's own, whatever the acceptance rule or sampler, and across replies
    seeded 0, 1, 2, ... each from its own stream."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    setting = BLOCK4[name]
    prompt = [0, 39, 259, 28]
    law = dict(temperature=1.0, top_k=4) if "sampler" in setting else setting
    transform = make_logprobs_transform(
        **{k: v for k, v in law.items() if k not in ("acceptance", "seeded")}
    )
    expected = exact_marginals(model, prompt, transform, 4)
    drafter = NoisyBlockOracleDraft(draft, model, prompt, seed=1)
    mx.random.seed(4)
    tokens, accepted = sample_runs(model, drafter, tokenizer, prompt, 4, **setting)
    counts = np.bincount(accepted, minlength=4)
    assert counts[0] > 0 and counts[1:].sum() > 0  # both accepted drafts and resamples ran
    for k in (2, 3):
        assert chi2_pvalue(np.array([t[k] for t in tokens]), expected[k]) > SIGNIFICANCE


def test_a_coupled_verifier_refuses_to_verify_without_its_position():
    """Without `at(position, vocab)` every cycle would draw the same noise: not a sample."""
    verifier = make_verifier(temperature=1.0)
    drafts, logits = mx.array([1, 2], dtype=mx.uint32), mx.zeros((3, 8))
    with pytest.raises(ValueError, match="needs at"):
        verifier.verify(drafts, None, logits)
    verifier.at(5, 8)
    assert verifier.verify(drafts, None, logits).token.item() in range(8)


def peaked_rows(rng: np.random.Generator, rows: int, vocab: int) -> mx.array:
    """Logits whose mass sits on a few tokens (the rest ~e^-40 as likely), like a language
    model's confident rows: a nucleus inside the drafter's near candidates."""
    logits = rng.normal(-30.0, 1.0, size=(rows, vocab))
    for row in logits:
        row[rng.choice(vocab, size=12, replace=False)] = rng.normal(3.0, 1.5, size=12)
    return mx.array(logits.astype(np.float32))


@pytest.mark.parametrize("setting", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0)])
def test_coupled_drafts_are_the_full_transforms_where_the_nucleus_is_near(setting):
    """Where a row's nucleus lies inside its near candidates, the drafter's cheap ranking (or,
    unfiltered, its unnormalised scores) drafts what the full-vocabulary transform would:
    argmax(log q + G) at each row's position."""
    rng = np.random.default_rng(2)
    vocab, disagreements = 4096, 0
    for trial in range(40):
        verifier = make_verifier(**setting, seed=trial).for_reply()
        verifier.at(100 + trial, vocab)
        logits = peaked_rows(rng, 5, vocab)
        drafts, _ = verifier.propose(logits)
        noise = mx.array(
            np.stack([position_noise(verifier.seed, 100 + trial + i, vocab) for i in range(5)])
        )
        exact = mx.argmax(make_logprobs_transform(**setting)(logits) + noise, axis=-1)
        disagreements += (drafts != exact.astype(drafts.dtype)).sum().item()
    assert disagreements == 0


def test_coupled_trees_rank_near_candidates_as_the_full_transform():
    """`tree_scores` keeps each depth's near candidates' log q + G and nothing else: the same
    top-2 per depth as the full transform's, over a draft vocabulary's columns too."""
    rng = np.random.default_rng(3)
    vocab, setting = 3000, dict(temperature=0.8, top_p=0.9)
    token_ids = sorted(rng.choice(vocab, size=2048, replace=False).tolist())
    for trial in range(20):
        verifier = make_verifier(**setting, seed=trial).for_reply()
        verifier.at(7, vocab)
        logits = peaked_rows(rng, 3, len(token_ids))
        cheap = best_columns(verifier.tree_scores(logits, token_ids), 2)
        noise = np.stack([position_noise(verifier.seed, 7 + i, vocab) for i in range(3)])
        full = make_logprobs_transform(**setting)(logits) + mx.array(noise[:, token_ids])
        assert cheap == best_columns(full, 2)


def best_columns(scores: mx.array, k: int) -> list[list[int]]:
    """Each row's k best columns, best first."""
    return np.argsort(-np.array(scores), axis=-1, kind="stable")[:, :k].tolist()


def test_coupled_verify_chooses_rows_only_up_to_the_first_rejection():
    """On the CPU the coupled verdict reads the target's rows one by one: the same accepted
    count and token as every row's coupled choice, for accepted + 1 rows' choices."""
    rng = np.random.default_rng(4)
    vocab, rows = 50, 6
    setting = dict(temperature=0.9, top_p=0.95)
    transform, choice = make_logprobs_transform(**setting), make_coupled_choice(**setting)
    for trial in range(30):
        chosen = []

        def counted(logits, noise, chosen=chosen):
            chosen.append(logits.shape[0])
            return choice(logits, noise)

        verifier = Verifier(
            transform, "coupled", coupled_choice=counted, row_by_row=True, seed=trial
        )
        verifier.at(3, vocab)
        logits = mx.array(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
        noise = mx.array(np.stack([position_noise(trial, 3 + i, vocab) for i in range(rows)]))
        choices = mx.argmax(transform(logits) + noise, axis=-1).tolist()
        agree = int(rng.integers(0, rows))  # drafts agreeing with the first `agree` choices
        drafts = choices[:agree] + [(c + 1) % vocab for c in choices[agree : rows - 1]]
        verdict = verifier.verify(mx.array(drafts, dtype=mx.uint32), None, logits)
        assert verdict.accepted.item() == agree
        assert verdict.token.item() == choices[agree]
        assert verdict.matches.tolist() == [i < agree for i in range(rows - 1)]
        assert sum(chosen) == agree + 1


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_coupled_choice_is_the_full_transforms_argmax_bit_for_bit(top_p):
    """The best of the whole row stands for the nucleus's best only where it is surely
    inside; rows where it may not be (flat ones) take the full transform: the same choices."""
    rng = np.random.default_rng(6)
    setting = dict(temperature=0.7, top_p=top_p)
    for vocab, scale in [(49152, 3.0), (2000, 0.5)]:
        logits = mx.array(rng.normal(size=(64, vocab)).astype(np.float32) * scale)
        noise = mx.array(np.stack([position_noise(6, i, vocab) for i in range(64)]))
        full = mx.argmax(make_scores_transform(**setting)(logits) + noise, axis=-1)
        assert make_coupled_choice(**setting)(logits, noise).tolist() == full.tolist()


def test_the_coupled_draft_ranking_reads_spared_xtc_tokens_as_no_columns():
    """Its rows are candidate columns, not the vocabulary: a spared token id is none of them
    (indexing a row by it would write past the row)."""
    mx.random.seed(6)
    logits = mx.random.normal((3, 5000)) * 4
    xtc = dict(xtc_probability=0.5, xtc_threshold=0.05)
    spared = make_draft_ranking(1.0, **xtc, xtc_special_tokens=(4999, 17))(logits)
    plain = make_draft_ranking(1.0, **xtc)(logits)
    assert all(np.array_equal(a, b) for a, b in zip(spared, plain, strict=True))


def test_scores_are_the_transform_up_to_a_constant_per_row():
    mx.random.seed(5)
    logits = mx.random.normal((3, 1000)) * 3
    for setting in SETTINGS:
        scores = make_scores_transform(**setting)(logits)
        logprobs = make_logprobs_transform(**setting)(logits)
        assert np.array_equal(np.array(scores - logsumexp(scores)), np.array(logprobs))


def test_position_noise_is_standard_gumbel_and_keyed_by_seed_and_position():
    noise = position_noise(7, 11, 200_000)
    assert noise.dtype == np.float32 and np.isfinite(noise).all()
    assert kstest(noise, gumbel_r.cdf).pvalue > SIGNIFICANCE
    assert np.array_equal(position_noise(7, 11, 1000), noise[:1000])
    for other in (position_noise(7, 12, 1000), position_noise(8, 11, 1000)):
        assert abs(np.corrcoef(other, noise[:1000])[0, 1]) < 0.15
