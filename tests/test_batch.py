"""Several replies decoded together (`make_batch`: `scheduler.Batch`, whose shared cycles are
`cycle.py`'s for several rows): every reply equals its own greedy reply, whatever else
shares its cycles, joins or leaves."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import reference_greedy, rows_equal_each_alone
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_families import NoisyOracleDraft as NoisyContinuation
from test_sampling import SIGNIFICANCE, NoisyOracleDraft, chi2_pvalue, exact_second_token

from dflash_mlx import make_batch, make_prompt_cache, stream_generate
from dflash_mlx.decode.adaptive import Plan
from dflash_mlx.decode.plan import FixedPlan
from dflash_mlx.decode.proposers import DrafterProposer, Proposer, observe
from dflash_mlx.decode.sampling import make_logprobs_transform
from dflash_mlx.models.target import TargetAdapter

MAX_TOKENS = 40


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, 300, size=int(rng.integers(3, 30))).tolist() for _ in range(count)]


def no_eos(tokenizer) -> TokenizerWrapper:
    wrapper = TokenizerWrapper(tokenizer._tokenizer)
    wrapper.eos_token_ids = []
    return wrapper


def interleave(generators: dict) -> dict:
    """Each generator's tokens, pulled one response at a time, round-robin."""
    tokens = {key: [] for key in generators}
    live = dict(generators)
    while live:
        for key, gen in list(live.items()):
            response = next(gen, None)
            if response is None:
                del live[key]
            else:
                tokens[key] += response.tokens
    return tokens


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-tied-gqa"])
def test_batched_replies_equal_their_own_greedy_replies(loaded, launched, name):
    model, tokenizer, draft = loaded(name)
    tokenizer = no_eos(tokenizer)
    batch = make_batch(model, draft)
    expected, generators = {}, {}
    for i, prompt in enumerate(prompts(4)):
        truth = reference_greedy(model, prompt, MAX_TOKENS + 16, set())
        expected[i] = truth[:MAX_TOKENS]
        oracle = NoisyContinuation(draft, prompt + truth)
        generators[i] = stream_generate(
            model, oracle, tokenizer, prompt, max_tokens=MAX_TOKENS, batch=batch
        )
    assert interleave(generators) == expected
    widths = {rows for rows, _, _ in launched}
    assert max(widths) >= 3  # they shared cycles
    assert {rows for rows, _ in batch.widths.policies} == widths - {1}  # each width measured
    assert not batch.replies and batch.held is None  # all gone, the capture closed


