"""Drafter training on tiny random targets: mask, loss weights, resume, and that it learns."""

from __future__ import annotations

import json
import math
import shutil

import helpers
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.chat_format import render
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.train.blocks import (
    block_hidden,
    block_labels,
    block_loss,
    context_mask,
    position_weights,
    sample_anchors,
)
from dflash_mlx.train.data import extend_dataset, read_records
from dflash_mlx.train.export import export_converted, export_published
from dflash_mlx.train.features import cache_features, load_features
from dflash_mlx.train.prompts import _shingles, bench_shingles, build_prompts
from dflash_mlx.train.trainer import (
    Sequence,
    TrainConfig,
    Trainer,
    decode_tau,
    decode_walk,
    fit,
    grow_draft,
    make_draft,
    step_batch,
)

TAPS = [1, 3, 4]


@pytest.fixture(scope="module")
def tiny(workdir):
    model, tokenizer = dflash_mlx.load(helpers.save_target(workdir / "train-target"))
    return model, tokenizer


def features_of(model, ids: np.ndarray, taps=TAPS) -> mx.array:
    target = TargetAdapter(model)
    return target.forward(mx.array(ids)[None], None, taps=taps, prompt=True).features[0]


@pytest.mark.parametrize("window", [None, 5])
def test_context_mask_matches_brute_force(window):
    rng = np.random.default_rng(0)
    anchors = sample_anchors(np.arange(4, 29), 9, rng)
    mask = np.array(context_mask(anchors, 30, window))
    assert mask.shape == (len(anchors), 1, 1, 30)
    for i, a in enumerate(anchors):
        for t in range(30):
            expected = t < a and (window is None or t >= a - window)
            assert mask[i, 0, 0, t] == expected


def test_anchors_lie_in_the_reply_with_a_label():
    rng = np.random.default_rng(1)
    for _ in range(50):
        start, length = int(rng.integers(1, 20)), int(rng.integers(22, 60))
        seq = Sequence(np.zeros(length, dtype=np.int32), start, mx.zeros((length, 4)))
        anchors = sample_anchors(seq.anchors(), 8, rng)
        assert len(anchors) == min(8, length - 1 - start)
        assert np.all(np.diff(anchors) > 0)
        assert anchors.min() >= start and anchors.max() <= length - 2
    one_token = Sequence(np.zeros(6, dtype=np.int32), 5, mx.zeros((6, 4)))
    assert len(sample_anchors(one_token.anchors(), 4, rng)) == 0


@pytest.mark.parametrize("window", [None, 6])
def test_training_forward_equals_inference_per_block(tiny, window):
    """All blocks in one masked forward == append_context(features[:p]) + draft(block) each."""
    model, _ = tiny
    target = TargetAdapter(model)
    draft = make_draft(model, 2, TAPS, block_size=8, seed=3)
    for layer in draft.layers:
        layer.self_attn.window = window
    ids = np.random.default_rng(0).integers(0, 300, size=40)
    feats = features_of(model, ids)
    anchors = sample_anchors(np.arange(5, 39), 10, np.random.default_rng(2))
    logits = target.lm_head(block_hidden(draft, target.embed_tokens, feats, ids, anchors))
    for i, p in enumerate(anchors):
        cache = draft.make_cache()
        draft.append_context(feats[None, :p], [cache])
        block = mx.array([int(ids[p])] + [draft.config.mask_token_id] * 7)
        ref = target.lm_head(draft(target.embed_tokens(block[None]), cache))[0]
        assert mx.abs(ref - logits[i]).max().item() < 1e-4


def test_loss_weights_and_labels():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert np.allclose(w, [math.exp(-(k - 1) / 7.0) for k in range(1, 16)])
    ids = np.arange(100, 120)
    labels, valid = block_labels(ids, np.array([3, 15]), 8)
    assert labels[0].tolist() == list(range(104, 111)) and valid[0].all()
    assert labels[1, :4].tolist() == [116, 117, 118, 119]
    assert valid[1].tolist() == [True] * 4 + [False] * 3

    hidden = mx.random.normal((2, 8, 6), key=mx.random.key(0))
    head = mx.random.normal((11, 6), key=mx.random.key(1))
    y = mx.array([[1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6]])
    weights = mx.array(np.stack([w[:7], w[:7] * valid[1]]))
    loss, hits = block_loss(hidden[:, 1:] @ head.T, y, weights)
    logits = np.array(hidden[:, 1:] @ head.T, dtype=np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.array(y)[..., None], -1)[..., 0]
    assert abs(loss.item() - (ce * np.array(weights)).sum()) < 1e-3
    assert (np.array(hits) == (logits.argmax(-1) == np.array(y))).all()

    one_hot = (y[..., None], mx.ones((2, 7, 1)))  # soft labels all on the hard label: same loss
    soft_loss, _ = block_loss(hidden[:, 1:] @ head.T, y, weights, one_hot, 0.7)
    assert abs(soft_loss.item() - loss.item()) < 1e-4
    even = (mx.stack([y, (y + 1) % 11], axis=-1), mx.full((2, 7, 2), 0.5))
    soft_loss, _ = block_loss(hidden[:, 1:] @ head.T, y, weights, even, 1.0)
    other = np.take_along_axis(logp, (np.array(y) + 1)[..., None] % 11, -1)[..., 0]
    expected = -(0.5 * np.take_along_axis(logp, np.array(y)[..., None], -1)[..., 0] + 0.5 * other)
    assert abs(soft_loss.item() - (expected * np.array(weights)).sum()) < 1e-3


