"""A server for several clients and conversations, and for a web app: 200 requests from 8
concurrent clients (some cut off, some malformed), a prompt cache per conversation (least
recently used out first, bounded by count and bytes), an API key, the routes with and without
/v1. Every completed reply equals mlx-lm's greedy decoding token for token."""

import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from test_server import (
    JSON,
    PROMPTS,
    get,
    greedy_text,
    openai_client,
    post,
    running_server,
    serving,
)
from test_server_limits import ask, rss_kib

from dflash_mlx import GenerationSettings, make_prompt_cache, stream_generate
from dflash_mlx.decode.prompt_cache import PromptCacheStore, cache_bytes
from dflash_mlx.serve import Policy, Worker

KEY = "s3cret-key"


def reply(model, tokenizer, draft, prompt: list[int], cache, max_tokens: int = 12) -> list[int]:
    settings = GenerationSettings(max_tokens=max_tokens, block_size=4)
    tokens = []
    for r in stream_generate(
        model, draft, tokenizer, prompt, settings=settings, prompt_cache=cache
    ):
        tokens += r.tokens
    return tokens


def test_each_conversation_goes_on_from_its_own_cache(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    store = PromptCacheStore(lambda: make_prompt_cache(model, draft), 4, 2**40)
    a1, b1 = [5, 17, 33, 80, 120, 7], [5, 17, 200, 9, 41]  # the same two opening tokens
    turns = {}
    for name, prompt in (("a", a1), ("b", b1)):
        cache = store.take(prompt)
        turns[name] = prompt + reply(model, tokenizer, draft, prompt, cache)
        store.put(cache)
    assert len(store.entries) == 2  # b copied a's cache, trimmed: a's stays whole
    for name in ("a", "b"):
        follow_up = turns[name] + [60, 61]
        cache = store.take(follow_up)
        assert cache.tokens == turns[name][:-1]  # all but the reply's last token is cached
        cached = reply(model, tokenizer, draft, follow_up, cache)
        assert cached == reply(model, tokenizer, draft, follow_up, make_prompt_cache(model, draft))
        store.put(cache)
    assert len(store.entries) == 2  # each follow-up replaced the turn it extends


def test_the_store_keeps_its_bounds_least_recently_used_out_first(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    made = []
    store = PromptCacheStore(lambda: make_prompt_cache(model, draft), 2, 2**40)
    for first in (11, 12, 13):
        cache = store.take([first, 2, 3])
        reply(model, tokenizer, draft, [first, 2, 3], cache, max_tokens=3)
        made.append(cache)
        store.put(cache)
    assert store.entries == made[1:]
    one = cache_bytes(made[-1])
    store.max_bytes = one  # room for one conversation's arrays
    store.put(store.take([12, 2, 3, 4]))  # used again: now the most recent
    assert [e.tokens[0] for e in store.entries] == [12] and store.nbytes <= one


@pytest.fixture(scope="module")
def keyed(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=8))
    policy = Policy(api_key=KEY, origins=("http://app.example.test",))
    with serving(worker, policy) as port:
        yield port


def test_an_api_key_is_asked_of_every_request_but_health(keyed, loaded):
    port = keyed
    assert get(port, "/health") == (200, {"status": "ok"})
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 8}).encode()
    for headers in (
        JSON,
        {**JSON, "Authorization": "Bearer wrong"},
        {**JSON, "Authorization": KEY},
    ):
        status, head, raw = ask(port, "POST", "/v1/completions", body, headers)
        assert status == 401 and head["WWW-Authenticate"] == "Bearer"
        assert "API key" in json.loads(raw)["error"]["message"]
    assert ask(port, "GET", "/v1/models")[0] == 401
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    text = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=8).choices[0].text
    assert text == greedy_text(loaded, PROMPTS[1], 8, chat=False)[0]