def test_replies_join_and_leave_between_cycles(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokenizer = no_eos(tokenizer)
    batch = make_batch(model, draft)
    texts = prompts(5)
    truths = [reference_greedy(model, p, MAX_TOKENS + 16, set()) for p in texts]

    def reply(i, **kwargs):
        oracle = NoisyContinuation(draft, texts[i] + truths[i])
        return stream_generate(
            model, oracle, tokenizer, texts[i], max_tokens=MAX_TOKENS, batch=batch, **kwargs
        )

    first, second = reply(0), reply(1)
    got = {0: next(first).tokens, 1: next(second).tokens}
    for _ in range(2):
        got[0] += next(first).tokens
        got[1] += next(second).tokens
    cache = make_prompt_cache(model, draft)
    leaving = reply(2, prompt_cache=cache)
    left = next(leaving).tokens + next(leaving).tokens
    leaving.close()  # a client gone mid-reply: only its reply stops
    # its caches hold what `tokens` lists: the prompt and the reply but its last token
    assert cache.tokens == texts[2] + left[:-1]
    assert {c.offset for c in cache.target} == {len(cache.tokens)}
    assert {c.offset for c in cache.draft} == {len(cache.tokens)}
    rest = interleave({0: first, 1: second, 3: reply(3), 4: reply(4, block_size=1)})
    for i in (0, 1):
        assert got[i] + rest[i] == truths[i][:MAX_TOKENS]
    for i in (3, 4):
        assert rest[i] == truths[i][:MAX_TOKENS]
    assert left == truths[2][: len(left)]


def test_a_cycle_prefills_at_most_prompt_concurrency_new_replies(loaded):
    """A burst of new replies joins a cycle or two at a time (`--prompt-concurrency`), each
    still its own greedy reply."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokenizer = no_eos(tokenizer)
    batch = make_batch(model, draft, prompt_concurrency=2)
    texts = prompts(5)
    generators = {i: stream_generate(model, draft, tokenizer, p, max_tokens=12, batch=batch)
                  for i, p in enumerate(texts)}  # fmt: skip
    # the first cycle prefills two and launches their first tokens' cycle; the second
    # commits those tokens and prefills two more, one still waiting
    first = next(generators[0])
    assert len(first.tokens) == 1 and len(batch.replies) == 4 and len(batch.joining) == 1
    tokens = interleave(generators)
    tokens[0] = first.tokens + tokens[0]
    assert tokens == {i: reference_greedy(model, p, 12, set()) for i, p in enumerate(texts)}


def test_the_shipped_kind_of_drafter_and_plain_rows_share_cycles(loaded):
    """A real (random) drafter and replies without one, at EOS or the token limit."""
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    eos = set(tokenizer.eos_token_ids)
    batch = make_batch(model, draft)
    generators, expected = {}, {}
    for i, prompt in enumerate(prompts(6)):
        limit = 10 + 7 * i
        expected[i] = reference_greedy(model, prompt, limit, eos)
        drafter = draft if i % 2 else None
        generators[i] = stream_generate(
            model, drafter, tokenizer, prompt, max_tokens=limit, batch=batch
        )
    assert interleave(generators) == expected


def test_a_batch_of_one_is_the_single_reply_path(loaded, launched):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompts(1)[0]
    alone = [r.tokens for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=30)]
    batch = make_batch(model, draft)
    shared = stream_generate(model, draft, tokenizer, prompt, max_tokens=30, batch=batch)
    assert [r.tokens for r in shared] == alone
    assert {rows for rows, _, _ in launched} == {1}  # one reply never shares a cycle


def test_one_drafter_forward_proposes_for_each_row_what_it_would_alone(loaded):
    """`append_context`, `propose` and `trees` over rows with contexts of different lengths,
    against one row at a time (DFlash 1; DFlash 2 and DSpark: their own test files)."""
    model, _, draft = loaded("llama-tied-gqa")
    rows_equal_each_alone(draft, model)


def test_observe_hands_each_row_its_kept_positions(loaded):
    """`proposers.observe` over rows (a row without a drafter among them): each drafter
    takes its row's first positions or its listed ones (a tree's path), as alone."""
    model, _, draft = loaded("llama-tied-gqa")
    target = TargetAdapter(model)
    width = len(draft.config.target_layer_ids) * target.hidden_size
    features = mx.random.normal((4, 6, width), key=mx.random.key(5))
    kept = [3, 2, [0, 2, 5], 1]

    def rows():
        drafting = [DrafterProposer(draft, target, draft.make_cache(), None) for _ in range(3)]
        return [drafting[0], Proposer(), *drafting[1:]]

    shared, alone = rows(), rows()
    observe(shared, features, kept)
    for i, proposer in enumerate(alone):
        observe([proposer], features[i : i + 1], kept[i : i + 1])
    for s, a in zip(shared, alone):
        if s.drafting is None:
            continue
        assert [c.offset for c in s.cache] == [c.offset for c in a.cache] != [0] * len(s.cache)
        for x, y in zip(s.cache, a.cache):
            assert mx.allclose(x.keys[..., : x.offset, :], y.keys[..., : y.offset, :], atol=1e-6)
    assert [c.offset for c in shared[2].cache] == [3] * len(draft.layers)


class RowsNoisyOracle(NoisyOracleDraft):
    """test_sampling's noisy oracle (q: the target's own next-token law after each row's root,
    plus fixed noise) for the rows of a shared cycle: what the cycle does with each row's q
    is under test, not the drafter's forward."""

    def propose(self, blocks, embed, lm_head, rows):
        return super().propose(blocks[:, :2], embed, lm_head, rows)