def tiny_data(model, n: int = 6, length: int = 48, start: int = 8) -> list[Sequence]:
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        ids = rng.integers(0, 300, size=length)
        out.append(Sequence(ids, start, features_of(model, ids).astype(mx.float16)))
    return out


def test_resume_gives_the_same_state(tiny, tmp_path):
    model, _ = tiny
    data = tiny_data(model)
    cfg = TrainConfig(steps=6, seqs_per_step=2, blocks_per_seq=4, warmup=2, lr=3e-3)
    vocab = np.unique(np.concatenate([s.ids for s in data]))

    straight = Trainer(model, make_draft(model, 1, TAPS, 8, seed=1), cfg, vocab)
    for s in range(4):
        straight.train_step(step_batch(data, s, cfg, 8))

    first = Trainer(model, make_draft(model, 1, TAPS, 8, seed=1), cfg, vocab)
    for s in range(2):
        first.train_step(step_batch(data, s, cfg, 8))
    first.save(tmp_path / "ckpt")
    resumed = Trainer(model, make_draft(model, 1, TAPS, 8, seed=9), cfg, vocab)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step(step_batch(data, resumed.step, cfg, 8))

    a, b = (
        dict(tree_flatten(straight.draft.parameters())),
        dict(tree_flatten(resumed.draft.parameters())),
    )
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    sa = dict(tree_flatten(straight.optimizer.state))
    sb = dict(tree_flatten(resumed.optimizer.state))
    assert sa.keys() == sb.keys() and all(mx.array_equal(sa[k], sb[k]).item() for k in sa)


def test_epochs_resample_anchors():
    data = [Sequence(np.arange(60), 10, mx.zeros((60, 4))) for _ in range(2)]
    cfg = TrainConfig(seqs_per_step=2, blocks_per_seq=6)
    epoch0 = [a.tolist() for _, a in step_batch(data, 0, cfg, 8)]
    epoch1 = [a.tolist() for _, a in step_batch(data, 1, cfg, 8)]
    assert epoch0 != epoch1 and epoch0 == [a.tolist() for _, a in step_batch(data, 0, cfg, 8)]


def test_prompts_are_disjoint_from_the_bench_suite():
    held_out = bench_shingles()
    prompts = build_prompts(600)
    assert len({p["category"] for p in prompts}) == 3
    assert not any(_shingles(p["prompt"]) & held_out for p in prompts)


def test_replies_file_drops_only_a_torn_last_line_and_resumes_cleanly(loaded, tmp_path):
    model, tokenizer, _ = loaded("llama-tied-gqa")
    prompts = build_prompts(40, seed=1)[:3]
    path = tmp_path / "replies.jsonl"
    extend_dataset(model, tokenizer, prompts[:1], path, 4, batch_size=2)
    whole = path.read_text()
    path.write_text(whole + whole[: len(whole) // 2])  # the second record cut mid-write
    assert [r["id"] for r in read_records(path)] == [prompts[0]["id"]]
    extend_dataset(model, tokenizer, prompts, path, 4, batch_size=2)
    assert sorted(r["id"] for r in read_records(path)) == sorted(p["id"] for p in prompts)

    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1][:-3], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=r"replies.jsonl:2 is not a JSON record"):
        read_records(path)


