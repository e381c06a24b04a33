"""Drafters that learn from the traffic they serve: `serve --record` keeps each finished
reply, and `train finetune` fine-tunes a drafter on such a directory or on a JSONL file of
chat conversations, writing a drafter that still decodes exactly the target's text."""

import json

import helpers
import pytest
from test_server import MODEL, PROMPTS, openai_client, running_server

import dflash_mlx
from dflash_mlx import cli
from dflash_mlx.paths import cache_dir
from dflash_mlx.train.data import decoding_order, lockstep_replies, read_records, templated_ids
from dflash_mlx.train.prompts import build_prompts


def test_a_recorded_server_run_is_a_directory_the_trainer_reads(make_pair, tmp_path, capsys):
    target, draft = make_pair(MODEL)
    record = tmp_path / "traffic"
    asked = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    log = tmp_path / "server.log"
    with running_server(target, draft, log, "--record", str(record)) as (port, _, _):
        client = openai_client(port)
        replies = [
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            for messages in asked
        ]
    assert f"every finished reply's prompt and tokens go to {record}" in log.read_text()

    model, tokenizer = dflash_mlx.load(str(target))
    records = read_records(record / "replies.jsonl")
    assert len(records) == len(asked)
    for rec, messages, reply in zip(records, asked, replies):
        prompt = helpers.chat_ids(tokenizer, messages)
        assert rec["ids"][: rec["start"]] == prompt
        greedy, _ = helpers.mlx_lm_greedy(model, prompt, 8, set(tokenizer.eos_token_ids))
        assert rec["ids"][rec["start"] :] == greedy
        assert len(greedy) == reply.usage.completion_tokens
        assert rec["finish_reason"] == reply.choices[0].finish_reason
    vocab = dflash_mlx.models.target.TargetAdapter(model).vocab_size
    assert json.loads((record / "meta.json").read_text())["vocab_size"] == vocab

    work = ["--model", str(target), "--work", str(tmp_path / "work")]
    for _ in range(2):  # a rerun adds nothing twice
        cli.main(["train", "data", "--from", str(record), *work])
    assert read_records(tmp_path / "work" / "replies.jsonl") == records
    assert "0 recorded replies added" in capsys.readouterr().out


def test_recording_is_off_unless_asked(make_pair, tmp_path, monkeypatch):
    """A server without --record writes no reply anywhere: not in its working directory,
    not in its cache directory (one of its own, so that other runs' data cannot change)."""
    target, draft = make_pair(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))

    def kept() -> dict:  # every records file there may be, with its size and time
        files = [*tmp_path.rglob("replies.jsonl"), *cache_dir().rglob("replies.jsonl")]
        return {f: (f.stat().st_size, f.stat().st_mtime_ns) for f in files}

    before = kept()
    log = tmp_path / "server.log"
    with running_server(target, draft, log) as (port, _, _):
        openai_client(port).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4
        )
    assert "--record" not in log.read_text()
    assert kept() == before


