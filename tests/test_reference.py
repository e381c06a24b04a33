"""The reference cycle (`decode/reference.py`) and the loop's `launch`/`settle` commit the
same tokens in the same cycles: greedy, one reply, a chain of a fixed block size."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import BlockByBlock, reference_greedy

from dflash_mlx import stream_generate
from dflash_mlx.decode.reference import reference_cycles
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.target import TargetAdapter


class OftenRight(BlockByBlock, DFlashDraft):
    """Proposes the target's greedy continuation but at every third position, so that the
    cycles accept different numbers of drafts."""

    def __init__(self, draft: DFlashDraft, sequence: list[int]):
        super().__init__(draft.config)
        self.update(draft.parameters())
        object.__setattr__(self, "sequence", sequence)

    def block_logits(self, block, embed, lm_head, cache):
        start = cache[0].offset
        truth = self.sequence[start + 1 : start + block.shape[0]]
        wrong = [(t + 1) % 300 if (start + j) % 3 == 2 else t for j, t in enumerate(truth)]
        return 100.0 * mx.eye(self.config.vocab_size)[mx.array(wrong)]


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 300, size=length).tolist()


@pytest.mark.parametrize("oracle", [False, True], ids=["shipped-random", "often-right"])
@pytest.mark.parametrize(("block_size", "prompt_len"), [(4, 13), (8, 1), (16, 40)])
def test_the_loop_commits_what_the_reference_cycle_commits_cycle_by_cycle(
    loaded, oracle, block_size, prompt_len
):
    model, tokenizer, draft = loaded("qwen3-tied-gqa")
    prompt = prompt_of(prompt_len, seed=block_size)
    eos = set(tokenizer.eos_token_ids)
    if oracle:
        draft = OftenRight(draft, prompt + reference_greedy(model, prompt, 64, set()))
    expected = list(reference_cycles(TargetAdapter(model), draft, prompt, 40, block_size, eos))
    responses = stream_generate(
        model, draft, tokenizer, prompt, block_size=block_size, adaptive=False, max_tokens=40
    )
    assert [r.tokens for r in responses] == expected
    assert sum(expected, []) == reference_greedy(model, prompt, 40, eos)
    if oracle:  # cycles that accepted different numbers of drafts
        assert len({len(tokens) for tokens in expected[1:-1]}) >= 2