def test_a_few_hundred_steps_raise_tau(workdir, tmp_path):
    """Self-distil a tiny target, cache features, train: real decoding on held-out prompts
    accepts more. The target's weights are scaled down from the test helper's (which makes
    replies chaotic) so that its replies have structure a drafter can learn in seconds."""
    mx.random.seed(0)  # the same run whatever ran before it in this worker
    model, tokenizer = dflash_mlx.load(helpers.save_target(workdir / "learnable-target"))
    params = tree_flatten(model.parameters())
    model.load_weights([(k, v * 0.6 if v.ndim == 2 and "embed" not in k else v) for k, v in params])
    # One category: a random tiny target's replies to templated word problems have structure
    # a drafter picks up in 300 steps; across all three categories 96 replies are too few.
    prompts = [p for p in build_prompts(312, seed=3) if p["category"] == "math"]
    extend_dataset(model, tokenizer, prompts[:96], tmp_path / "replies.jsonl", 40, batch_size=16)
    records = read_records(tmp_path / "replies.jsonl")
    n = cache_features(model, records, tmp_path / "features", TAPS, chunk_size=16)
    data = [
        Sequence(np.array(r["ids"]), r["start"], **f)
        for r, f in zip(records, load_features(tmp_path / "features", n, chunk_size=16))
    ]
    held_out = [render(tokenizer, p["prompt"], chat=True) for p in prompts[96:]]
    cfg = TrainConfig(steps=300, seqs_per_step=2, blocks_per_seq=16, warmup=20, lr=3e-3)
    trainer = Trainer(model, make_draft(model, 1, TAPS, 8, seed=0), cfg)
    before = decode_tau(model, trainer.draft, tokenizer, held_out, 32)
    for s in range(cfg.steps):
        trainer.train_step(step_batch(data, s, cfg, 8))
    after = decode_tau(model, trainer.draft, tokenizer, held_out, 32)
    # This target's replies fall into runs of one repeated token, which a random drafter
    # (through the target's own head) guesses in 1 cycle of 240 (τ 1.004, drafter seeds 0-2
    # alike) and this one learns: at its block of 8 it reaches τ 2.9-3.1 (seeds 0-2).
    assert before < 1.01 and after > 2.5, (before, after)

    # Validation's teacher-forced hits on a greedy reply are what decoding accepts: from each
    # anchor, the first cycle of stream_generate on the prefix accepts the same prefix.
    for check in [s for s in data if len(s.ids) - s.start >= 24]:  # one with drafts accepted
        check = Sequence(check.ids, check.start, features_of(model, check.ids))
        anchors = sample_anchors(check.anchors(), 16, np.random.default_rng(0))
        anchors = anchors[anchors + 8 <= len(check.ids)]
        _, hits, _ = trainer.block_hits([(check, anchors)])
        expected = np.cumprod(hits, axis=1).sum(1)
        if expected.max() > 0:
            break
    decoded = [
        list(
            dflash_mlx.stream_generate(
                model, trainer.draft, tokenizer, check.ids[:a].tolist(), block_size=8, max_tokens=9
            )
        )[1].accepted
        for a in anchors
    ]
    assert expected.max() > 0 and decoded == expected.tolist()

    # And validation's tau follows decoding's path through the reply: tokens per verify cycle.
    reply = check.ids[check.start :].tolist()
    prompt = check.ids[: check.start].tolist()
    responses = list(
        dflash_mlx.stream_generate(
            model, trainer.draft, tokenizer, prompt, block_size=8, max_tokens=len(reply)
        )
    )
    assert [t for r in responses for t in r.tokens] == reply
    scores = trainer.validate([check])
    assert scores["tau_decode"] == pytest.approx((len(reply) - 1) / (len(responses) - 1))
    assert scores["tau_decode"] > 1 and scores["tau_est"] > 1


def test_validation_skips_replies_with_nothing_to_draft(tiny):
    model, _ = tiny
    seq = tiny_data(model, n=1)[0]
    one_token = Sequence(seq.ids[:9], 8, seq.features[:9])  # the reply is a single token
    trainer = Trainer(model, make_draft(model, 1, TAPS, 8, seed=1), TrainConfig())
    assert trainer.validate([one_token, seq]) == trainer.validate([seq])


def test_decode_walk_commits_accepted_plus_one_per_cycle():
    # anchors 0..6: a cycle at 0 accepts 3 (commits 4), at 4 accepts 1 (commits 2), at 6 the
    # last token; the anchors inside a committed run are skipped, as in decoding
    assert decode_walk(np.array([3, 9, 9, 9, 1, 9, 5])) == (7, 3)
    assert decode_walk(np.array([0, 0, 0])) == (3, 3)


def test_exports_load_and_agree(tiny, tmp_path):
    model, _ = tiny
    draft = make_draft(model, 1, TAPS, 8, seed=2)
    export_converted(draft, tmp_path / "ours", "# card\n", dtype="float32")
    export_published(draft, tmp_path / "published", dtype="float32")
    feats = features_of(model, np.arange(20))[None]
    # A block as drafting sees it: real token embeddings (zeros would leave q/k projections,
    # norms and RoPE unexercised), the last committed token followed by mask tokens.
    block = mx.array([[20] + [draft.config.mask_token_id] * 7])
    embedded = TargetAdapter(model).embed_tokens(block)
    outs = []
    for d in (
        draft,
        dflash_mlx.load_draft(tmp_path / "ours"),
        dflash_mlx.load_draft(tmp_path / "published"),
    ):
        cache = d.make_cache()
        d.append_context(feats, [cache])
        outs.append(d(embedded, cache))
    assert mx.allclose(outs[0], outs[1]).item() and mx.allclose(outs[0], outs[2]).item()
    assert mx.abs(outs[0][0, 0] - outs[0][0, 1]).max().item() > 1e-3  # the token mattered
    assert (tmp_path / "ours" / "README.md").read_text() == "# card\n"


