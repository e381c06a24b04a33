"""Training the target's own MTP layer (`train fit --arch mtp`) on a tiny llama target: it
learns, validation's chains accept what decoding accepts, a resumed run continues exactly, and
the exported checkpoint drafts with `--draft mtp`, its greedy replies equal to mlx-lm's, through
the draft vocabulary the export lists if asked."""

from __future__ import annotations

import json
import re

import helpers
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_cli import decode_greedy, dflash_in_process

import dflash_mlx
from dflash_mlx.chat_format import render
from dflash_mlx.models.mtp import VOCAB_KEY
from dflash_mlx.models.target import TargetAdapter
from dflash_mlx.train.data import extend_dataset, read_records
from dflash_mlx.train.export import top_tokens
from dflash_mlx.train.features import cache_features, load_features
from dflash_mlx.train.mtp import MTP_FILE, MTPTrainer, checkpoint_mtp, export_mtp, make_mtp
from dflash_mlx.train.prompts import build_prompts
from dflash_mlx.train.trainer import Sequence, TrainConfig, label_vocab, step_batch


def learnable_target(path):
    """The tests' tiny llama target with its weights scaled down, saved (its random replies
    are chaotic otherwise: nothing for a layer to learn in seconds)."""
    helpers.save_target(path)
    model, _ = dflash_mlx.load(path)
    params = tree_flatten(model.parameters())
    scaled = {k: v * 0.6 if v.ndim == 2 and "embed" not in k else v for k, v in params}
    mx.save_safetensors(str(path / "model.safetensors"), scaled)
    return dflash_mlx.load(path)


@pytest.fixture(scope="module")
def replies(workdir, tmp_path_factory):
    """The target, and its greedy replies to 96 word problems with their features."""
    path = workdir / "mtp-learnable-target"
    model, tokenizer = learnable_target(path)
    work = tmp_path_factory.mktemp("mtp-train")
    prompts = [p for p in build_prompts(312, seed=3) if p["category"] == "math"][:96]
    extend_dataset(model, tokenizer, prompts, work / "replies.jsonl", 40, batch_size=16)
    records = read_records(work / "replies.jsonl")
    n = cache_features(model, records, work / "features", [1, 3], chunk_size=16)
    data = [
        Sequence(np.array(r["ids"]), r["start"], **f)
        for r, f in zip(records, load_features(work / "features", n, chunk_size=16))
    ]
    return path, model, tokenizer, data


def trainer_of(model, path, data, seed: int = 0, steps: int = 200) -> MTPTrainer:
    cfg = TrainConfig(steps=steps, seqs_per_step=2, warmup=10, lr=3e-3, soft_weight=0.5)
    return MTPTrainer(model, make_mtp(path, model, seed=seed), cfg, label_vocab(data))


def test_training_lowers_the_loss_and_validation_walks_what_decoding_accepts(replies, tmp_path):
    path, model, tokenizer, data = replies
    train, val = data[:80], data[80:]
    trainer = trainer_of(model, path, train)
    before = trainer.validate(val)
    for s in range(trainer.cfg.steps):
        trainer.train_step(step_batch(train, s, trainer.cfg, 4))
    after = trainer.validate(val)
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert after["tau_decode"] > before["tau_decode"] and after["tau_decode"] > 1.2

    # Validation's walk is decoding's: chains of 3 drafts (block 4) through a held-out reply,
    # on the target's final hidden states in float32 as decoding reads them.
    target = TargetAdapter(model)
    for seq in val:
        hidden = target.backbone(mx.array(seq.ids)[None])[0]
        check = Sequence(seq.ids, seq.start, seq.features, last_hidden=hidden)
        prompt, reply = seq.ids[: seq.start].tolist(), seq.ids[seq.start :].tolist()
        responses = list(
            dflash_mlx.stream_generate(
                model, trainer.draft, tokenizer, prompt, block_size=4, max_tokens=len(reply)
            )
        )
        assert [t for r in responses for t in r.tokens] == reply
        walked = trainer.validate([check])["tau_decode"]
        assert walked == pytest.approx((len(reply) - 1) / (len(responses) - 1))

    # Exported as the target carrying it, `--draft mtp` loads it: lossless, and accepted.
    out = export_mtp(trainer.draft, path, tmp_path / "with-mtp", "# MTP\n", "float32")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(p.name for p in path.iterdir()), MTP_FILE, "README.md"]
    )
    names = mx.load(str(out / MTP_FILE)).keys()
    assert {"model.layers.6.eh_proj.weight", "model.layers.6.enorm.weight"} <= names
    assert "model.layers.6.shared_head.norm.weight" in names
    prompt = "Tom has 3 apples and buys 5 more. How many?"
    ids = helpers.chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    expected, _ = decode_greedy(model, tokenizer, ids, 40)
    run = f"generate --model {out} --draft mtp --max-tokens 40 --block-size 4 --json -p '{prompt}'"
    result = dflash_in_process(run)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["text"] == expected and reply["tau"] > 1
    rows = dict(
        re.split(r"  +", line, maxsplit=1)
        for line in dflash_in_process(f"info --model {out}").stdout.splitlines()
    )
    assert rows["MTP layers"].startswith("yes: 1 MTP layer(s), unquantized (llama")