@pytest.mark.slow
def test_sampled_rows_of_shared_cycles_are_exact_in_distribution(loaded, launched):
    """600 replies in shared cycles of 4 rows, one draft each, accepted by speculative
    sampling: each reply's second token follows the target's own law."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = [0, 39, 259, 28]  # a prompt whose next-token distribution is broad
    expected = exact_second_token(model, prompt, make_logprobs_transform(temperature=1.0))
    mx.random.seed(11)
    oracle = RowsNoisyOracle(draft, model, prompt)
    seconds, accepted = [], []
    for _ in range(150):
        batch = make_batch(model, oracle)
        batch.widths.policy = lambda reply, rows: FixedPlan(Plan(1))  # one draft per row
        generators = [
            stream_generate(
                model, oracle, tokenizer, prompt, max_tokens=3, temperature=1.0, batch=batch
            )
            for _ in range(4)
        ]  # the four join the batch's first cycle: prefills, then one shared cycle
        replies = [[next(g) for g in generators] for _ in range(2)]
        assert max(rows for rows, _, _ in launched) == 4
        seconds += [r.tokens[0] for r in replies[1]]
        accepted += [r.accepted for r in replies[1]]
    assert 0.02 < np.mean(accepted) < 0.98  # both the accept and the resample paths ran
    assert chi2_pvalue(np.array(seconds), expected) > SIGNIFICANCE


def test_a_reply_dropped_unread_leaves_its_batch(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    batch = make_batch(model, draft)
    kept = stream_generate(model, draft, tokenizer, [5, 6, 7], max_tokens=6, batch=batch)
    dropped = stream_generate(model, draft, tokenizer, [8, 9], max_tokens=6, batch=batch)
    assert len(batch.joining) == 2  # both join the next cycle
    next(kept)
    assert len(batch.replies) == 2  # that cycle prefilled both
    del dropped  # never read: out at once, its caches as its tokens say
    assert len(batch.replies) == 1
    list(kept)
    assert batch.held is None  # the model is free for the next generation
    assert list(stream_generate(model, draft, tokenizer, [8, 9], max_tokens=6))


@pytest.mark.parametrize("settings", [dict(tree_budget=4), dict(block_size=4), {}])
def test_a_reply_closed_with_a_cycle_launched_keeps_its_caches_whole(loaded, settings):
    """Closed between two responses, whatever step launched its next cycle (a tree, a chain,
    the default's choice), the reply's caches hold exactly what its tokens list."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    cache = make_prompt_cache(model, draft)
    reply = stream_generate(
        model, draft, tokenizer, prompts(1)[0], max_tokens=30, prompt_cache=cache, **settings
    )
    next(reply), next(reply)
    reply.close()
    assert {c.offset for c in cache.target} == {len(cache.tokens)}
    assert {c.offset for c in cache.draft} == {len(cache.tokens)}


def test_the_rows_one_policy_plans_share_one_plan_per_cycle(loaded, launched):
    """A shared cycle asks each of its policies for one plan, which all its rows take (a
    probe of a larger size is the cycle's, measured at the size the cycle verified)."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    batch = make_batch(model, draft)
    plans = []

    class Counted(FixedPlan):
        def plan(self) -> Plan:
            plans.append(self.fixed)
            return self.fixed

    shared = Counted(Plan(1))
    batch.widths.policy = lambda reply, rows: shared
    generators = {
        i: stream_generate(model, draft, no_eos(tokenizer), p, max_tokens=12, batch=batch)
        for i, p in enumerate(prompts(3))
    }
    interleave(generators)
    shared_cycles = [rows for rows, _, _ in launched if rows > 1]
    # the first computes the three replies' first tokens (plain rows), the others are planned
    assert len(plans) == len(shared_cycles) - 1 > 2


def test_a_target_whose_forward_cannot_share_is_not_asked_every_cycle(tmp_path, monkeypatch):
    """DeepSeek-V3's MLA applies the attention mask itself, which a shared forward's per-row
    masks are not: its replies take their cycles in turns, each mlx-lm's, and after a failed
    shared launch the batch tries again only after a doubling number of cycles."""
    from helpers import build_tokenizer
    from mlx_lm.models import deepseek_v3
    from test_families import DEEPSEEK_V3
    from transformers import AutoTokenizer

    from dflash_mlx.decode import cycle

    mx.random.seed(0)
    model = deepseek_v3.Model(deepseek_v3.ModelArgs.from_dict(DEEPSEEK_V3))
    mx.eval(model.parameters())
    build_tokenizer(tmp_path)
    tokenizer = TokenizerWrapper(AutoTokenizer.from_pretrained(str(tmp_path)))
    tokenizer.eos_token_ids = []
    shared_tries = []
    launch = cycle.launch

    def counted(rows):
        shared_tries.extend([len(rows)] if len(rows) > 1 else [])
        return launch(rows)

    monkeypatch.setattr(cycle, "launch", counted)
    batch = make_batch(model, None)
    replies = prompts(2)
    generators = {
        i: stream_generate(model, None, tokenizer, p, max_tokens=MAX_TOKENS, batch=batch)
        for i, p in enumerate(replies)
    }
    tokens = interleave(generators)
    assert tokens == {
        i: reference_greedy(model, p, MAX_TOKENS, set()) for i, p in enumerate(replies)
    }
    assert 1 <= len(shared_tries) <= 6  # cycles 1, 3, 6, 11, 20, 37 of 40
