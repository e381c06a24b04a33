"""`train fit --arch dspark`: DeepSpec's loss against a numpy transcription of the reference,
training that lowers it, exact resume, and an export that `load_draft` reads and that
generates mlx-lm's greedy output."""

from __future__ import annotations

import json

import helpers
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.decode.sampling import make_verifier
from dflash_mlx.models.dspark import DSparkDraft
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.train.blocks import block_hidden
from dflash_mlx.train.dspark import DSparkShape, DSparkTrainer
from dflash_mlx.train.features import sequence_features
from dflash_mlx.train.trainer import (
    Sequence,
    TrainConfig,
    checkpoint_draft,
    grow_draft,
    head_weight,
    make_draft,
    step_batch,
)

TAPS = helpers.TRAIN_TAPS


@pytest.fixture(scope="module")
def tiny(train_target_dir):
    return dflash_mlx.load(train_target_dir)


def train_cli(*argv: str) -> None:
    cli.main(["train", *argv])


def cached_sequences(model, n: int = 4, length: int = 24, start: int = 6) -> list[Sequence]:
    """Random sequences with the features `train features` caches for them."""
    rng = np.random.default_rng(11)
    ids = [rng.integers(0, 300, size=length).tolist() for _ in range(n)]
    cached = sequence_features(model, ids, TAPS)
    return [Sequence(np.array(i), start, **c) for i, c in zip(ids, cached)]


