"""A failure inside a shared (batched) cycle ends only the reply that caused it: that reply
gets its error and every other reply of the batch is its solo reply; and a finished
reply, failed or not, is freed at once, without Python's cyclic collector."""

import gc
import weakref

import mlx.core as mx
import pytest
from helpers import reference_greedy
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_batch import no_eos, prompts

from dflash_mlx import make_batch, stream_generate
from dflash_mlx.decode.adaptive import Plan
from dflash_mlx.decode.plan import FixedPlan, learned_policy
from dflash_mlx.models.target import TargetAdapter

MAX_TOKENS = 24
CULPRIT = 1  # the reply that fails, among four
GROWN = 6  # tokens the culprit commits before it fails: it fails in a shared cycle


class Boom(RuntimeError):
    """The injected failure."""


def grown(reply, prompt: list[int]) -> bool:
    """Whether the reply has committed `GROWN` tokens (its caches hold them)."""
    return len(reply.state.tokens) >= len(prompt) + GROWN


def failing_processor(prompt: list[int]):
    """A logits processor that fails once the reply has grown."""

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size >= len(prompt) + GROWN:
            raise Boom("processor")
        return logits

    return processor


class FailingDetokenizer(TokenizerWrapper):
    """A tokenizer whose detokenizer fails at the reply's `GROWN`th token."""

    @property
    def detokenizer(self):
        detokenizer = super().detokenizer
        add_token, seen = detokenizer.add_token, []

        def add(token: int) -> None:
            seen.append(token)
            if len(seen) == GROWN:
                raise Boom("detokenize")
            add_token(token)

        detokenizer.add_token = add
        return detokenizer


def fail_drafting(reply, prompt, monkeypatch):
    """The culprit's drafter proposals fail (shared: in the one drafter forward of all rows)."""
    choose = reply.state.proposer.choose

    def failing(*args, **kwargs):
        if grown(reply, prompt):
            raise Boom("drafting")
        return choose(*args, **kwargs)

    monkeypatch.setattr(reply.state.proposer, "choose", failing)


def fail_observing(reply, prompt, monkeypatch):
    """The drafter fails to take in the target's features of the culprit's kept positions
    (shared: in one drafter pass for all rows, as the cycle settles)."""
    draft = reply.state.proposer.draft
    append = draft.append_context

    def failing(features, caches, counts=None):
        if any(c is reply.state.proposer.cache for c in caches) and grown(reply, prompt):
            raise Boom("observing")
        return append(features, caches, counts)

    monkeypatch.setattr(draft, "append_context", failing)


def fail_forward(reply, prompt, monkeypatch):
    """The target's forward fails on the culprit's caches, shared with other rows or not."""
    forward = TargetAdapter.forward

    def failing_forward(self, tokens, caches, *args, **kwargs):
        if any(cache is reply.state.cache for cache in caches or []) and grown(reply, prompt):
            raise Boom("forward")
        return forward(self, tokens, caches, *args, **kwargs)

    monkeypatch.setattr(TargetAdapter, "forward", failing_forward)


def fail_verdict(reply, prompt, monkeypatch):
    """The culprit's verdict (its acceptance of its drafts) fails."""
    verify = reply.state.verifier.verify

    def failing(*args, **kwargs):
        if grown(reply, prompt):
            raise Boom("verdict")
        return verify(*args, **kwargs)

    monkeypatch.setattr(reply.state.verifier, "verify", failing)


def join(batch, key, replies: dict, *args, **kwargs):
    """`stream_generate(*args, **kwargs)` in `batch`, its reply kept as `replies[key]`."""
    generator = stream_generate(*args, batch=batch, **kwargs)
    replies[key] = batch.joining[-1]
    return generator


def run(batch, generators: dict, replies: dict) -> tuple[dict, dict]:
    """Each generator's tokens, pulled one response at a time, round-robin, and the error
    each that failed raised (as text: a kept exception would keep its frames); a reply that
    fails is out of the batch at once."""
    tokens = {key: [] for key in generators}
    errors = {}
    live = dict(generators)
    while live:
        for key, gen in list(live.items()):
            try:
                response = next(gen, None)
            except Exception as exc:
                errors[key] = f"{type(exc).__name__}: {exc}"
                assert replies.pop(key) not in batch.replies
                del live[key]
                continue
            if response is None:
                del live[key]
            else:
                tokens[key] += response.tokens
    return tokens, errors


def shared_batch(model, draft):
    """A batch whose shared cycles draft 3 tokens a row (not as measured costs choose)."""
    batch = make_batch(model, draft)
    batch.widths.policy = lambda reply, rows: FixedPlan(Plan(3))
    return batch


INJECTED = {
    "processor": None,  # a logits processor of the culprit's (given with its settings)
    "drafting": fail_drafting,
    "observing": fail_observing,
    "forward": fail_forward,
    "verdict": fail_verdict,
    "detokenize": None,  # the culprit's tokenizer
}