def test_a_grown_drafter_starts_where_its_source_was_and_learns_in_its_new_layer(tiny):
    model, _ = tiny
    target = TargetAdapter(model)
    source = make_draft(model, 1, TAPS, 8, seed=4)
    source.norm.weight = source.norm.weight * 10  # away from the near-uniform start
    grown = grow_draft(source, 3)
    assert len(grown.layers) == 3 and grown.config.num_hidden_layers == 3
    ids = np.random.default_rng(5).integers(0, 300, size=40)
    feats = features_of(model, ids)
    anchors = sample_anchors(np.arange(5, 39), 6, np.random.default_rng(6))
    hidden = [block_hidden(d, target.embed_tokens, feats, ids, anchors) for d in (source, grown)]
    assert mx.abs(hidden[0] - hidden[1]).max().item() < 1e-5

    trainer = Trainer(model, grown, TrainConfig(steps=2, warmup=1, lr=1e-3), vocab=None)
    trainer.train_step(
        [
            (s, sample_anchors(s.anchors(), 4, np.random.default_rng(7)))
            for s in tiny_data(model, n=2)
        ]
    )
    new_out = dict(tree_flatten(grown.layers[2].parameters()))["mlp.down_proj.weight"]
    assert mx.abs(new_out).max().item() > 0  # the identity layer is trained, not frozen
    with pytest.raises(ValueError, match="shrink"):
        grow_draft(grown, 2)


def test_fit_validates_from_its_start_point_and_checkpoints(tiny, tmp_path):
    model, _ = tiny
    data = tiny_data(model)
    cfg = TrainConfig(
        steps=4, seqs_per_step=2, blocks_per_seq=4, warmup=1, eval_every=2, save_every=2
    )
    trainer = Trainer(model, make_draft(model, 1, TAPS, 8, seed=1), cfg)
    fit(trainer, data[:4], tmp_path / "ckpt", tmp_path / "log.jsonl", val=data[4:])
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "val" in e] == [0, 2, 4]
    assert all(0 <= e["val"]["acc"][0] <= 1 and e["val"]["loss"] > 0 for e in log if "val" in e)
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"] == 4


def test_a_save_after_one_cut_short_after_its_swap(tiny, tmp_path):
    """A save that stopped before removing the checkpoint it replaced leaves ckpt.old beside
    ckpt: the next save replaces both."""
    model, _ = tiny
    trainer = Trainer(model, make_draft(model, 1, TAPS, 8, seed=1), TrainConfig())
    trainer.save(tmp_path / "ckpt")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt.old")
    trainer.step = 5
    trainer.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_fit_resumes_from_a_save_cut_short_and_logs_each_step_once(make_pair, tmp_path, capsys):
    """A run killed between the two renames of its checkpoint save leaves the last whole
    checkpoint in ckpt.old and no ckpt/; the next fit resumes from it (not from step 0),
    and the log holds each step once: the steps it redoes, and the step it resumes at."""
    work = ["--model", str(make_pair("llama-tied-gqa")[0]), "--work", str(tmp_path)]
    cli.main(["train", "data", *work, "--num-prompts", "64", "--max-tokens", "8"])
    cli.main(["train", "features", *work, "--taps", "1,3"])
    fit = ["train", "fit", *work, "--seqs-per-step", "1", "--blocks-per-seq", "2"]
    fit += ["--save-every", "1", "--eval-every", "1", "--val-seqs", "1"]
    fit += ["--eval-prompts", "1", "--eval-max-tokens", "4"]
    cli.main([*fit, "--steps", "2"])
    log = tmp_path / "train_log.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]

    # The run to step 3 logged it, then was killed saving it: after ckpt -> ckpt.old, before
    # ckpt.tmp -> ckpt.
    (tmp_path / "ckpt").rename(tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp").mkdir()
    with log.open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    capsys.readouterr()
    cli.main([*fit, "--steps", "4"])
    assert f"resumed from {tmp_path / 'ckpt'} at step 2" in capsys.readouterr().out
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"] == 4
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in entries] == [0, 1, 2, 3, 4]
    assert all("val" in e for e in entries)  # step 3 is the resumed run's, not the killed one's
    assert not (tmp_path / "ckpt.old").exists() and not (tmp_path / "ckpt.tmp").exists()
