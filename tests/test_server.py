"""`dflash-mlx serve` as a live server on 127.0.0.1, driven by the official `openai` client."""

import http.client
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest
from test_cli import greedy_text

from dflash_mlx.chat_format import plain_chat

PROMPTS = [
    "How many apples?",
    "The quick brown fox",
    "def add(a, b):",
    "print('hello world')",
    "Speculative decoding drafts",
    "Alice has 3 apples",
    "How many positive divisors",
    "jumps over the lazy dog",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(target, draft, log):
    """Start `dflash-mlx serve` on a free port; yields (port, log path), then stops it."""
    port = free_port()
    cmd = [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(target)]
    cmd += ["--draft", str(draft), "--block-size", "4", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if get(port, "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail(f"server did not start:\n{log.read_text()}")
    try:
        yield port, log
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(make_pair, tmp_path_factory):
    target, draft = make_pair("llama-tied-gqa")
    with running_server(target, draft, tmp_path_factory.mktemp("server") / "server.log") as s:
        yield s


def get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def openai_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0
    )


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server[0])


def chat(client, prompt: str, max_tokens: int = 16, **kwargs):
    messages = [{"role": "user", "content": prompt}]
    return client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, **kwargs
    )


def test_health_models_and_local_bind(server, client):
    port, log = server
    assert get(port, "/health") == (200, {"status": "ok"})
    assert len(client.models.list().data) == 1
    assert "127.0.0.1" in log.read_text()


def test_chat_and_text_completions_equal_greedy_decoding(client, loaded):
    reply = chat(client, PROMPTS[0], max_tokens=20)
    text, n = greedy_text(loaded, PROMPTS[0], 20)
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == n
    assert reply.choices[0].finish_reason in ("stop", "length")
    stats = reply.model_extra["dflash"]
    assert stats["generation_tokens"] == n and 0 <= stats["acceptance_rate"] <= 1
    assert stats["proposed"] > 0 and stats["tau"] >= 1

    completion = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=12)
    text, n = greedy_text(loaded, PROMPTS[1], 12, chat=False)
    assert completion.choices[0].text == text
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens == n


def test_streaming_matches_the_whole_reply(client):
    whole = chat(client, PROMPTS[2], max_tokens=24).choices[0].message.content
    chunks = list(
        chat(client, PROMPTS[2], max_tokens=24, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and "dflash" in finals[0].model_extra
    assert (
        chunks[-1].usage.completion_tokens == finals[0].model_extra["dflash"]["generation_tokens"]
    )

    stream = client.completions.create(model="d", prompt=PROMPTS[3], max_tokens=10, stream=True)
    streamed = "".join(c.choices[0].text for c in stream)
    assert (
        streamed
        == client.completions.create(model="d", prompt=PROMPTS[3], max_tokens=10).choices[0].text
    )


def test_concurrent_requests_each_get_their_own_answer(client):
    alone = [chat(client, p).choices[0].message.content for p in PROMPTS]

    def ask(i: int) -> str:
        if i % 2:
            stream = chat(client, PROMPTS[i], stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream)
        return chat(client, PROMPTS[i]).choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, range(len(PROMPTS)), timeout=120))
    assert together == alone


def test_client_disconnect_stops_its_generation(server, client):
    port, log = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"prompt": PROMPTS[0], "max_tokens": 3500, "stream": True}  # greedy: 2,524 tokens
    conn.request("POST", "/v1/completions", json.dumps(body))
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline().startswith(b"data: ")
        assert response.readline() == b"\n"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    # The whole reply takes over 20 s here; the next request is served long before.
    tic = time.monotonic()
    reply = chat(client, PROMPTS[5], max_tokens=8)
    assert time.monotonic() - tic < 8
    assert reply.usage.completion_tokens > 0
    assert "client gone: stopped after" in log.read_text()


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/chat/completions", b'{"messages": [', "Invalid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "object"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', "role"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', "temperature"),
        ("/v1/completions", b'{"prompt": [1, 2, 999999]}', "vocabulary"),
        ("/v1/completions", b'{"prompt": "hi", "n": 3}', "n"),
    ],
)
def test_malformed_requests_get_400_with_a_message(server, path, body, message):
    status, reply = post(server[0], path, body)
    assert status == 400
    assert message in reply["error"]["message"]


def test_negative_max_tokens_is_a_bad_request_for_the_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "hi", max_tokens=-3)


def test_a_model_without_a_chat_template_is_served_in_plain_role_format(
    no_template_pair, loaded, tmp_path
):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPTS[0]},
    ]
    with running_server(*no_template_pair, tmp_path / "server.log") as (port, log):
        client = openai_client(port)
        replies = [
            client.chat.completions.create(model="d", messages=messages, max_tokens=12)
            for _ in range(2)
        ]
        text, n = greedy_text(loaded, plain_chat(messages), 12, chat=False)
        assert [r.choices[0].message.content for r in replies] == [text, text]
        assert replies[0].usage.completion_tokens == n
        assert log.read_text().count("has no chat template") == 1  # warned once
