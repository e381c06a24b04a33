"""A seeded reply draws from its own random stream: the same tokens alone and beside other
sampling (other replies, raw `mx.random` draws), other tokens for another seed; without a
seed the draws are MLX's global state's, as before."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.decode.sampling import Verifier, make_verifier
from dflash_mlx.settings import GenerationSettings

PROMPT = [0, 39, 259, 28]  # a prompt whose next-token distribution is broad
SHAPES = {
    "chain": dict(block_size=4),
    "tree": dict(tree_budget=6),
    "tree-processors": dict(
        tree_budget=6, logits_processors=make_logits_processors(repetition_penalty=1.3)
    ),
    "adaptive": dict(top_k=8),  # chains and trees as the strategy plans them
}


def reply(model, draft, tokenizer, **kwargs) -> list[int]:
    responses = stream_generate(model, draft, tokenizer, PROMPT, max_tokens=24, **kwargs)
    return [t for r in responses for t in r.tokens]


def interleaved(pair, **kwargs) -> tuple[list[int], list[int]]:
    """Replies with seeds 11 and 12 advanced a cycle each in turn, an unseeded sampled reply
    and raw draws from the global state between them; each its own copy of the model (one
    generation per model at a time)."""

    def generation(**more):
        model, tokenizer = dflash_mlx.load(pair[0])
        draft = dflash_mlx.load_draft(pair[1])
        return stream_generate(model, draft, tokenizer, PROMPT, max_tokens=24, **more)

    replies = [generation(seed=seed, **kwargs) for seed in (11, 12)]
    unseeded = generation(**kwargs)
    tokens: list[list[int]] = [[], []]
    live = [True, True]
    while any(live):
        for i, generator in enumerate(replies):
            response = next(generator, None) if live[i] else None
            live[i] = response is not None
            tokens[i] += response.tokens if response else []
            next(unseeded, None)
            mx.eval(mx.random.uniform(shape=(3,)), mx.random.categorical(mx.zeros((2, 9))))
    return tokens[0], tokens[1]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_seeded_reply_is_the_same_alone_and_beside_other_sampling(loaded, make_pair, shape):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    kwargs = dict(temperature=1.0, **SHAPES[shape])
    alone = [reply(model, draft, tokenizer, seed=seed, **kwargs) for seed in (11, 12)]
    mx.random.seed(0)
    beside = interleaved(make_pair("llama-tied-gqa"), **kwargs)
    assert list(beside) == alone
    assert len(alone[0]) == 24 and alone[0] != alone[1]  # another seed, another reply


def test_the_same_seed_gives_the_same_reply_on_a_qwen3_target(loaded):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    first = reply(model, draft, tokenizer, temperature=0.8, seed=5)
    mx.random.uniform(shape=(7,))  # the global state moves on: a seeded reply does not care
    assert reply(model, draft, tokenizer, temperature=0.8, seed=5) == first
    assert reply(model, draft, tokenizer, temperature=0.8, seed=6) != first


def test_a_keyed_verifier_draws_the_same_whatever_draws_in_between():
    """Every draw of a keyed verifier, the drafts', the acceptance uniforms, the residual
    and the bonus sample, comes from its own stream."""
    rng = np.random.default_rng(1)
    p_log = mx.log(mx.array(rng.dirichlet(np.ones(6), size=3), mx.float32))
    q_log = mx.log(mx.array(rng.dirichlet(np.ones(6), size=2), mx.float32))

    def cycles(draws_between: bool) -> list[tuple]:
        verifier = Verifier(transform=lambda logits: logits, key=mx.random.key(7))
        out = []
        for _ in range(300):
            drafts, q_logprobs = verifier.propose(q_log)
            if draws_between:
                mx.eval(mx.random.uniform(shape=(2,)), mx.random.categorical(p_log))
            verdict = verifier.verify(drafts, q_logprobs, p_log)
            out.append((*drafts.tolist(), verdict.accepted.item(), verdict.token.item()))
        return out

    mx.random.seed(0)
    alone = cycles(False)
    assert cycles(True) == alone
    assert {accepted for _, _, accepted, _ in alone} == {0, 1, 2}  # residuals and bonuses drawn


def test_without_a_seed_the_draws_are_the_global_states():
    """An unkeyed verifier makes the draws it always made, in the same order: uniforms for
    acceptance, the bonus sample, then the residual sample."""
    rng = np.random.default_rng(0)
    p_log = mx.log(mx.array(rng.dirichlet(np.ones(6), size=3), mx.float32))
    q_log = mx.log(mx.array(rng.dirichlet(np.ones(6), size=2), mx.float32))
    drafts = mx.array([1, 4])
    verifier = Verifier(transform=lambda logits: logits)  # the "logits" are log p already
    for seed in range(20):
        mx.random.seed(seed)
        verdict = verifier.verify(drafts, q_log, p_log)
        chosen = verifier.propose(p_log)[0]
        mx.random.seed(seed)
        uniforms = mx.random.uniform(shape=(2,))
        bonus = mx.random.categorical(p_log[-1])
        mx.random.categorical(mx.zeros((6,)))  # the residual draw
        p_x, q_x = mx.exp(p_log[[0, 1], [1, 4]]), mx.exp(q_log[[0, 1], [1, 4]])
        assert verdict.matches.tolist() == (uniforms * q_x < p_x).tolist()
        if verdict.accepted.item() == 2:
            assert verdict.token.item() == bonus.item()
        assert chosen.tolist() == mx.random.categorical(p_log).tolist()


def test_each_settings_copy_has_its_own_stream():
    settings = GenerationSettings(temperature=1.0, seed=3, acceptance="speculative")
    logits = mx.zeros((64, 1000))
    first = settings.verifier.propose(logits)[0].tolist()
    assert settings.verifier.propose(logits)[0].tolist() != first  # the stream moves on
    copy = settings.but(seed=3)
    assert copy.verifier.key is not settings.verifier.key
    assert copy.verifier.propose(logits)[0].tolist() == first  # a fresh one from the seed
    assert GenerationSettings(temperature=1.0).verifier.key is None


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "7"])
def test_bad_seeds_are_one_line_errors(seed):
    with pytest.raises(ValueError, match="seed must be an integer from 0 to 4294967295"):
        GenerationSettings(temperature=1.0, seed=seed)


def test_a_seed_cannot_reach_a_custom_sampler():
    with pytest.raises(ValueError, match="custom sampler"):
        make_verifier(sampler=make_sampler(1.0), seed=1)


COUPLED_SHAPES = [
    dict(block_size=2),
    dict(block_size=4),
    dict(block_size=4, adaptive=True),
    dict(tree_budget=3),
    dict(tree_budget=6, adaptive=True),
    dict(tree_budget=6, logits_processors=make_logits_processors(repetition_penalty=1.3)),
]


def test_a_coupled_reply_is_the_same_whatever_its_cycles(loaded):
    """Under the coupled rule a seeded reply is a function of its seed alone: the same for
    every block size, tree budget and the default strategy (timed by the clock), and alone
    or sharing batched cycles with another reply."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    kwargs = dict(temperature=1.0, top_p=0.95, acceptance="coupled")
    assert GenerationSettings(**kwargs).timed
    default = reply(model, draft, tokenizer, seed=11, **kwargs)
    assert len(default) == 24
    assert reply(model, draft, tokenizer, seed=12, **kwargs) != default
    processed = dict(logits_processors=make_logits_processors(repetition_penalty=1.3))
    with_processors = reply(model, draft, tokenizer, seed=11, **kwargs, **processed)
    for shape in COUPLED_SHAPES:
        expected = with_processors if "logits_processors" in shape else default
        assert reply(model, draft, tokenizer, seed=11, **kwargs, **shape) == expected, shape
    shared = []
    launch = dflash_mlx.decode.cycle.launch

    def counted(rows):
        shared.append(len(rows))
        return launch(rows)

    batch = dflash_mlx.make_batch(model, draft)
    pair = [
        stream_generate(model, draft, tokenizer, p, max_tokens=24, batch=batch, seed=s, **kwargs)
        for p, s in [(PROMPT, 11), ([0, 7, 19], 3)]
    ]
    tokens: list[list[int]] = [[], []]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dflash_mlx.decode.cycle, "launch", counted)
        for i, generation in [(i, g) for _ in range(30) for i, g in enumerate(pair)]:
            tokens[i] += next(generation).tokens if len(tokens[i]) < 24 else []
    assert shared and max(shared) == 2  # the two replies verified together
    assert tokens[0] == default