def test_a_browser_s_preflight_needs_no_key(keyed):
    headers = {
        "Origin": "http://app.example.test",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, head, _ = ask(keyed, "OPTIONS", "/v1/chat/completions", None, headers)
    assert status == 200 and head["Access-Control-Allow-Origin"] == "http://app.example.test"


def test_routes_answer_with_and_without_v1(keyed, loaded):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed}", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["m"]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    assert chat.choices[0].message.content == greedy_text(loaded, PROMPTS[0], 8)[0]
    text = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=8).choices[0].text
    assert text == greedy_text(loaded, PROMPTS[1], 8, chat=False)[0]


def test_mlx_lm_server_clients_default_model_is_the_one_served(keyed, loaded):
    """`"model": "default_model"`, as mlx_lm.server's clients send, is the served model; a
    model this server does not serve is named in a 404 that says none other is loaded."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model="default_model", messages=messages, max_tokens=8)
    assert chat.choices[0].message.content == greedy_text(loaded, PROMPTS[0], 8)[0]
    assert chat.model == "m"
    with pytest.raises(openai.NotFoundError) as other:
        client.chat.completions.create(model="Qwen3-4B", messages=messages, max_tokens=8)
    assert other.value.body["message"] == (
        "the model 'Qwen3-4B' is not served here: this server serves 'm' (or 'default_model') "
        "and loads no other"
    )


@pytest.fixture(scope="module")
def busy_server(make_pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    with running_server(*make_pair("llama-tied-gqa"), log, "--max-queue", "16") as s:
        yield s


def client_session(port: int, seed: int, requests: int, expected: dict) -> list[str]:
    """One client's `requests` streaming chats, some cut off after two chunks and some
    malformed; the problems it saw (a completed reply other than its greedy one, a refusal
    other than 400)."""
    rng = random.Random(seed)
    client = openai_client(port)
    problems = []
    for _ in range(requests):
        prompt = rng.choice(PROMPTS)
        kind = rng.choices(["complete", "disconnect", "malformed"], [5, 2, 1])[0]
        if kind == "malformed":
            status, _ = post(port, "/v1/chat/completions", b'{"messages": [{"role": "user"')
            if status != 400:
                problems.append(f"malformed request got {status}")
            continue
        messages = [{"role": "user", "content": prompt}]
        stream = client.chat.completions.create(
            model="llama-tied-gqa", messages=messages, max_tokens=12, stream=True
        )
        text = ""
        for i, chunk in enumerate(stream):
            if kind == "disconnect" and i == 2:
                stream.close()
                break
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        else:
            if text != expected[prompt]:
                problems.append(f"{prompt!r}: {text!r} instead of {expected[prompt]!r}")
    return problems


def test_concurrent_clients_disconnecting_and_malformed_each_get_their_own_reply(
    busy_server, loaded
):
    """8 clients, 200 requests: every completed reply is its prompt's greedy reply, the
    server stays up and its memory flat once the prompt caches are warm."""
    port, _, process = busy_server
    expected = {p: greedy_text(loaded, p, 12)[0] for p in PROMPTS}
    with ThreadPoolExecutor(8) as pool:  # warm-up: the caches of every prompt
        assert (
            sum(pool.map(client_session, [port] * 8, range(8), [5] * 8, [expected] * 8), []) == []
        )
    before = rss_kib(process.pid)
    with ThreadPoolExecutor(8) as pool:
        runs = pool.map(client_session, [port] * 8, range(8, 16), [20] * 8, [expected] * 8)
        assert sum(runs, []) == []
    assert get(port, "/health") == (200, {"status": "ok"})
    after = rss_kib(process.pid)
    assert after - before <= before / 10, (before, after)


def test_a_client_that_never_reads_does_not_stall_the_others(busy_server, loaded):
    port = busy_server[0]
    reader = socket.create_connection(("127.0.0.1", port), timeout=10)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 400, "stream": True})
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    reader.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    try:
        client = openai_client(port)
        for prompt in PROMPTS[:3]:
            reply = client.completions.create(model="llama-tied-gqa", prompt=prompt, max_tokens=8)
            assert reply.choices[0].text == greedy_text(loaded, prompt, 8, chat=False)[0]
    finally:
        reader.close()
