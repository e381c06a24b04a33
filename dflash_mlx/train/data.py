"""Self-distillation data: the target's own greedy replies, stored as token ids.

Replies are generated with mlx-lm's continuous `BatchGenerator` and appended to
a JSONL file as each one finishes, so an interrupted run loses only the
replies in flight and a rerun skips the prompt ids already stored. Prompts come
from the offline pool (`prompts.py`) or from a user's chat conversations
(`conversation_prompts`); replies a server recorded (`serve --record`) are the
target's own already and are taken as they are (`import_records`).
"""

from __future__ import annotations

import gzip
import json
import lzma
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..chat_format import chat_prompt, encode_chat, render


def read_text(path: Path) -> str:
    """A file's text, xz- or gzip-decompressed by its suffix (data kept compact)."""
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix)
    if opener is None:
        return path.read_text(encoding="utf-8")
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def read_records(path: Path) -> list[dict]:
    """Records {id, category, ids, start}: `ids` = prompt + reply, reply from `start`.

    A torn last line (a write interrupted mid-line) is dropped; an unparsable
    line before it means the file is damaged, and is an error naming the line.
    """
    if not path.exists():
        return []
    lines = read_text(path).splitlines()
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
    """Greedy replies of `model` to chat-templated `prompts` (a "prompt" text as one user
    turn, or a conversation's "messages"), yielded as they finish."""
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=batch_size,
        prefill_batch_size=min(batch_size, 16),
    )
    ids = [templated_ids(tokenizer, p) for p in prompts]
    uids = gen.insert(ids, [max_tokens] * len(ids))
    by_uid = {uid: (p, i) for uid, p, i in zip(uids, prompts, ids)}
    replies: dict[int, list[int]] = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            replies[r.uid].append(r.token)
            if r.finish_reason is not None:
                yield record_of(*by_uid[r.uid], replies.pop(r.uid))
    gen.close()


def decoding_order(lengths: list[int], batch_size: int, window_batches: int = 16) -> list[int]:
    """Prompt indices in the order lockstep batches decode them: the prompts' own order, cut
    into windows of `window_batches` batches, each window sorted by length so a batch pads
    little. A run stopped at any point has then taken the pool's mix of categories, not its
    shortest prompts (a global sort decodes every short chat prompt before the first code)."""
    window = batch_size * window_batches
    return [
        i
        for start in range(0, len(lengths), window)
        for i in sorted(range(start, min(start + window, len(lengths))), key=lengths.__getitem__)
    ]


def lockstep_replies(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompts: list[dict],
    max_tokens: int,
    batch_size: int = 32,
) -> Iterator[dict]:
    """The records `generate_replies` yields, decoded in lockstep: `batch_size` prompts of
    similar length (`decoding_order`) prefilled together (left-padded), then one forward per
    token for all, finished rows dropped every 16 steps. No row joins a running batch, so no
    cache is ever merged into it, as mlx-lm's continuous batching does for each newcomer; on a
    CPU the widest batch the few-row kernel takes (32) decodes fastest
    (`benchmarks/data_rate.py`). Targets whose layers do not all keep a plain KV cache
    (sliding windows, recurrent layers) fall back to `generate_replies`."""
    if not all(type(c) is KVCache for c in make_prompt_cache(model)):
        yield from generate_replies(model, tokenizer, prompts, max_tokens, batch_size)
        return
    eos = mx.array(sorted(tokenizer.eos_token_ids))
    ids = [templated_ids(tokenizer, p) for p in prompts]
    order = decoding_order([len(i) for i in ids], batch_size)
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        width = max(len(ids[i]) for i in rows)
        pads = [width - len(ids[i]) for i in rows]
        cache = [BatchKVCache(pads) for _ in make_prompt_cache(model)]
        padded = mx.array([[0] * pad + ids[i] for pad, i in zip(pads, rows)])
        token = model(padded, cache=cache)[:, -1].argmax(-1)
        replies: list[list[int]] = [[] for _ in rows]
        live = list(range(len(rows)))  # indices into `rows` of the rows still decoding
        for step in range(max_tokens):
            done = mx.any(token[:, None] == eos[None], axis=-1)
            if step + 1 < max_tokens:
                following = model(token[:, None], cache=cache)[:, -1].argmax(-1)
                mx.async_eval(following)
            for row, t, stop in zip(live, token.tolist(), done.tolist()):
                if replies[row] is not None:
                    replies[row].append(t)
                    if stop or step + 1 == max_tokens:
                        yield record_of(prompts[rows[row]], ids[rows[row]], replies[row])
                        replies[row] = None
            if step + 1 == max_tokens or all(replies[r] is None for r in live):
                break
            token = following
            if step % 16 == 15:  # drop the finished rows
                keep = [k for k, r in enumerate(live) if replies[r] is not None]
                if len(keep) < len(live):
                    for c in cache:
                        c.filter(mx.array(keep))
                    token, live = token[mx.array(keep)], [live[k] for k in keep]


