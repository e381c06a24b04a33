"""A server for several conversations and for a web app: a prompt cache per conversation
(least recently used out first, bounded by count and bytes), an API key, and the routes
with and without /v1. Replies still equal mlx-lm's greedy decoding token for token."""

import json

import openai
import pytest
from test_server import JSON, PROMPTS, get, greedy_text, serving
from test_server_limits import ask

from dflash_mlx import GenerationSettings, make_prompt_cache, stream_generate
from dflash_mlx.prompt_cache import PromptCacheStore, cache_bytes
from dflash_mlx.server import Policy, Worker

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