def test_the_cached_final_hidden_state_gives_the_targets_logits(tiny):
    model, _ = tiny
    seq = cached_sequences(model, n=1)[0]
    logits = model(mx.array(seq.ids)[None])[0]
    through_head = TargetAdapter(model).lm_head(seq.last_hidden.astype(mx.float32))
    assert mx.abs(through_head - logits).max().item() < 2e-2  # fp16 cache


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def numpy_markov(params: dict, kind: str, prev: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """DeepSpec's `markov_head.py` bias (N, γ, vocab), teacher-forced on the true `prev`."""
    w1, w2 = params["markov_head.markov_w1.weight"], params["markov_head.markov_w2.weight"]
    emb = w1[prev]
    if kind == "vanilla":
        return emb @ w2.T
    if kind == "gated":
        gw, gb = params["markov_head.gate_proj.weight"], params["markov_head.gate_proj.bias"]
        gate = sigmoid(np.concatenate([hidden, emb], -1) @ gw.T + gb)
        return (gate * emb) @ w2.T
    jw, jb = params["markov_head.joint_proj.weight"], params["markov_head.joint_proj.bias"]
    state, out = np.zeros_like(emb[:, 0]), []
    for k in range(prev.shape[1]):
        z = np.concatenate([state, emb[:, k], hidden[:, k]], -1) @ jw.T + jb
        g, c, o = np.split(z, 3, axis=-1)
        g = sigmoid(g)
        state = g * state + (1 - g) * np.tanh(c)
        out.append(np.tanh(o) @ w2.T)
    return np.stack(out, axis=1)


def numpy_dspark_loss(model, draft, pairs, cfg: TrainConfig) -> dict[str, float]:
    """DeepSpec's `compute_dspark_loss` for one step, in numpy: the drafter's slot outputs
    (every slot of the block) are the only input taken from the code under test."""
    target = TargetAdapter(model)
    params = {k: np.array(v) for k, v in tree_flatten(draft.parameters())}
    head = np.array(head_weight(target))
    gamma = draft.config.slots
    sums = {"ce": 0.0, "l1": 0.0, "conf": 0.0, "den": 0.0}
    for seq, anchors in pairs:
        hidden = block_hidden(draft, target.embed_tokens, seq.features, seq.ids, anchors)
        assert hidden.shape[1] == gamma  # [anchor, mask × (γ - 1)]: every slot drafts
        hidden = np.array(hidden)
        pos = anchors[:, None] + np.arange(gamma)  # slot k reads the target at anchor + k
        valid = pos + 1 < len(seq.ids)  # and predicts the token after it
        safe = np.minimum(pos, len(seq.ids) - 2)
        prev, labels = seq.ids[safe], seq.ids[safe + 1]
        logits = hidden @ head.T
        if "markov_head" in draft:
            logits = logits + numpy_markov(params, draft.config.markov_head_type, prev, hidden)
        target_logits = np.array(model(mx.array(seq.ids)[None])[0])[safe]
        weight = valid * np.exp(-np.arange(gamma) / cfg.gamma)
        logp = np.log(softmax(logits))
        ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
        l1 = np.abs(softmax(logits) - softmax(target_logits)).sum(-1)
        accept = np.clip(1 - 0.5 * l1, 0, 1)
        features = hidden
        if draft.config.confidence_with_markov:
            features = np.concatenate([hidden, params["markov_head.markov_w1.weight"][prev]], -1)
        c = sigmoid(
            features @ params["confidence_head.proj.weight"].T + params["confidence_head.proj.bias"]
        )[..., 0]
        bce = -(accept * np.log(c) + (1 - accept) * np.log(1 - c))
        for key, term in (("ce", ce), ("l1", l1), ("conf", bce)):
            sums[key] += (term * weight).sum()
        sums["den"] += weight.sum()
    ce, l1, conf = (sums[k] / (sums["den"] + 1e-6) for k in ("ce", "l1", "conf"))
    total = cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.confidence_weight * conf
    return {"loss": total, "ce_loss": ce, "l1_loss": l1, "confidence_loss": conf}


@pytest.mark.parametrize(
    "kind, confidence", [("vanilla", "markov"), ("gated", "hidden"), ("rnn", "markov")]
)
def test_the_loss_is_deepspecs_on_a_fixed_batch(tiny, kind, confidence):
    model, _ = tiny
    target = TargetAdapter(model)
    shape = DSparkShape(markov_rank=8, markov_head=kind, confidence_head=confidence)
    draft = make_draft(model, 1, TAPS, 5, seed=3, shape=shape)
    draft.norm.weight = draft.norm.weight * 10  # away from the near-uniform start
    w2 = draft.markov_head.markov_w2
    w2.weight = mx.random.normal(w2.weight.shape, key=mx.random.key(1))  # a bias that matters
    # the target's final hidden state in float32 (the cache holds fp16): an exact comparison
    data = [
        Sequence(s.ids, s.start, s.features, last_hidden=target.backbone(mx.array(s.ids)[None])[0])
        for s in cached_sequences(model, n=2)
    ]
    pairs = [(s, np.arange(s.start, len(s.ids) - 1)) for s in data]  # up to the last label
    cfg = TrainConfig()
    losses, hits, _ = DSparkTrainer(model, draft, cfg).block_hits(pairs)
    expected = numpy_dspark_loss(model, draft, pairs, cfg)
    assert losses.keys() == expected.keys()
    for key, value in expected.items():
        assert losses[key] == pytest.approx(value, rel=1e-4), key
    assert hits.shape == (sum(len(a) for _, a in pairs), 4)


def fixed_batch_losses(model, draft, work) -> dict[str, float]:
    """The loss and its terms on the same blocks of the same four sequences."""
    pairs, vocab = helpers.fixed_blocks(work)
    losses, _, _ = DSparkTrainer(model, draft, TrainConfig(gamma=4.0), vocab).block_hits(pairs)
    return losses


def test_fit_arch_dspark_learns_resumes_and_exports_a_lossless_drafter(
    tiny, train_data, train_target_dir, tmp_path, capsys
):
    model, tokenizer = tiny
    work, common = helpers.train_work(train_data, tmp_path / "work", train_target_dir)
    settings = "--markov-rank 8 --layers 1 --block-size 5 --seqs-per-step 4 --blocks-per-seq 8"
    schedule = "--lr 1e-2 --warmup 1 --save-every 1 --eval-every 0"
    fit = ["fit", *common, "--arch", "dspark", *settings.split(), *schedule.split()]
    train_cli(*fit, "--steps", "1")
    first, _ = checkpoint_draft(work / "ckpt")
    train_cli(*fit, "--steps", "30")  # resumes from step 1
    trained, step = checkpoint_draft(work / "ckpt")
    assert step == 30 and isinstance(trained, DSparkDraft)
    state = json.loads((work / "ckpt" / "state.json").read_text())
    assert state["train"]["gamma"] == 4.0 and state["draft"]["block_size"] == 4  # γ slots
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert {"ce_loss", "l1_loss", "confidence_loss"} <= log[-1].keys()

    before = fixed_batch_losses(model, first, work)
    after = fixed_batch_losses(model, trained, work)
    for key in ("loss", "ce_loss", "l1_loss"):
        assert after[key] < before[key] - 0.1, (key, before, after)
    # the confidence head's target moves with the drafter: compare heads on the same target
    untrained_head, _ = checkpoint_draft(work / "ckpt")
    untrained_head.confidence_head.update(first.confidence_head.parameters())
    baseline = fixed_batch_losses(model, untrained_head, work)
    assert after["confidence_loss"] < baseline["confidence_loss"] - 0.02, (baseline, after)

    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_cli("export", *common, "--out", str(tmp_path / "x"), "--published", str(tmp_path))
    err = capsys.readouterr().err
    assert err.strip().endswith("(DSparkDraftModel)") and len(err.splitlines()) == 1, err
    out = tmp_path / "ours"
    train_cli("export", *common, "--out", str(out))
    config = helpers.read_config(out)
    assert config["architectures"] == ["DSparkDraftModel"] and config["block_size"] == 4
    draft = dflash_mlx.load_draft(out)  # strict: every tensor named and shaped as configured
    assert isinstance(draft, DSparkDraft) and {"markov_head", "confidence_head"} <= draft.keys()
    assert draft.config.confidence_with_markov and draft.config.slots == 4
    prompt = tokenizer.encode("Speculative decoding drafts")
    expected = helpers.reference_greedy(model, prompt, 30, set(tokenizer.eos_token_ids))
    for block_size in (5, 3):
        responses = dflash_mlx.stream_generate(
            model, draft, tokenizer, prompt, max_tokens=30, block_size=block_size
        )
        assert [t for r in responses for t in r.tokens] == expected, block_size


def test_resume_gives_the_same_state(tiny, tmp_path):
    model, _ = tiny
    data = cached_sequences(model, n=4)
    cfg = TrainConfig(steps=6, seqs_per_step=2, blocks_per_seq=4, warmup=2, lr=3e-3, gamma=4.0)
    shape = DSparkShape(markov_rank=8, markov_head="rnn")

    def trainer(seed: int) -> DSparkTrainer:
        return DSparkTrainer(model, make_draft(model, 1, TAPS, 5, seed=seed, shape=shape), cfg)

    straight = trainer(1)
    for s in range(4):
        straight.train_step(step_batch(data, s, cfg, 5))
    first = trainer(1)
    for s in range(2):
        first.train_step(step_batch(data, s, cfg, 5))
    first.save(tmp_path / "ckpt")
    resumed = trainer(9)
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step(step_batch(data, resumed.step, cfg, 5))
    for ours, theirs in (
        (straight.draft.parameters(), resumed.draft.parameters()),
        (straight.optimizer.state, resumed.optimizer.state),
    ):
        a, b = dict(tree_flatten(ours)), dict(tree_flatten(theirs))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert "markov_head.markov_w2.weight.m" in dict(tree_flatten(straight.optimizer.state))


def test_a_dflash1_drafter_grown_into_dspark_drafts_what_it_did(tiny):
    """`--init-from` a DFlash 1 drafter: its slots are kept (slot 0 drafts nothing) and the
    Markov bias starts at zero, so the walk proposes the source's per-position argmax."""
    model, _ = tiny
    target = TargetAdapter(model)
    source = make_draft(model, 1, TAPS, 6, seed=4)
    source.norm.weight = source.norm.weight * 10
    grown = grow_draft(source, 1, DSparkShape(markov_rank=8, from_anchor=False))
    assert isinstance(grown, DSparkDraft) and grown.config.slots == grown.config.block_size == 6
    grown.verify_cost = None  # every draft, no confidence truncation
    ids = np.random.default_rng(5).integers(0, 300, size=30)
    feats = next(iter(sequence_features(model, [ids.tolist()], TAPS)))["features"]
    block = mx.array([int(ids[10])] + [source.config.mask_token_id] * 5)
    drafts = []
    for draft in (source, grown):
        cache = draft.make_cache()
        draft.append_context(feats[None, :10].astype(mx.float32), [cache])
        tokens, _ = helpers.propose_one(
            draft, block, target.embed_tokens, target.lm_head, cache, make_verifier().propose
        )
        drafts.append(tokens.tolist())
    assert drafts[0] == drafts[1] and len(drafts[0]) == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--markov-rank", "8"], "--markov-rank is a DSpark setting: add --arch dspark"),
        (["--l1-weight", "1"], "--l1-weight is a DSpark setting: add --arch dspark"),
        (["--arch", "dspark", "--soft-weight", "0.5"], "--soft-weight is no part of DSpark's"),
        (
            ["--arch", "dspark", "--markov-rank", "0"],
            "--confidence-head markov reads W1[prev]: it needs --markov-rank > 0",
        ),
    ],
)
def test_dspark_errors_are_one_line(train_data, train_target_dir, tmp_path, capsys, argv, message):
    work, common = helpers.train_work(train_data, tmp_path, train_target_dir)
    with pytest.raises(SystemExit) as exit_:
        train_cli("fit", *common, "--steps", "1", *argv)
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err
