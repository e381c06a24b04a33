"""The reference cycle (`decode/reference.py`) and the loop's `launch`/`settle` commit the
same tokens in the same cycles: greedy, one reply, a chain of a fixed block size."""

import mlx.core as mx
import pytest
from helpers import reference_greedy
from test_generate import OracleDraft, prompt_of

from dflash_mlx import stream_generate
from dflash_mlx.decode.reference import reference_cycles
from dflash_mlx.models.target import TargetAdapter


class OftenRight(OracleDraft):
    """Proposes the target's greedy continuation but at every third position, so that the
    cycles accept different numbers of drafts."""

    def block_logits(self, block, embed, lm_head, cache):
        start = cache[0].offset
        truth = self.sequence[start + 1 : start + block.shape[0]]
        wrong = [(t + 1) % 300 if (start + j) % 3 == 2 else t for j, t in enumerate(truth)]
        return 100.0 * mx.eye(self.config.vocab_size)[mx.array(wrong)]


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
