"""`train fit --arch dflash2`: a DFlash 2 drafter trained with the token and selector losses,
exported in the published layout that loads strictly, converts and generates losslessly."""

from __future__ import annotations

import json

import helpers
import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.decode.sampling import make_verifier
from dflash_mlx.models.draft import DFlashConfig, DFlashDraft
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.train.blocks import block_hidden, selector_loss
from dflash_mlx.train.trainer import (
    DFlash2Shape,
    Sequence,
    TrainConfig,
    Trainer,
    checkpoint_draft,
    grow_draft,
    make_draft,
    step_batch,
)

TAPS = helpers.TRAIN_TAPS
SHAPE = ["--conv-group-size", "16", "--selector-top-k", "8", "--selector-rank", "8"]


@pytest.fixture(scope="module")
def tiny(train_target_dir):
    return dflash_mlx.load(train_target_dir)


def features_of(model, ids: np.ndarray) -> mx.array:
    target = TargetAdapter(model)
    return target.forward(mx.array(ids)[None], None, taps=TAPS, prompt=True).features[0]


def train_cli(*argv: str) -> None:
    cli.main(["train", *argv])


@pytest.fixture(scope="module")
def work(train_data, train_target_dir, tmp_path_factory):
    """A work dir with the target's replies to 64 prompts (one feature chunk) and features."""
    return helpers.train_work(
        train_data, tmp_path_factory.mktemp("train-dflash2"), train_target_dir
    )


@pytest.fixture
def fresh_work(train_data, train_target_dir, tmp_path):
    """A copy of the data and features without a checkpoint."""
    return helpers.train_work(train_data, tmp_path, train_target_dir)


def fixed_batch_losses(model, draft, work) -> dict[str, float]:
    """Token and selector loss of a drafter on the same blocks of the same four sequences."""
    pairs, vocab = helpers.fixed_blocks(work)
    losses, _, _ = Trainer(model, draft, TrainConfig(), vocab).block_hits(pairs)
    return losses


def test_fit_arch_dflash2_learns_and_exports_a_published_dflash2_drafter(tiny, work, tmp_path):
    model, tokenizer = tiny
    work, common = work
    fit = [
        "fit",
        *common,
        "--arch",
        "dflash2",
        *SHAPE,
        "--sliding-window",
        "12",
        "--layers",
        "1",
        "--block-size",
        "6",
        "--seqs-per-step",
        "4",
        "--blocks-per-seq",
        "8",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--soft-weight",
        "0",
        "--save-every",
        "1",
    ]
    train_cli(*fit, "--steps", "1")
    first, _ = checkpoint_draft(work / "ckpt")
    train_cli(*fit, "--steps", "40")  # resumes from step 1
    trained, step = checkpoint_draft(work / "ckpt")
    assert step == 40
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert {"token_loss", "selector_loss"} <= log[-1].keys()

    before = fixed_batch_losses(model, first, work)
    after = fixed_batch_losses(model, trained, work)
    assert after["token_loss"] < before["token_loss"] - 0.2, (before, after)
    assert after["selector_loss"] < before["selector_loss"] - 0.2, (before, after)

    out, published = tmp_path / "ours", tmp_path / "published"
    train_cli("export", *common, "--out", str(out), "--published", str(published))
    config = helpers.read_config(published)
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["layer_types"] == ["sliding_attention"] and config["sliding_window"] == 12
    assert config["is_causal"] is False
    dflash = config["dflash_config"]
    assert (dflash["block_size"], dflash["conv_kernel_size"], dflash["conv_group_size"]) == (
        6,
        2,
        16,
    )
    assert (dflash["selector_top_k"], dflash["selector_rank"]) == (8, 8)

    cli.main(["convert", str(published), "--out", str(tmp_path / "q4"), "-q"])
    prompt = tokenizer.encode("Speculative decoding drafts")
    expected = helpers.reference_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))
    for path in (published, out, tmp_path / "q4"):
        draft = dflash_mlx.load_draft(path)  # strict: every tensor named and shaped as configured
        assert draft.config.is_dflash2 and "candidate_selector" in draft
        responses = dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=30)
        assert [t for r in responses for t in r.tokens] == expected, path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "dflash3"], "argument --arch: invalid choice: 'dflash3'"),
        (["--selector-rank", "8"], "--selector-rank is a DFlash 2 setting: add --arch dflash2"),
        (
            ["--arch", "dflash2", "--conv-group-size", "24"],
            "--conv-group-size 24 must divide the target's hidden size 64",
        ),
        (["--arch", "dflash2", "--selector-top-k", "0"], "--selector-top-k must be at least 1"),
    ],
)
def test_arch_errors_are_one_line(fresh_work, capsys, argv, message):
    work, common = fresh_work
    with pytest.raises(SystemExit) as exit_:
        train_cli("fit", *common, "--work", str(work), *argv)
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err.splitlines()[-1], err
    if "invalid choice" not in message:  # argparse's own errors come after its usage line
        assert len(err.splitlines()) == 1, err