def test_finetune_from_conversations_writes_a_lossless_drafter(make_pair, tmp_path, capsys):
    """A user's conversations (the target replies to each, up to its last user turn) in, a
    fine-tuned drafter out: the validation before and after is in its card, and it decodes
    the target's own greedy text."""
    target, draft = make_pair(MODEL)
    chats = tmp_path / "chats.jsonl"
    lines = []
    for i in range(72):
        turn = {"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} {i}"}
        if i % 3 == 0:  # a conversation with the reply someone else wrote, which is not used
            lines.append({"messages": [turn, {"role": "assistant", "content": "ignored"}]})
        elif i % 3 == 1:
            lines.append({"prompt": turn["content"]})
        else:
            lines.append({"messages": [turn]})
    chats.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "tuned"
    work = tmp_path / "work"
    cli.main(["train", "finetune", "--from", str(chats), "--draft", str(draft), "--out", str(out),
              "--model", str(target), "--work", str(work), "--max-tokens", "8",
              "--epochs", "0.5", "--val-seqs", "4"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "validation tau on 4 held-out replies:" in printed

    records = read_records(work / "replies.jsonl")
    assert len(records) == 72
    model, tokenizer = dflash_mlx.load(str(target))
    first = helpers.chat_ids(tokenizer, lines[0]["messages"][:1])
    assert records[0]["ids"][: records[0]["start"]] == first
    entries = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    steps = round(0.5 * (64 - 4) / 2)
    assert [e["step"] for e in entries if "val" in e] == [0, steps]
    assert "validation tau on 4 held-out replies" in (out / "README.md").read_text()

    tuned = dflash_mlx.load_draft(str(out))
    prompt = records[-1]["ids"][: records[-1]["start"]]
    expected, _ = helpers.mlx_lm_greedy(model, prompt, 12, set(tokenizer.eos_token_ids))
    replies = dflash_mlx.stream_generate(
        model, tuned, tokenizer, prompt, max_tokens=12, block_size=4
    )
    assert [t for r in replies for t in r.tokens] == expected


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "chats.jsonl:2 is not a JSON object"),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "has no user turn"),
        ('{"reply": "hi"}', 'has none of "messages"'),
    ],
)
def test_a_bad_conversation_file_is_one_line(make_pair, tmp_path, capsys, line, message):
    target, draft = make_pair(MODEL)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "hello"}) + "\n" + line + "\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "finetune", "--from", str(chats), "--draft", str(draft),
                  "--out", str(tmp_path / "out"), "--model", str(target)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1 and message in err and len(err.splitlines()) == 1, err


def test_lockstep_replies_are_the_targets_greedy_replies(loaded):
    """`train data`'s lockstep batches (left-padded prompts of several lengths, finished rows
    dropped as they go) give each prompt mlx-lm's own greedy reply, EOS included."""
    model, tokenizer, _ = loaded(MODEL)
    prompts = build_prompts(200, seed=6)[:7]  # one of them stops at 18 tokens
    records = list(lockstep_replies(model, tokenizer, prompts, 40, batch_size=3))
    assert sorted(r["id"] for r in records) == sorted(p["id"] for p in prompts)
    eos = set(tokenizer.eos_token_ids)
    lengths = set()
    for r in records:
        expected, _ = helpers.mlx_lm_greedy(model, r["ids"][: r["start"]], 40, eos)
        assert r["ids"][r["start"] :] == expected
        lengths.add(len(expected))
    assert len(lengths) > 1  # some rows stopped early, and the others went on without them


def test_a_data_run_stopped_early_has_the_pools_mix_of_categories(loaded):
    """`train data` decodes prompts of similar length together, but only within windows of
    the pool's own order: the first replies of a long run (one stopped by hand) are code,
    math and chat as the pool mixes them, not its shortest prompts (chat) first."""
    _, tokenizer, _ = loaded(MODEL)
    prompts = build_prompts(3000, seed=0)
    lengths = [len(templated_ids(tokenizer, p)) for p in prompts]
    order = decoding_order(lengths, batch_size=32)
    assert sorted(order) == list(range(len(prompts)))
    first = [prompts[i]["category"] for i in order[:512]]
    for category in ("coding", "math", "chat"):
        assert 0.25 < first.count(category) / len(first) < 0.42, (category, first.count(category))
    for start in range(0, len(order), 512):  # each window decodes short to long
        window = [lengths[i] for i in order[start : start + 512]]
        assert window == sorted(window)
    assert sorted(lengths) != [lengths[i] for i in order]  # not one global sort


def test_replies_kept_compressed_are_imported_as_they_are(make_pair, tmp_path, capsys):
    """Another run's replies.jsonl, kept xz-compressed, goes back into a work dir unchanged
    (the target is not asked again), and a rerun adds nothing twice."""
    import lzma

    target, _ = make_pair(MODEL)
    records = [
        {"id": f"chat-{i}", "category": "chat", "ids": [1, 2, 3 + i, 4], "start": 2}
        for i in range(3)
    ]
    kept = tmp_path / "kept.jsonl.xz"
    with lzma.open(kept, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    work = tmp_path / "work"
    for _ in range(2):
        cli.main(
            ["train", "data", "--from", str(kept), "--model", str(target), "--work", str(work)]
        )
    assert read_records(work / "replies.jsonl") == records
    printed = capsys.readouterr().out
    assert "3 stored replies added" in printed and "0 stored replies added" in printed
