"""A reduced draft vocabulary: drafts stay inside it, output stays exactly the target's."""

import argparse
import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import BlockByBlock, copy_dir, reference_greedy
from mlx.utils import tree_flatten
from test_sampling import SIGNIFICANCE, chi2_pvalue, exact_second_token, sample_runs

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.decode.sampling import make_logprobs_transform
from dflash_mlx.models.checkpoint import save_draft, set_draft_vocab
from dflash_mlx.models.draft import DFlashDraft
from dflash_mlx.models.target import RestrictedHead, TargetAdapter
from dflash_mlx.train import add_arguments, run
from dflash_mlx.train.export import export_published, top_tokens


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(4, 300, size=length).tolist()


class RecordingDraft(DFlashDraft):
    """The drafter with a reduced vocabulary, recording every block's draft logits."""

    def __init__(self, draft: DFlashDraft, vocab: list[int]):
        super().__init__(dataclasses.replace(draft.config, draft_vocab=vocab))
        self.update(draft.parameters())
        object.__setattr__(self, "seen", [])

    def draft_logits(self, blocks, embed, lm_head, caches):
        logits = super().draft_logits(blocks, embed, lm_head, caches)
        self.seen.append(logits)
        return logits


def half_vocab(tokenizer, draft: DFlashDraft, extra: list[int] = ()) -> list[int]:
    """Every other id, plus EOS, mask and `extra`: drafts must often fall outside."""
    vocab = set(range(0, draft.config.vocab_size, 2)) | set(tokenizer.eos_token_ids) | set(extra)
    return sorted(vocab | {draft.config.mask_token_id})


def assert_inside(drafter: RecordingDraft) -> None:
    inside = np.zeros(drafter.config.vocab_size, dtype=bool)
    inside[drafter.config.draft_vocab] = True
    assert drafter.seen
    for logits in drafter.seen:
        finite = np.isfinite(np.array(logits))
        assert finite[..., inside].all() and not finite[..., ~inside].any()


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-untied-mha"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_equals_mlx_lm_with_a_reduced_vocab(loaded, name, block_size):
    model, tokenizer, draft = loaded(name)
    prompt = prompt_of(23, seed=block_size)
    expected = reference_greedy(model, prompt, 64, set(tokenizer.eos_token_ids))
    drafter = RecordingDraft(draft, half_vocab(tokenizer, draft, expected[::3]))
    responses = list(
        stream_generate(model, drafter, tokenizer, prompt, block_size=block_size, max_tokens=64)
    )
    assert [t for r in responses for t in r.tokens] == expected
    assert_inside(drafter)


def test_sampled_drafts_stay_inside_and_are_accepted(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    drafter = RecordingDraft(draft, half_vocab(tokenizer, draft))
    mx.random.seed(3)
    responses = list(
        stream_generate(
            model, drafter, tokenizer, [5, 6, 7], 16, max_tokens=120, temperature=1.0
        )  # every cycle drafts the full block: a random drafter is rarely accepted
    )
    assert sum(r.accepted for r in responses) > 0
    assert_inside(drafter)


class RestrictedNoisyOracle(BlockByBlock, DFlashDraft):
    """First cycle only: the target's own last hidden state through the restricted head,
    plus noise, so q is 0 outside the draft vocabulary and overlaps p inside it."""

    def __init__(self, draft: DFlashDraft, model, prompt: list[int], vocab: list[int]):
        super().__init__(dataclasses.replace(draft.config, draft_vocab=vocab))
        self.update(draft.parameters())
        object.__setattr__(self, "target", model)
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "noise", 1.0 * mx.random.normal((draft.config.vocab_size,)))

    def block_logits(self, block, embed, lm_head, cache):
        hidden = self.target.model(mx.array([self.prompt + block[:1].tolist()]))[0, -1:]
        return lm_head(hidden) + self.noise


@pytest.mark.slow
def test_generation_is_exact_in_distribution_with_a_reduced_vocab(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = [0, 39, 259, 28]
    transform = make_logprobs_transform(1.0)
    p1 = np.array(mx.exp(transform(model(mx.array([prompt]))[0, -1])))
    vocab = np.argsort(-p1)[1::2].tolist()  # drops the most likely token, keeps others
    expected = exact_second_token(model, prompt, transform)
    mx.random.seed(4)
    drafter = RestrictedNoisyOracle(draft, model, prompt, vocab)
    tokens, accepted = sample_runs(model, drafter, tokenizer, prompt, 2, temperature=1.0)
    assert 0.02 < np.mean(accepted) < 0.98
    assert chi2_pvalue(np.array([t[1] for t in tokens]), expected) > SIGNIFICANCE


def heads() -> dict[str, tuple[nn.Module, object]]:
    """Each head kind with its full-vocabulary forward."""
    mx.random.seed(0)
    vocab, dim = 300, 64
    embedding = nn.Embedding(vocab, dim)
    linear = nn.Linear(dim, vocab, bias=True)
    q_embedding = nn.QuantizedEmbedding.from_embedding(embedding, group_size=32, bits=4)
    q_linear = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=8)
    q_mx = nn.QuantizedLinear(dim, vocab, bias=False, mode="mxfp4")
    return {
        "embedding": (embedding, embedding.as_linear),
        "linear": (linear, linear),
        "linear-no-bias": (nn.Linear(dim, vocab, bias=False),) * 2,
        "quantized-embedding": (q_embedding, q_embedding.as_linear),
        "quantized-linear": (q_linear, q_linear),
        "quantized-linear-mxfp4": (q_mx, q_mx),
    }