@pytest.mark.parametrize("stage", list(INJECTED))
def test_a_failing_reply_ends_alone_the_others_are_their_solo_replies(
    loaded, monkeypatch, launched, stage
):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokenizer = no_eos(tokenizer)
    texts = prompts(4)
    truths = [reference_greedy(model, prompt, MAX_TOKENS, set()) for prompt in texts]
    batch, generators, replies = shared_batch(model, draft), {}, {}
    for i, prompt in enumerate(texts):
        culprit, replier = i == CULPRIT, tokenizer
        kwargs = dict(max_tokens=MAX_TOKENS, block_size=4)
        if culprit and stage == "processor":
            kwargs["logits_processors"] = [failing_processor(prompt)]
        if culprit and stage == "detokenize":
            replier = FailingDetokenizer(tokenizer._tokenizer)
            replier.eos_token_ids = []
        generators[i] = join(batch, i, replies, model, draft, replier, prompt, **kwargs)
        if culprit and INJECTED[stage]:
            INJECTED[stage](replies[i], prompt, monkeypatch)
    tokens, errors = run(batch, generators, replies)
    assert errors == {CULPRIT: f"Boom: {stage}"}
    assert tokens[CULPRIT] == truths[CULPRIT][: len(tokens[CULPRIT])]  # right up to its error
    assert {i: tokens[i] for i in (0, 2, 3)} == {i: truths[i] for i in (0, 2, 3)}
    assert max(rows for rows, _, _ in launched) == 4  # the four shared cycles
    assert not batch.replies and batch.held is None


def test_a_prefill_failure_ends_that_reply_alone(loaded):
    """mlx-lm's repetition penalty over a context longer than MLX slices reach fails as its
    reply's prompt is prefilled, in the cycle that prefills the others too."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokenizer = no_eos(tokenizer)
    texts = prompts(3)
    batch = make_batch(model, draft)
    penalty = make_logits_processors(repetition_penalty=1.1, repetition_context_size=2**31 + 5)
    generators, replies = {}, {}
    for i, prompt in enumerate(texts):
        kwargs = dict(max_tokens=MAX_TOKENS, logits_processors=penalty if i == CULPRIT else None)
        generators[i] = join(batch, i, replies, model, draft, tokenizer, prompt, **kwargs)
    tokens, errors = run(batch, generators, replies)
    assert errors == {CULPRIT: "ValueError: Slice indices must be 32-bit integers."}
    for i in (0, 2):
        assert tokens[i] == reference_greedy(model, texts[i], MAX_TOKENS, set())


def test_seeded_sampled_replies_beside_a_failing_one_are_their_solo_replies(loaded, launched):
    """The library's default strategy and coupled sampling: each seeded reply that shared
    its cycles with a reply that failed is the reply its seed gives alone."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokenizer = no_eos(tokenizer)
    texts = prompts(4)
    sampling = dict(max_tokens=MAX_TOKENS, temperature=1.0)
    alone = {}
    for i, prompt in enumerate(texts):
        responses = stream_generate(model, draft, tokenizer, prompt, seed=i, **sampling)
        alone[i] = [token for response in responses for token in response.tokens]
    del alone[CULPRIT]
    batch, generators, replies = shared_batch(model, draft), {}, {}
    for i, prompt in enumerate(texts):
        kwargs = dict(logits_processors=[failing_processor(prompt)]) if i == CULPRIT else {}
        generators[i] = join(
            batch, i, replies, model, draft, tokenizer, prompt, seed=i, **sampling, **kwargs
        )
    tokens, errors = run(batch, generators, replies)
    assert errors == {CULPRIT: "Boom: processor"}
    assert {i: tokens[i] for i in alone} == alone
    assert max(rows for rows, _, _ in launched) == 4


@pytest.mark.parametrize("failing", [False, True])
def test_finished_replies_are_freed_without_the_cyclic_collector(loaded, failing):
    """With the collector off, nothing of a finished reply stays: not its reply, step or
    sequence (weak references to them die), nor its arrays (MLX's active memory returns to
    where it stood), whether it ended at its limit, closed early, or (`failing`) failed. Its
    policy is the one kept for the next reply of this target and drafter, not one per reply."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokenizer = no_eos(tokenizer)
    texts = prompts(4)
    batch = make_batch(model, draft)

    def round_of_replies() -> list[weakref.ref]:
        generators, replies = {}, {}
        for i, prompt in enumerate(texts):
            culprit = failing and i == CULPRIT
            kwargs = dict(logits_processors=[failing_processor(prompt)]) if culprit else {}
            generators[i] = join(
                batch, i, replies, model, draft, tokenizer, prompt, max_tokens=MAX_TOKENS, **kwargs
            )
        assert all(r.policy is learned_policy(model, draft) for r in replies.values())
        kept = [(r, r.state, r.state.cache[0]) for r in replies.values()]
        refs = [weakref.ref(o) for objects in kept for o in objects]
        del kept
        next(generators[3])
        generators.pop(3).close()  # a client gone mid-reply
        del replies[3]
        tokens, errors = run(batch, generators, replies)
        assert list(errors) == ([CULPRIT] if failing else [])
        assert all(len(tokens[i]) == MAX_TOKENS for i in (0, 2))
        return refs

    gc.collect()
    gc.disable()
    try:
        round_of_replies()  # warm-up: compiled kernels, the policy's tables
        before = mx.get_active_memory()
        refs = [ref for _ in range(3) for ref in round_of_replies()]
        alive = [type(ref()).__name__ for ref in refs if ref() is not None]
        grown_by = mx.get_active_memory() - before
    finally:
        gc.enable()
    assert alive == []
    assert grown_by < 100_000  # a reply's caches alone hold more
