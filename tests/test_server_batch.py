"""Concurrent requests decoded together by the server (`--max-batch`): they share verify
forwards, each reply is its own greedy reply, a seeded sampled reply is the same alone and
beside others, and `--max-batch 1` decodes one at a time."""

import json
import socket
import threading

import pytest
from test_cli import greedy_text
from test_server import JSON, PROMPTS, in_background, post, serving, wait_for

from dflash_mlx import GenerationSettings
from dflash_mlx.serve import Worker


def answer(port: int, prompt: str, max_tokens: int, **extra) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, **extra}).encode()
    status, reply = post(port, "/v1/completions", body)
    assert status == 200, reply
    return reply


def completion(port: int, prompt: str, max_tokens: int, **extra) -> str:
    return answer(port, prompt, max_tokens, **extra)["choices"][0]["text"]


def test_a_seeded_sampled_reply_is_the_same_alone_and_beside_others(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    seeded = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0, "seed": 42}
    others = [{"prompt": p, "max_tokens": 16, "temperature": 1.0} for p in PROMPTS[1:4]]
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=16), max_batch=4)
    with serving(worker) as port:
        alone = completion(port, **seeded)
        beside = burst(worker, port, [seeded, *others])[0]
        after = burst(worker, port, [*others, seeded])[-1]
    assert alone == beside == after != ""


def test_a_client_gone_while_waiting_is_skipped(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=6), max_batch=2)
    with serving(worker) as port:
        busy = threading.Event()
        worker.executor.submit(busy.wait)
        try:
            body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 6}).encode()
            gone = socket.create_connection(("127.0.0.1", port), timeout=10)
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            head += JSON["Content-Type"]
            gone.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            wait_for(lambda: worker.pending == 1, "the request to wait")
            gone.close()  # its client leaves before its turn
            wait_for(lambda: worker.waiting[0][1].is_set(), "the server to see it leave")
        finally:
            busy.set()
        wait_for(lambda: worker.pending == 0, "the worker to skip it")
        assert completion(port, PROMPTS[2], 6) == greedy_text(loaded, PROMPTS[2], 6, chat=False)[0]


def test_a_request_failing_in_the_worker_fails_alone(loaded):
    """A generation that fails as it starts, in the worker thread (here: made to), answers
    its request with the error and leaves the worker serving the others."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=6), max_batch=2)
    generate = worker.generate

    def failing(job, *args):
        if job.kwargs.get("max_tokens") == 5:
            raise ValueError("this generation cannot start")
        return generate(job, *args)

    worker.generate = failing
    with serving(worker) as port:
        body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 5}).encode()
        status, answer = post(port, "/v1/completions", body)
        assert status == 500 and "cannot start" in answer["error"]["message"]
        wait_for(lambda: worker.pending == 0, "the worker to go on")
        assert completion(port, PROMPTS[3], 6) == greedy_text(loaded, PROMPTS[3], 6, chat=False)[0]


def test_a_waiting_request_joins_the_cycle_after_a_reply_ends(loaded):
    """A reply that ends frees its place at once: the request waiting for it is prefilled in
    the batch's next cycle, not one later (the others decoding at a narrower width)."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=24), max_batch=2)
    batch, cycles = worker.batch, []  # per cycle: (replies joining at its start, replies ended)
    run_cycle = batch._cycle

    def logged() -> None:
        joining, before = len(batch.joining), set(map(id, batch.replies + batch.joining))
        run_cycle()
        cycles.append((joining, len(before - set(map(id, batch.replies)))))

    batch._cycle = logged
    # whichever two start, the first to end leaves the other decoding
    requests = [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS, (3, 12, 24))]
    with serving(worker) as port:
        texts = burst(worker, port, requests)
    expected = [greedy_text(loaded, r["prompt"], r["max_tokens"], chat=False)[0] for r in requests]
    assert texts == expected
    first_end = next(i for i, (_, ended) in enumerate(cycles) if ended)
    assert cycles[0][0] == 2 and cycles[first_end + 1][0] == 1, cycles


def burst(worker: Worker, port: int, requests: list[dict], send=completion) -> list:
    """`requests` sent together (by `send`) once the worker is held busy, so that all of them
    wait and then start in one batch."""
    busy = threading.Event()
    worker.executor.submit(busy.wait)
    try:
        futures = [in_background(lambda r=r: send(port, **r)) for r in requests]
        wait_for(lambda: worker.pending == len(requests), "the requests to queue")
    finally:
        busy.set()
    return [f.result(timeout=300) for f in futures]


@pytest.mark.parametrize("max_batch", [4, 1])
def test_concurrent_requests_share_cycles_and_get_their_own_replies(loaded, launched, max_batch):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=24), max_batch=max_batch)
    requests = [{"prompt": p, "max_tokens": 12 + 3 * i} for i, p in enumerate(PROMPTS[:6])]
    with serving(worker) as port:
        texts = burst(worker, port, requests)
        wait_for(lambda: worker.pending == 0, "the batch to drain")
    expected = [greedy_text(loaded, r["prompt"], r["max_tokens"], chat=False)[0] for r in requests]
    assert texts == expected
    widths = {rows for rows, _, _ in launched}
    assert max(widths) == max_batch  # one at a time, or the four in one cycle
    assert not worker.batch.replies and worker.batch.held is None


def test_four_clients_share_tree_cycles_with_the_lookup(loaded):
    """`--max-batch 4 --tree-budget 8`: four concurrent greedy requests verify their trees
    (the prompt lookup's grafts within them) in shared cycles, each reply its solo reply."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    settings = GenerationSettings(max_tokens=24, tree_budget=8)
    worker = Worker(model, tokenizer, draft, settings, max_batch=4)
    requests = [{"prompt": p, "max_tokens": 24} for p in PROMPTS[:4]]
    with serving(worker) as port:
        answers = burst(worker, port, requests, send=answer)
    expected = [greedy_text(loaded, r["prompt"], r["max_tokens"], chat=False)[0] for r in requests]
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert all(a["dflash"]["shared_tree_cycles"] > 0 for a in answers)