def test_resume_gives_the_same_state(replies, tmp_path):
    path, model, _, data = replies
    straight = trainer_of(model, path, data, steps=6)
    for s in range(4):
        straight.train_step(step_batch(data, s, straight.cfg, 4))

    first = trainer_of(model, path, data, steps=6)
    for s in range(2):
        first.train_step(step_batch(data, s, first.cfg, 4))
    first.save(tmp_path / "ckpt")
    draft, step = checkpoint_mtp(tmp_path / "ckpt", path)
    resumed = MTPTrainer(model, draft, first.cfg, label_vocab(data))
    resumed.load(tmp_path / "ckpt")
    assert step == resumed.step == 2
    for _ in range(2):
        resumed.train_step(step_batch(data, resumed.step, resumed.cfg, 4))

    for a, b in [
        (straight.draft.parameters(), resumed.draft.parameters()),
        (straight.optimizer.state, resumed.optimizer.state),
    ]:
        a, b = dict(tree_flatten(a)), dict(tree_flatten(b))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert mx.array_equal(straight.draft.target_norm.weight, model.model.norm.weight).item()


def test_the_cli_trains_resumes_and_exports_an_mtp_layer(replies, tmp_path):
    path = replies[0]
    work = f"--model {path} --work {tmp_path}"
    for stage in (
        f"train data {work} --num-prompts 64 --max-tokens 12",
        f"train features {work} --taps 1,3",
        f"train fit {work} --arch mtp --init-layers 5 --steps 2 --val-seqs 4 --eval-every 2 "
        "--eval-prompts 1 --eval-max-tokens 8",
        f"train fit {work} --steps 3 --val-seqs 4 --eval-prompts 0",  # resumes the MTP layer
        f"train export {work} --out {tmp_path / 'out'} --dtype float32",
        f"train export {work} --out {tmp_path / 'vocab'} --dtype float32 --draft-vocab 24",
    ):
        result = dflash_in_process(stage)
        assert result.returncode == 0, (stage, result.stderr)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "val" in e] == [0, 2]
    assert "eval_tau" in log[-1] and log[-1]["step"] == 2
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["step"] == 3 and state["mtp"]["model_type"] == "llama"
    model, tokenizer = dflash_mlx.load(tmp_path / "out")
    ids = render(tokenizer, "What is 2 + 2?", chat=True)
    reply = dflash_in_process(
        f"generate --model {tmp_path / 'out'} --draft mtp --max-tokens 16 --json "
        f"-p 'What is 2 + 2?'"
    )
    assert reply.returncode == 0, reply.stderr
    assert json.loads(reply.stdout)["text"] == decode_greedy(model, tokenizer, ids, 16)[0]

    # --draft-vocab: the replies' most frequent tokens and EOS, listed in the target's
    # config.json, where `--draft mtp` finds them (mlx-lm ignores the key)
    config = json.loads((tmp_path / "vocab" / "config.json").read_text())
    replies = read_records(tmp_path / "replies.jsonl")
    vocab = top_tokens(replies, 24, tokenizer.eos_token_ids)
    assert config[VOCAB_KEY] == vocab and len(vocab) == 24
    assert dflash_mlx.load_draft("mtp", target=tmp_path / "vocab").config.draft_vocab == vocab
    assert "MTP layer(s), unquantized (llama; --draft mtp), drafting 24 of" in (
        dflash_in_process(f"info --model {tmp_path / 'vocab'}").stdout
    )
    reply = dflash_in_process(
        f"generate --model {tmp_path / 'vocab'} --draft mtp --max-tokens 16 --json "
        f"-p 'What is 2 + 2?'"
    )
    assert reply.returncode == 0, reply.stderr
    assert json.loads(reply.stdout)["text"] == decode_greedy(model, tokenizer, ids, 16)[0]

    refusals = {
        f"train fit {work} --arch dflash2 --steps 4": "holds an MTP layer, not --arch dflash2",
        f"train export {work} --out {tmp_path / 'p'} --published {tmp_path / 'q'}": (
            "--published is for DFlash drafters"
        ),
        f"train fit --model {path} --work {tmp_path / 'w'} --arch mtp --layers 2": (
            "--arch mtp trains one layer"
        ),
    }
    (tmp_path / "w").mkdir()
    for name in ("replies.jsonl", "features"):
        (tmp_path / "w" / name).symlink_to(tmp_path / name)
    for command, why in refusals.items():
        result = dflash_in_process(command)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert why in result.stderr.strip().splitlines()[-1], result.stderr