@pytest.mark.parametrize("kind", list(heads()))
def test_restricted_head_equals_the_full_heads_columns(kind):
    layer, full = heads()[kind]
    ids = sorted(np.random.default_rng(1).choice(300, 77, replace=False).tolist())
    x = mx.random.normal((15, 64))
    head = RestrictedHead(layer, ids)
    out, ref = head(x), full(x)
    assert out.shape == ref.shape
    assert mx.allclose(out[:, mx.array(ids)], ref[:, mx.array(ids)], atol=1e-5).item()
    assert mx.array_equal(head.rows(x), out[:, mx.array(ids)]).item()
    outside = np.setdiff1d(np.arange(300), ids)
    assert (np.array(out)[:, outside] == -np.inf).all()


def test_draft_head_is_the_full_head_without_a_vocab(loaded):
    model, _, _ = loaded("llama-untied-mha")
    target = TargetAdapter(model)
    head = target.draft_head(None)
    assert head.token_ids is None and head.rows is target.lm_head
    with pytest.raises(ValueError, match="draft vocabulary"):
        RestrictedHead(target.head, [target.vocab_size])


def test_vocab_survives_save_load_and_full_vocab_ignores_it(loaded, make_pair, tmp_path):
    _, _, draft = loaded("llama-tied-gqa")
    vocab = [1, 5, 7, draft.config.mask_token_id]
    drafter = RecordingDraft(draft, vocab)
    save_draft(drafter, tmp_path / "ours", "# card\n")
    assert dflash_mlx.load_draft(tmp_path / "ours").config.draft_vocab == vocab
    assert dflash_mlx.load_draft(tmp_path / "ours", full_vocab=True).config.draft_vocab is None
    export_published(drafter, tmp_path / "published", dtype="float32")
    assert dflash_mlx.load_draft(tmp_path / "published").config.draft_vocab == vocab

    _, published = make_pair("llama-tied-gqa")
    copy = copy_dir(published, tmp_path / "copy")
    set_draft_vocab(copy, [9, 3, 3])
    assert dflash_mlx.load_draft(copy).config.draft_vocab == [3, 9]
    set_draft_vocab(copy, None)
    assert dflash_mlx.load_draft(copy).config.draft_vocab is None
    with pytest.raises(ValueError, match="draft_vocab"):
        set_draft_vocab(copy, [draft.config.vocab_size])
    assert dflash_mlx.load_draft(copy).config.draft_vocab is None


def test_top_tokens_counts_replies_only():
    records = [
        {"ids": [50, 50, 50, 50, 3, 3, 4], "start": 4},
        {"ids": [60, 4, 8, 8, 3, 9], "start": 1},
    ]  # replies: 3 x3, 4 x2, 8 x2, 9 x1; the prompt's 50 and 60 are not counted
    assert top_tokens(records, 2) == [3, 4]
    assert top_tokens(records, 3) == [3, 4, 8]
    assert top_tokens(records, 3, always=[1, 99]) == [1, 3, 99]
    assert top_tokens(records, 10) == [3, 4, 8, 9]


def test_export_writes_the_most_frequent_reply_tokens(make_pair, loaded, tmp_path):
    target, _ = make_pair("llama-tied-gqa")
    _, tokenizer, draft = loaded("llama-tied-gqa")
    work = tmp_path / "work"
    (work / "ckpt").mkdir(parents=True)
    state = {"step": 7, "draft": draft.config.to_dict()}
    (work / "ckpt" / "state.json").write_text(json.dumps(state))
    weights = dict(tree_flatten(draft.parameters()))
    mx.save_safetensors(str(work / "ckpt" / "draft.safetensors"), weights)
    records = [{"ids": [2, 2, 40, 40, 40, 41, 41, 42], "start": 2}]
    (work / "replies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "out"
    argv = ["export", "--model", str(target), "--work", str(work), "--out", str(out)]
    run(parser.parse_args([*argv, "--draft-vocab", "4"]))
    always = {*tokenizer.eos_token_ids, draft.config.mask_token_id}
    assert set(dflash_mlx.load_draft(out).config.draft_vocab) == always | {40, 41}