def test_resume_refuses_an_other_arch_in_one_line(fresh_work, capsys):
    work, common = fresh_work
    args = ["fit", *common, "--work", str(work), "--layers", "1", "--block-size", "6"]
    train_cli(*args, "--steps", "1", "--save-every", "1", "--blocks-per-seq", "2")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_cli(*args, "--arch", "dflash2", "--steps", "2")
    err = capsys.readouterr().err
    expected = (
        "holds a dflash1 drafter, not --arch dflash2: resume without that flag, "
        "or move ckpt/ away to start over"
    )
    assert err.strip().endswith(expected) and len(err.splitlines()) == 1, err


def test_init_from_a_dflash1_drafter_trains_it_as_dflash2_and_a_dflash2_one_keeps_its_shape(
    fresh_work, train_target_dir, capsys
):
    work, common = fresh_work
    config = helpers.read_config(train_target_dir)
    v1 = helpers.save_draft(work / "v1", config, layers=1, target_layer_ids=TAPS, block_size=6)
    v2 = helpers.save_draft(
        work / "v2", config, layers=1, target_layer_ids=TAPS, block_size=6, dflash2=helpers.DFLASH2
    )
    fit = ["fit", *common, "--work", str(work), "--layers", "1", "--steps", "1"]
    for argv, message in [
        ([str(v2), "--arch", "dflash1"], f"{v2} holds a dflash2 drafter, not --arch dflash1"),
        (
            [str(v2), "--arch", "dflash2", "--selector-rank", "4"],
            f"{v2} holds a drafter with selector-rank 8, not --selector-rank 4",
        ),
    ]:
        with pytest.raises(SystemExit):
            train_cli(*fit, "--init-from", *argv)
        err = capsys.readouterr().err
        assert err.strip().endswith(message) and len(err.splitlines()) == 1, err

    train_cli(*fit, "--init-from", str(v1), "--arch", "dflash2", *SHAPE, "--save-every", "1")
    draft, _ = checkpoint_draft(work / "ckpt")
    assert draft.config.is_dflash2 and draft.candidate_selector.top_k == 8


def test_selector_loss_is_the_cross_entropy_over_the_candidates_given_the_true_predecessor():
    """Candidates: the top-K of the logits (a label outside them replaces the weakest, in the
    loss only); score: unary + <A[true predecessor] * W h, B[candidate]>; a hit needs the
    label to be a real candidate."""
    vocab_size, hidden_size, k, rank = 12, 16, 4, 3
    mx.random.seed(0)
    draft = DFlashDraft(selector_config(vocab_size, hidden_size, k, rank))
    selector = draft.candidate_selector
    selector.predecessor_codebook = mx.random.normal((vocab_size, rank))
    selector.successor_codebook = mx.random.normal((vocab_size, rank))
    hidden = mx.random.normal((2, 5, hidden_size))
    logits = mx.random.normal((2, 5, 10))  # a loss vocabulary of 10 of the 12 tokens
    vocab = mx.array([0, 1, 2, 3, 5, 6, 7, 8, 9, 11])
    predecessors = mx.array(np.random.default_rng(1).integers(0, vocab_size, (2, 5)))
    top = np.argsort(-np.array(logits), axis=-1)
    labels = mx.array(np.where(np.arange(5) % 2 == 0, top[..., 1], top[..., 7]))  # in, out
    weights = mx.array(np.random.default_rng(2).uniform(0.5, 1.0, (2, 5)).astype(np.float32))
    loss, hits = selector_loss(selector, hidden, logits, predecessors, labels, weights, vocab)

    A = np.array(selector.predecessor_codebook, np.float64)
    B = np.array(selector.successor_codebook, np.float64)
    projected = np.array(selector.hidden_projection(hidden), np.float64)
    expected = 0.0
    for n in range(2):
        for t in range(5):
            label = int(labels[n, t].item())
            candidates = list(top[n, t, :k])
            present = label in candidates
            if not present:
                candidates[-1] = label
            ids = np.array(vocab)[candidates]
            a = int(predecessors[n, t].item())
            unary = np.array(logits[n, t], np.float64)[candidates]
            scores = unary + B[ids] @ (A[a] * projected[n, t])
            target = candidates.index(label)
            expected += weights[n, t].item() * (np.log(np.exp(scores).sum()) - scores[target])
            assert hits[n, t].item() == (present and int(np.argmax(scores)) == target)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert not np.array(hits)[:, 1::2].any()


def selector_config(vocab_size: int, hidden_size: int, k: int, rank: int):
    return DFlashConfig.from_dict(
        {
            "hidden_size": hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "vocab_size": vocab_size,
            "dflash_config": {
                "mask_token_id": vocab_size - 1,
                "target_layer_ids": [0],
                "selector_top_k": k,
                "selector_rank": rank,
            },
        }
    )


