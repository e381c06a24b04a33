"""Training on text the target did not write: one forward per window gives the target's greedy
path through it, and a drafter is taught that path and nothing else."""

import json

import mlx.core as mx
import numpy as np
import pytest
from test_server import MODEL

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.train.blocks import block_labels, sample_anchors, target_path
from dflash_mlx.train.data import read_records, text_records
from dflash_mlx.train.features import sequence_features
from dflash_mlx.train.trainer import Sequence, label_vocab

BLOCK = 6


@pytest.fixture(scope="module")
def tiny(make_pair):
    target, _ = make_pair(MODEL)
    return dflash_mlx.load(str(target))


def argmax_after_each(model, ids: list[int]) -> list[int]:
    """The target's greedy next token after every position, from its own plain forward."""
    return np.array(mx.argmax(model(mx.array(ids)[None])[0], axis=-1)).tolist()


def path_of(model, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    (stored,) = sequence_features(model, [ids.tolist()], [1])
    return target_path(ids, np.array(stored["top_ids"]), np.array(stored["top_logp"], np.float32))


def test_text_is_labelled_with_the_targets_choices_while_it_follows_them(tiny):
    model, _ = tiny
    rng = np.random.default_rng(0)
    greedy = argmax_after_each(model, [5, 9])
    ids = [5, 9]
    while len(ids) < 48:  # the target's own choices, broken every few tokens by another token
        ids.append(greedy[-1] if rng.random() < 0.7 else int(rng.integers(0, 200)))
        greedy = argmax_after_each(model, ids)
    ids = np.array(ids)
    path = path_of(model, ids)
    assert path[0].tolist() == greedy

    anchors = np.arange(2, len(ids) - 1)
    labels, valid = block_labels(ids, anchors, BLOCK, path)
    for row, a in enumerate(anchors):
        for k in range(1, BLOCK):
            inside = a + k < len(ids)
            follows = inside and all(ids[a + i] == greedy[a + i - 1] for i in range(1, k))
            assert valid[row, k - 1] == follows
            if valid[row, k - 1]:
                assert labels[row, k - 1] == greedy[a + k - 1]
    assert 0 < valid.mean() < 1

    (stored,) = sequence_features(model, [ids.tolist()], [1])
    seq = Sequence(ids, 2, stored["features"], stored["top_ids"], stored["top_logp"], greedy=False)
    expected = [a for a in range(2, len(ids) - 1) if ids[a] == greedy[a - 1]]
    assert seq.anchors().tolist() == expected
    assert sample_anchors(seq.anchors(), 100, rng).tolist() == expected


def test_the_targets_own_greedy_text_trains_as_its_greedy_reply_does(tiny):
    model, _ = tiny
    ids = [3, 17, 4]
    while len(ids) < 40:
        ids.append(argmax_after_each(model, ids)[-1])
    ids = np.array(ids)
    anchors = np.arange(3, len(ids) - 1)
    as_text = block_labels(ids, anchors, BLOCK, path_of(model, ids))
    as_reply = block_labels(ids, anchors, BLOCK)
    assert (as_text[0] == as_reply[0]).all() and (as_text[1] == as_reply[1]).all()


def test_a_sequence_not_greedy_needs_soft_labels_and_adds_its_choices_to_the_vocabulary(tiny):
    model, _ = tiny
    ids = np.array([7, 8, 9, 10, 11, 12])
    with pytest.raises(ValueError, match="soft labels"):
        Sequence(ids, 2, mx.zeros((6, 4)), greedy=False)
    (stored,) = sequence_features(model, [ids.tolist()], [1])
    seq = Sequence(ids, 2, stored["features"], stored["top_ids"], stored["top_logp"], greedy=False)
    vocab = label_vocab([seq])
    assert set(vocab) == set(ids) | set(argmax_after_each(model, ids.tolist()))


def test_text_windows_overlap_by_their_context_and_label_each_token_once(tiny):
    _, tokenizer = tiny
    text = " ".join(f"word{i}" for i in range(400))
    ids = tokenizer.encode(text, add_special_tokens=False)
    records = text_records(tokenizer, {"id": "doc", "category": "text", "text": text}, 64, 8)
    assert all(not r["greedy"] and len(r["ids"]) <= 64 for r in records)
    assert len({r["id"] for r in records}) == len(records)
    labelled = [t for r in records for t in r["ids"][r["start"] :]]
    assert labelled == ids[8:]
    assert all(r["start"] == 8 for r in records)


def test_train_data_takes_texts_and_fit_trains_on_them(make_pair, tmp_path, capsys):
    """`train data --from` a JSONL of texts (mlx-lm's text format) beside a prompt: the texts
    are windows, the prompt is replied to; features and a fit run on both."""
    target, draft = make_pair(MODEL)
    source = tmp_path / "mixed.jsonl"
    texts = [" ".join(f"w{i * j % 97}" for j in range(40)) for i in range(1, 70)]
    lines = [{"text": t} for t in texts] + [{"prompt": "Say hello."}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    work = tmp_path / "work"
    common = ["--model", str(target), "--work", str(work)]
    cli.main(["train", "data", "--from", str(source), "--max-tokens", "8", *common])
    assert "windows of 69 texts added" in capsys.readouterr().out
    records = read_records(work / "replies.jsonl")
    assert sum(r.get("greedy", True) for r in records) == 1  # the reply to the prompt
    cli.main(["train", "features", "--taps", "1,3", *common])
    cli.main(["train", "fit", "--init-from", str(draft), "--steps", "10", "--warmup", "1",
              "--eval-every", "0", "--eval-prompts", "0", *common])  # fmt: skip
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert log and np.isfinite(log[-1]["loss"])
