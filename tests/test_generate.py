"""The speculative loop: exact equality with mlx-lm's greedy decode, and its bookkeeping."""

import time

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from helpers import BlockByBlock, copy_dir, parse_mlx_lm_verbose, reference_greedy, set_eos

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.models.draft import DFlashDraft


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(4, 300, size=length).tolist()


def run(model, draft, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, draft, tokenizer, prompt, **kwargs))
    tokens = [t for r in responses for t in r.tokens]
    return tokens, responses


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("prompt_len", [1, 13, 200])
def test_greedy_equals_mlx_lm(loaded, block_size, prompt_len):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(prompt_len, seed=prompt_len)
    expected = reference_greedy(model, prompt, 48, set(tokenizer.eos_token_ids))
    tokens, responses = run(model, draft, tokenizer, prompt, block_size=block_size, max_tokens=48)
    assert tokens == expected
    assert responses[-1].generation_tokens == len(expected)


@pytest.mark.parametrize("name", ["llama-untied-mha", "qwen3-tied-gqa", "qwen3-untied-mha"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_mlx_lm_across_families(loaded, name, block_size):
    model, tokenizer, draft = loaded(name)
    prompt = prompt_of(31, seed=block_size)
    expected = reference_greedy(model, prompt, 64, set(tokenizer.eos_token_ids))
    tokens, _ = run(model, draft, tokenizer, prompt, block_size=block_size, max_tokens=64)
    assert tokens == expected


class OracleDraft(BlockByBlock, DFlashDraft):
    """Proposes the target's true greedy continuation: every draft must be accepted."""

    def __init__(self, draft: DFlashDraft, sequence: list[int]):
        super().__init__(draft.config)
        self.update(draft.parameters())
        object.__setattr__(self, "sequence", sequence)

    def block_logits(self, block, embed, lm_head, cache):
        start = cache[0].offset
        truth = mx.array(self.sequence[start + 1 : start + block.shape[0]])
        return 100.0 * mx.eye(self.config.vocab_size)[truth]


def oracle_for(model, tokenizer, draft, prompt: list[int], max_tokens: int, block_size: int):
    """(an OracleDraft for `prompt`, the τ every report must show for its reply).

    Every draft is accepted, so each cycle commits `block_size` tokens but the last;
    the first token comes from the prefill and counts in no cycle.
    """
    continuation = reference_greedy(model, prompt, max_tokens + block_size, set())
    reply = reference_greedy(model, prompt, max_tokens, set(tokenizer.eos_token_ids))
    cycles = -(-(len(reply) - 1) // block_size)
    return OracleDraft(draft, prompt + continuation), (len(reply) - 1) / cycles


def test_generate_prints_the_known_tau_of_an_oracle_drafter(loaded, capsys):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = prompt_of(9, seed=5)
    oracle, tau = oracle_for(model, tokenizer, draft, prompt, 30, 4)
    dflash_mlx.generate(model, oracle, tokenizer, prompt, verbose=True, block_size=4, max_tokens=30)
    cycles = round(29 / tau)
    drafted = 29 - cycles  # every draft accepted: each cycle adds one token after them
    assert (
        f"Speculation: {tau:.2f} tokens per verify cycle over {cycles} cycles, {drafted} of 30 "
        "tokens from accepted drafts"
    ) in capsys.readouterr().out
    assert tau > 3


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_oracle_drafter_is_fully_accepted(loaded, block_size):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = prompt_of(9, seed=1)
    max_tokens = 61
    expected = reference_greedy(model, prompt, max_tokens, set())
    oracle = OracleDraft(draft, prompt + expected)
    tokens, responses = run(
        model, oracle, tokenizer, prompt, block_size=block_size, max_tokens=max_tokens
    )
    assert tokens == expected
    cycles = responses[1:]
    assert all(r.accepted == r.proposed for r in cycles)
    assert all(r.proposed == block_size - 1 for r in cycles[:-1])
    assert [len(r.tokens) for r in cycles[:-1]] == [block_size] * (len(cycles) - 1)
    assert len(cycles) == -(-(max_tokens - 1) // block_size)


@pytest.fixture
def eos_run(make_pair, workdir):
    """(model, tokenizer, drafter, prompt, free_run, eos): a copy of the tiny llama whose EOS
    is a token its greedy run from `prompt` (`free_run`, 80 tokens without EOS) first makes
    after 20 tokens, so that a reply stops there."""
    target, draft_dir = make_pair("llama-tied-gqa")
    model = dflash_mlx.load(target)[0]
    prompt = prompt_of(17, seed=4)
    free_run = reference_greedy(model, prompt, 80, set())
    eos = next(t for i, t in enumerate(free_run) if i >= 20 and t not in free_run[:i])
    eos_dir = copy_dir(target, workdir / "eos-target")
    set_eos(eos_dir, eos)
    return (*dflash_mlx.load(eos_dir), dflash_mlx.load_draft(draft_dir), prompt, free_run, eos)


def test_eos_inside_a_block_stops_there(eos_run):
    model, tokenizer, draft, prompt, free_run, eos = eos_run
    stop = free_run.index(eos)
    oracle = OracleDraft(draft, prompt + free_run)
    for drafter in (draft, oracle):
        tokens, responses = run(model, drafter, tokenizer, prompt, block_size=16, max_tokens=80)
        assert tokens == free_run[: stop + 1]
        assert responses[-1].finish_reason == "stop"
        assert responses[-1].tokens[-1] == eos
    assert responses[-1].proposed == 15 and len(responses[-1].tokens) < 16


def test_plain_steps_queue_the_next_one_before_the_token_is_read(eos_run, monkeypatch):
    """At block 1 each step is queued on the last one's token before the host reads it, as
    mlx-lm decodes: a reply ended by EOS costs one forward more than it has tokens (the
    first token's included), whose position is dropped again, so the caches hold what
    `tokens` lists and the next turn reuses them losslessly; one cut by max_tokens costs no
    extra forward."""
    model, tokenizer, draft, prompt, free_run, eos = eos_run
    stop = free_run.index(eos)
    forwards = []
    forward = dflash_mlx.TargetAdapter.forward

    def counting(*args, **kwargs):
        if not kwargs.get("prompt"):  # a verify forward, not a prefill's prompt chunk
            forwards.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(dflash_mlx.TargetAdapter, "forward", counting)
    cache = dflash_mlx.make_prompt_cache(model, draft)
    tokens, _ = run(
        model, draft, tokenizer, prompt, block_size=1, max_tokens=80, prompt_cache=cache
    )
    assert tokens == free_run[: stop + 1]
    assert len(forwards) == len(tokens) + 1  # the last one queued on the EOS, then dropped
    assert cache.target[0].offset == cache.draft[0].offset == len(cache.tokens)
    assert cache.tokens == prompt + tokens[:-1]

    second = prompt + tokens + prompt_of(5, seed=5)
    expected = reference_greedy(model, second, 12, {eos})
    forwards.clear()
    tokens, _ = run(
        model, draft, tokenizer, second, block_size=1, max_tokens=12, prompt_cache=cache
    )
    assert tokens == expected and len(tokens) == 12
    assert len(forwards) == 12


@pytest.mark.parametrize("max_tokens", [1, 2, 17, 37])
def test_max_tokens_is_exact(loaded, max_tokens):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(5, seed=9)
    expected = reference_greedy(model, prompt, max_tokens, set())
    oracle = OracleDraft(draft, prompt + expected + [0] * 16)
    tokens, responses = run(model, oracle, tokenizer, prompt, block_size=16, max_tokens=max_tokens)
    assert tokens == expected and len(tokens) == max_tokens
    assert responses[-1].finish_reason == "length"
    assert all(r.finish_reason is None for r in responses[:-1])


def test_response_fields_and_text(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    tokens, responses = run(model, draft, tokenizer, "How many apples?", max_tokens=20)
    first = responses[0]
    assert len(first.tokens) == 1 and first.accepted == 0 and first.proposed == 0
    assert first.prompt_tokens == len(tokenizer.encode("How many apples?"))
    assert all(r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory > 0 for r in responses)
    assert [r.generation_tokens for r in responses] == list(
        np.cumsum([len(r.tokens) for r in responses])
    )
    assert "".join(r.text for r in responses) == tokenizer.decode(tokens)


def test_string_prompt_gets_a_single_bos(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    plain = next(stream_generate(model, draft, tokenizer, "hello world", max_tokens=1))
    with_bos = next(stream_generate(model, draft, tokenizer, "<s>hello world", max_tokens=1))
    assert plain.prompt_tokens == with_bos.prompt_tokens
    assert plain.tokens == with_bos.tokens


def test_prompt_types_agree(loaded):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    ids = tokenizer.encode("def add(a, b):")
    runs = [run(model, draft, tokenizer, p, max_tokens=12)[0] for p in (ids, mx.array(ids))]
    runs.append(run(model, draft, tokenizer, "def add(a, b):", max_tokens=12)[0])
    assert runs[0] == runs[1] == runs[2]


def test_generate_verbose_prints_mlx_lm_stats_then_what_drafting_did(loaded, capsys):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    mlx_lm.generate(model, tokenizer, "Alice has", max_tokens=10, verbose=True)
    theirs = parse_mlx_lm_verbose(capsys.readouterr().out)
    text = dflash_mlx.generate(model, draft, tokenizer, "Alice has", max_tokens=10, verbose=True)
    ours = parse_mlx_lm_verbose(capsys.readouterr().out)
    assert ours["reply"] == theirs["reply"] == text
    for count in ("prompt_tokens", "generation_tokens"):
        assert ours[count] == theirs[count]
    assert ours["prompt_tps"] > 0 and ours["generation_tps"] > 0 and ours["peak_memory"] > 0
    assert ours["rest"].startswith("Speculation: ") and ours["rest"].count("\n") == 1


def test_a_reply_without_text_is_reported_in_mlx_lm_words(loaded, capsys):
    """An end of sequence first: mlx_lm.generate's note instead of its stats, and ours."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    first = next(stream_generate(model, draft, tokenizer, "Alice has", max_tokens=1)).token
    tokenizer.add_eos_token(first)
    try:
        mlx_lm.generate(model, tokenizer, "Alice has", max_tokens=4, verbose=True)
        theirs = capsys.readouterr().out
        dflash_mlx.generate(model, draft, tokenizer, "Alice has", max_tokens=4, verbose=True)
        assert capsys.readouterr().out == theirs
    finally:
        tokenizer._eos_token_ids.discard(first)
    assert theirs.endswith("==========\nNo text generated for this prompt\n")


def test_sampling_runs_and_is_reproducible(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    outs = []
    for _ in range(2):
        mx.random.seed(42)
        outs.append(run(model, draft, tokenizer, [5, 6, 7], max_tokens=30, temperature=0.8)[0])
    assert outs[0] == outs[1] and len(outs[0]) == 30


def test_capture_hooks_are_removed_after_every_forward(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    classes = [type(layer) for layer in model.layers]
    attributes = [set(vars(layer)) for layer in model.layers]
    gen = stream_generate(model, draft, tokenizer, [5, 6], max_tokens=50)
    next(gen)
    assert [type(layer) for layer in model.layers] == classes  # between forwards: unhooked
    assert [set(vars(layer)) for layer in model.layers] == attributes
    gen.close()
    assert [type(layer) for layer in model.layers] == classes


def test_no_drafter_decodes_greedily_without_hooking_a_layer(loaded):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    classes = [type(layer) for layer in model.layers]
    prompt = prompt_of(17, seed=4)
    expected = reference_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))
    cache = dflash_mlx.make_prompt_cache(model, None)
    gen = stream_generate(model, None, tokenizer, prompt, max_tokens=30, prompt_cache=cache)
    tokens = list(next(gen).tokens)
    assert [type(layer) for layer in model.layers] == classes  # nothing hooked
    tokens += [t for r in gen for t in r.tokens]
    assert tokens == expected and cache.draft == []
    with pytest.raises(ValueError, match="needs a drafter"):
        stream_generate(model, None, tokenizer, prompt, block_size=4)
    with pytest.raises(ValueError, match="different drafter"):
        stream_generate(model, draft, tokenizer, prompt, prompt_cache=cache)


def test_randomly_initialised_drafter_for_a_target_is_lossless(loaded):
    from dflash_mlx.models.checkpoint import init_draft

    model, tokenizer, _ = loaded("qwen3-untied-mha")
    draft = init_draft(model, num_layers=3, block_size=8)
    assert draft.config.target_layer_ids == [1, 2, 3]
    assert draft.config.mask_token_id == draft.config.vocab_size - 1
    prompt = prompt_of(11, seed=2)
    expected = reference_greedy(model, prompt, 40, set(tokenizer.eos_token_ids))
    assert run(model, draft, tokenizer, prompt, max_tokens=40)[0] == expected


class RecordingPromptCache(dflash_mlx.PromptCache):
    """Remembers how many positions each generation found already in the cache."""

    def reuse(self, prompt: list[int]) -> int:
        self.reused = super().reuse(prompt)
        return self.reused


def test_prompt_cache_prefills_only_the_new_turn_and_stays_lossless(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    fresh = dflash_mlx.make_prompt_cache(model, draft)
    cache = RecordingPromptCache(fresh.target, fresh.draft)
    first = prompt_of(40, seed=11)
    reply, responses = run(model, draft, tokenizer, first, max_tokens=20, prompt_cache=cache)
    assert responses[0].prompt_tokens == 40 and cache.reused == 0
    second = first + reply + prompt_of(7, seed=12)
    expected = reference_greedy(model, second, 30, set(tokenizer.eos_token_ids))
    tokens, _ = run(model, draft, tokenizer, second, max_tokens=30, prompt_cache=cache)
    assert tokens == expected
    assert cache.reused == len(first) + len(reply) - 1  # the last reply token was never fed


def test_prompt_cache_survives_an_interrupted_reply(loaded):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    cache = dflash_mlx.make_prompt_cache(model, draft)
    first = prompt_of(25, seed=13)
    gen = stream_generate(model, draft, tokenizer, first, max_tokens=200, prompt_cache=cache)
    partial = [t for _, r in zip(range(4), gen) for t in r.tokens]
    gen.close()
    edited = first + partial[:2] + prompt_of(5, seed=14)  # history re-rendered differently
    expected = reference_greedy(model, edited, 25, set(tokenizer.eos_token_ids))
    assert run(model, draft, tokenizer, edited, max_tokens=25, prompt_cache=cache)[0] == expected
    assert cache.target[0].offset == cache.draft[0].offset == len(cache.tokens)


@pytest.mark.parametrize("prompt_len", [2048, 2049, 3000])
def test_prompts_longer_than_a_prefill_chunk_equal_mlx_lm(loaded, prompt_len):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    prompt = prompt_of(prompt_len, seed=prompt_len)
    expected = reference_greedy(model, prompt, 16, set(tokenizer.eos_token_ids))
    assert run(model, draft, tokenizer, prompt, max_tokens=16)[0] == expected


def test_generation_stops_where_the_context_is_full(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(4090, seed=3)  # the tiny targets hold 4096 positions
    tokens, responses = run(model, draft, tokenizer, prompt, max_tokens=100)
    assert len(tokens) == 6 and responses[-1].finish_reason == "length"


def test_prefill_never_builds_logits_for_the_whole_prompt(loaded):
    """A long prompt's logits would be prompt × vocabulary floats (1.2 GB for 2,048 tokens
    of Qwen's 151,936); like mlx-lm, only the last position may reach the LM head."""
    from mlx_lm.models import llama

    _, tokenizer, _ = loaded("llama-tied-gqa")
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=60_000,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    prompt = prompt_of(1500, seed=1)
    full_logits = len(prompt) * args.vocab_size * 4  # bytes of fp32 logits for every position
    mx.reset_peak_memory()
    response = next(stream_generate(model, None, tokenizer, prompt, max_tokens=1))
    assert response.peak_memory * 1e9 < full_logits / 4
    expected = mx.argmax(model(mx.array(prompt)[None])[0, -1]).item()
    assert response.tokens == [expected]


def test_each_reply_says_how_its_cycles_ran_and_why_drafting_was_off(loaded, monkeypatch):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(9, seed=5)
    for kwargs, reason in [({"block_size": 1}, "block size 1"), ({"draft": None}, "no drafter")]:
        responses = run(
            model, kwargs.pop("draft", draft), tokenizer, prompt, max_tokens=12, **kwargs
        )[1]
        drafting = responses[-1].drafting
        assert drafting.plain == drafting.cycles == len(responses) - 1
        assert drafting.off_since == 0 and reason in drafting.summary()
        assert drafting.as_dict()["drafting_off_since_cycle"] == 1

    # drafts that are never right are never worth their cost: the default falls back to
    # plain steps within a few cycles and says why
    prompt = prompt_of(9, seed=6)
    expected = reference_greedy(model, prompt, 120, set(tokenizer.eos_token_ids))
    wrong = next(t for t in range(4, 300) if t not in expected)

    head_logits = DFlashDraft.head_logits

    def never_right(self, hidden, lm_head):
        # and dear: a drafted cycle costs clearly more than a plain step, whatever else
        # loads the machine (a tiny target's steps are as cheap as its drafter's)
        time.sleep(0.05)
        logits = head_logits(self, hidden, lm_head)
        return mx.where(mx.arange(logits.shape[-1]) == wrong, 1e4, logits * 0)

    monkeypatch.setattr(DFlashDraft, "head_logits", never_right)
    responses = run(model, draft, tokenizer, prompt, max_tokens=120, prompt_lookup=False)[1]
    assert [t for r in responses for t in r.tokens] == expected
    drafting = responses[-1].drafting
    assert drafting.cycles == len(responses) - 1
    assert drafting.chains + drafting.trees + drafting.plain == drafting.cycles
    assert drafting.plain > drafting.cycles / 2, drafting.strategy
    assert drafting.off_since is not None and drafting.off_since < 30, drafting.summary()
    assert "did not pay" in drafting.as_dict()["drafting_off_reason"]
