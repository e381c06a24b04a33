"""Self-distillation data: the target's own greedy replies, stored as token ids.

Replies are generated with mlx-lm's continuous `BatchGenerator` and appended to
a JSONL file as each one finishes, so an interrupted run loses only the
replies in flight and a rerun skips the prompt ids already stored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..chat_format import render


def read_records(path: Path) -> list[dict]:
    """Records {id, category, ids, start}: `ids` = prompt + reply, reply from `start`.

    A torn last line (a write interrupted mid-line) is dropped; an unparsable
    line before it means the file is damaged, and is an error naming the line.
    """
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number < len(lines):
                raise ValueError(f"{path}:{number} is not a JSON record ({exc})") from exc
    return out


def end_at_a_record(path: Path) -> None:
    """Cut a torn last line before appending, so the next record starts a line of its own."""
    if not path.exists():
        return
    text = path.read_bytes()
    if not text or text.endswith(b"\n"):
        return
    head, _, last = text.rpartition(b"\n")
    try:
        json.loads(last)
    except json.JSONDecodeError:
        with path.open("r+b") as f:
            f.truncate(len(head) + 1 if head else 0)
    else:  # complete, only its newline missing
        with path.open("ab") as f:
            f.write(b"\n")


def generate_replies(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompts: list[dict],
    max_tokens: int,
    batch_size: int = 32,
) -> Iterator[dict]:
    """Greedy replies of `model` to chat-templated `prompts`, yielded as they finish."""
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=batch_size,
        prefill_batch_size=min(batch_size, 16),
    )
    ids = [render(tokenizer, p["prompt"], chat=True) for p in prompts]
    uids = gen.insert(ids, [max_tokens] * len(ids))
    by_uid = {uid: (p, i) for uid, p, i in zip(uids, prompts, ids)}
    replies: dict[int, list[int]] = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            replies[r.uid].append(r.token)
            if r.finish_reason is not None:
                prompt, prompt_ids = by_uid[r.uid]
                yield {
                    "id": prompt["id"],
                    "category": prompt["category"],
                    "ids": prompt_ids + replies.pop(r.uid),
                    "start": len(prompt_ids),
                }
    gen.close()


def extend_dataset(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompts: list[dict],
    path: Path,
    max_tokens: int,
    batch_size: int = 32,
) -> None:
    """Append replies for the prompts not yet in `path`, logging the generation rate."""
    done = {r["id"] for r in read_records(path)}
    todo = [p for p in prompts if p["id"] not in done]
    print(f"{len(done)} replies stored, {len(todo)} to generate -> {path}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    end_at_a_record(path)
    tic, tokens = time.perf_counter(), 0
    with path.open("a") as f:
        for n, record in enumerate(
            generate_replies(model, tokenizer, todo, max_tokens, batch_size)
        ):
            f.write(json.dumps(record) + "\n")
            f.flush()
            tokens += len(record["ids"]) - record["start"]
            if (n + 1) % 16 == 0:
                rate = tokens / (time.perf_counter() - tic)
                print(
                    f"{len(done) + n + 1} replies, {tokens} new tokens, {rate:.1f} tok/s",
                    flush=True,
                )