def test_a_dflash1_drafter_grows_into_a_dflash2_one_that_drafts_the_same(tiny):
    """Identity convolutions and a zero successor codebook: same hidden states, and the
    selector's walk is the per-position argmax, until training moves them."""
    model, _ = tiny
    target = TargetAdapter(model)
    source = make_draft(model, 1, TAPS, 6, seed=4)
    source.norm.weight = source.norm.weight * 10  # away from the near-uniform start
    grown = grow_draft(source, 2, DFlash2Shape(selector_top_k=8, selector_rank=4))
    assert grown.config.is_dflash2 and len(grown.layers) == 2
    ids = np.random.default_rng(5).integers(0, 300, size=30)
    feats = features_of(model, ids)
    anchors = np.arange(4, 28, 3)
    hidden = [block_hidden(d, target.embed_tokens, feats, ids, anchors) for d in (source, grown)]
    assert mx.abs(hidden[0] - hidden[1]).max().item() < 1e-5

    block = mx.array([int(ids[10])] + [grown.config.mask_token_id] * 5)
    cache = grown.make_cache()
    grown.append_context(feats[None, :10], [cache])
    tokens, _ = helpers.propose_one(
        grown, block, target.embed_tokens, target.lm_head, cache, make_verifier().propose
    )
    cache = source.make_cache()
    source.append_context(feats[None, :10], [cache])
    argmax = mx.argmax(
        source.draft_logits(block[None], target.embed_tokens, target.lm_head, [cache])[0], -1
    )
    assert tokens.tolist() == argmax.tolist()


def test_the_selector_learns_transitions_the_unary_logits_cannot_see(tiny):
    """Sequences of pairs (x, f(x)), x random from 6 tokens, f a fixed permutation onto 6
    others. From the second mask position on, the label f(x) follows a random x the drafter
    never sees, so its own logits can only guess (about 1 in 6); given the true x, the
    trained selector picks f(x) among the top-K. Untrained (edges 0), it takes the argmax."""
    model, _ = tiny
    target = TargetAdapter(model)
    rng = np.random.default_rng(5)
    firsts, seconds = np.arange(10, 16), 40 + rng.permutation(6)
    data = []
    for _ in range(8):
        xs = rng.choice(6, size=24)
        ids = np.stack([firsts[xs], seconds[xs]], axis=1).ravel()
        data.append(Sequence(ids, 2, features_of(model, ids).astype(mx.float16)))
    cfg = TrainConfig(steps=80, seqs_per_step=2, blocks_per_seq=8, warmup=5, lr=1e-2)
    shape = DFlash2Shape(selector_top_k=16, selector_rank=8)
    trainer = Trainer(model, make_draft(model, 1, TAPS, 6, seed=1, shape=shape), cfg)
    held_out = []
    for _ in range(2):
        xs = rng.choice(6, size=24)
        ids = np.stack([firsts[xs], seconds[xs]], axis=1).ravel()
        held_out.append((Sequence(ids, 2, features_of(model, ids)), np.arange(2, 47)))

    def scores() -> tuple[float, float]:
        """Selector and argmax hit rates on f(x) labels past the first mask position."""
        _, hits, valid = trainer.block_hits(held_out)
        selector, argmax = [], []
        for (seq, anchors), h, ok in zip(held_out, np.split(hits, 2), valid):
            pos = anchors[:, None] + np.arange(1, 6)
            labels = seq.ids[np.minimum(pos, len(seq.ids) - 1)]
            hidden = block_hidden(
                trainer.draft, target.embed_tokens, seq.features, seq.ids, anchors
            )
            guess = np.array(mx.argmax(target.lm_head(hidden[:, 1:]), axis=-1))
            second = ok & np.isin(labels, seconds) & (np.arange(5) > 0)
            selector.append(h[second])
            argmax.append((guess == labels)[second])
        return np.concatenate(selector).mean(), np.concatenate(argmax).mean()

    untrained, _ = scores()
    for s in range(cfg.steps):
        trainer.train_step(step_batch(data, s, cfg, 6))
    trained, argmax = scores()
    assert untrained < 0.4 and argmax < 0.4, (untrained, argmax)
    assert trained > 0.8, (untrained, trained, argmax)

    # Teacher-forced hits are what the selector's walk gets right at inference: from each
    # anchor, the accepted prefix of `propose` (top-K over the whole vocabulary, walk from the
    # anchor) equals the run of hits.
    seq, anchors = held_out[0]
    _, hits, _ = trainer.block_hits([(seq, anchors[:20])])
    greedy = make_verifier().propose
    accepted = []
    for a in anchors[:20]:
        cache = trainer.draft.make_cache()
        trainer.draft.append_context(seq.features[None, :a], [cache])
        block = mx.array([int(seq.ids[a])] + [trainer.draft.config.mask_token_id] * 5)
        tokens, _ = helpers.propose_one(
            trainer.draft, block, target.embed_tokens, target.lm_head, cache, greedy
        )
        accepted.append(int(np.cumprod(np.array(tokens) == seq.ids[a + 1 : a + 6]).sum()))
    assert accepted == np.cumprod(hits, axis=1).sum(1).tolist()
    assert max(accepted) >= 2