def record_of(prompt: dict, prompt_ids: list[int], reply: list[int]) -> dict:
    return {
        "id": prompt["id"],
        "category": prompt["category"],
        "ids": prompt_ids + reply,
        "start": len(prompt_ids),
    }


def templated_ids(tokenizer: TokenizerWrapper, prompt: dict) -> list[int]:
    """A prompt's token ids, chat-templated as it is served."""
    if "messages" in prompt:
        return encode_chat(tokenizer, chat_prompt(tokenizer, prompt["messages"]))
    return render(tokenizer, prompt["prompt"], chat=True)


def conversation_prompts(path: Path) -> list[dict]:
    """Prompts from a JSONL file of chat conversations, one per line: {"messages": [...]}
    (mlx-lm's and OpenAI's fine-tuning format) or {"prompt": "..."}; or texts, {"text": "..."}
    (mlx-lm's text format), which `text_records` takes as they are; or records another run
    stored ({"ids": [...], "start": n, ...}, `read_records`), kept as {"record": ...}.

    A conversation is kept up to its last user turn: the target writes the reply itself,
    so what a drafter learns is what the target would say, whoever wrote the file's reply.
    """
    prompts = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{where} is not a JSON object ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where} is not a JSON object")
        if isinstance(record.get("ids"), list) and isinstance(record.get("start"), int):
            prompts.append({"record": {"id": f"{path.stem}-{number:06d}", **record}})
            continue
        prompt = {"id": f"{path.stem}-{number:06d}", "category": path.stem}
        given = [k for k in ("prompt", "text") if isinstance(record.get(k), str) and record[k]]
        if given:
            prompts.append({**prompt, given[0]: record[given[0]]})
            continue
        messages = record.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            raise ValueError(
                f'{where} has none of "messages" (a list of {{"role", "content"}}), "prompt" '
                'or "text"'
            )
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise ValueError(f"{where}: the conversation has no user turn to reply to")
        prompts.append({**prompt, "messages": messages[: users[-1] + 1]})
    return prompts


def text_records(
    tokenizer: TokenizerWrapper, item: dict, window: int = 256, context: int = 32
) -> list[dict]:
    """Records of a text the target did not write (`item["text"]`): windows of `window` tokens
    (the drafter's context window), each overlapping the one before by `context` tokens that
    it sees but is not trained on, so every token after the first `context` is labelled once.
    Marked "greedy": false: the trainer learns only the target's greedy path through them
    (`trainer.Sequence`), which one forward per window gives, no decoding."""
    ids = tokenizer.encode(item["text"], add_special_tokens=False, verbose=False)  # any length
    records = []
    for begin in range(0, max(len(ids) - context, 1), window - context):
        piece = ids[begin : begin + window]
        if len(piece) > context + 1:
            number = len(records)
            records.append(
                {
                    "id": f"{item['id']}-{number:04d}",
                    "category": item["category"],
                    "ids": piece,
                    "start": context,
                    "greedy": False,
                }
            )
    return records


def import_records(records: list[dict], path: Path) -> int:
    """Append the `records` that `path` lacks (by id); how many were added."""
    done = {r["id"] for r in read_records(path)}
    new = [r for r in records if r["id"] not in done]
    path.parent.mkdir(parents=True, exist_ok=True)
    end_at_a_record(path)
    with path.open("a") as f:
        for record in new:
            f.write(json.dumps(record) + "\n")
    return len(new)


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
            lockstep_replies(model, tokenizer, todo, max_tokens, batch_size)
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
