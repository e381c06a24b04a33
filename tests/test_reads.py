"""Device-to-host reads per cycle: a backend that runs ahead (Metal, CUDA) can queue the
next cycle only while the host is not waiting on this one, so each cycle reads once: a
tree is built on the device, from its root on the device (a plain step's token not yet
read), and read with the target's choices (with the probabilities of every node searched,
which size an adaptive tree's next cycle)."""

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from helpers import reference_greedy
from test_generate import prompt_of

from dflash_mlx import stream_generate

ARRAY_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def reads(monkeypatch) -> list[int]:
    """A counter (one element) of the host's reads from the device while the test runs:
    `mx.eval`, an array's `tolist`, `item` or conversion to a Python number, and numpy
    taking an array in."""
    count = [0]

    def counted(read, is_device=lambda *args: True):
        def wrapper(*args, **kwargs):
            count[0] += is_device(*args)
            return read(*args, **kwargs)

        return wrapper

    def takes_an_array(x=None, *args):
        return isinstance(x, mx.array)

    monkeypatch.setattr(mx, "eval", counted(mx.eval))
    for name in ARRAY_READS:
        monkeypatch.setattr(mx.array, name, counted(getattr(mx.array, name)))
    for name in ("array", "asarray"):
        monkeypatch.setattr(np, name, counted(getattr(np, name), takes_an_array))
    return count


def reads_per_response(responses: Iterator, reads: list[int]) -> list[int]:
    """How many reads each `next()` of `responses` made."""
    counts = []
    for _ in responses:
        counts.append(reads[0])
        reads[0] = 0
    return counts


def test_the_read_counter_sees_reads(reads):
    def steps():
        yield mx.array([1, 2]).tolist()
        yield np.array(mx.array([1.0])), np.array([1.0])
        yield [mx.eval(mx.array(1)), mx.array(3).item(), int(mx.array(4))]
        yield [1, 2]

    assert reads_per_response(steps(), reads) == [1, 1, 3, 0]


@pytest.mark.parametrize(
    "setting, drafted_reads",
    [
        (dict(block_size=4), 1),  # chain: drafts, accepted count and next token together
        (dict(block_size=1), 1),  # plain steps, each queued before the last is read
        (dict(block_size=4, temperature=0.7), 1),  # speculative sampling, residual on device
        (dict(tree_budget=4), 1),  # the tree, the lookup's chain grafted, with the choices
        (dict(tree_budget=4, prompt_lookup=False), 1),
        (dict(tree_budget=4, temperature=0.7), 1),  # the target's samples at the nodes
        (dict(), 1),  # the default: chains or trees, as measured
        (dict(tree_budget=4, adaptive=True), 1),  # sized from the tree before, read with this
    ],
)
def test_each_cycle_reads_the_device_once(loaded, reads, setting, drafted_reads):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = prompt_of(12, seed=3)
    mx.random.seed(0)
    responses = []
    runs = stream_generate(model, draft, tokenizer, prompt, max_tokens=24, **setting)
    counts = reads_per_response((responses.append(cycles_by_kind(r)) for r in runs), reads)
    assert len(counts) > 3  # counts[0]: the prefill's, not a cycle's
    kinds = [kind_of(a, b) for a, b in zip(responses, responses[1:])]
    for i, count in enumerate(counts[1:], start=1):
        # the last cycle may be too short to draft: one read
        assert count in {1, drafted_reads}, (i, counts, kinds)
    assert counts[1] == drafted_reads, counts
    # the default's probes queue a tree on a plain step's unread token, also read once; when
    # they come depends on the clock (a busy machine's run may probe none)


def cycles_by_kind(response) -> dict[str, int]:
    drafting = response.drafting
    return {"chain": drafting.chains, "tree": drafting.trees, "plain": drafting.plain}


def kind_of(before: dict[str, int], after: dict[str, int]) -> str:
    """What decoded the cycle between two responses."""
    return next((k for k in after if after[k] > before[k]), "none")


def test_a_lookup_only_tree_cycle_reads_once(loaded, reads):
    model, tokenizer, _ = loaded("llama-tied-gqa")
    prompt = prompt_of(6, seed=2) * 3  # a prompt that repeats itself: the lookup proposes
    responses = list(stream_generate(model, None, tokenizer, prompt, max_tokens=24, tree_budget=4))
    expected = reference_greedy(model, prompt, 24, set(tokenizer.eos_token_ids))
    assert [t for r in responses for t in r.tokens] == expected
    reads[0] = 0
    responses = stream_generate(model, None, tokenizer, prompt, max_tokens=24, tree_budget=4)
    counts = reads_per_response(responses, reads)
    assert set(counts[1:]) == {1}, counts
