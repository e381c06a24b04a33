"""`dflash-mlx serve` as a live server on 127.0.0.1, driven by the official `openai` client."""

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import helpers
import openai
import pytest
import uvicorn
from mlx_lm.utils import load_tokenizer
from test_cli import decode_greedy, greedy_text
from test_generate import oracle_for
from test_stops import stop_in

import dflash_mlx
from dflash_mlx import GenerationSettings, cli
from dflash_mlx.chat_format import plain_chat
from dflash_mlx.serve import Worker, create_app

MODEL = "llama-tied-gqa"  # the id the server lists: its directory's name
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


def start_server(target, draft, log, *flags: str) -> tuple[int, subprocess.Popen]:
    """`dflash-mlx serve` (with `flags`) on a free port, once it answers: (port, process)."""
    port = free_port()
    cmd = [sys.executable, "-m", "dflash_mlx", "serve", "--model", str(target)]
    cmd += ["--draft", str(draft), "--block-size", "4", "--port", str(port), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if get(port, "/health")[0] == 200:
                return port, proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"server did not start:\n{log.read_text()}")


@contextmanager
def running_server(target, draft, log, *flags: str):
    """Start `dflash-mlx serve` (with `flags`) on a free port; yields (port, log path, process),
    then stops it."""
    port, proc = start_server(target, draft, log, *flags)
    try:
        yield port, log, proc
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # a clean stop: MLX must not abort as the generation thread goes (Worker.close), which
    # it did in 2 of 6 tries before
    text = log.read_text()
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{text[-3000:]}"
    assert "Application shutdown complete" in text and "terminate called" not in text, text
    assert "Traceback" not in text, text


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


JSON = {"Content-Type": "application/json"}


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body, JSON)
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
        model=MODEL, messages=messages, max_tokens=max_tokens, **kwargs
    )


def test_health_models_and_local_bind(server, client):
    port, log, _ = server
    assert get(port, "/health") == (200, {"status": "ok"})
    # the model directory's name: where it lies on disk is none of the clients' business
    assert [m.id for m in client.models.list().data] == ["llama-tied-gqa"]
    assert "127.0.0.1" in log.read_text()


def test_chat_and_text_completions_equal_greedy_decoding(client, loaded):
    reply = chat(client, PROMPTS[0], max_tokens=20)
    assert reply.model == "llama-tied-gqa"
    text, n = greedy_text(loaded, PROMPTS[0], 20)
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens == n
    assert reply.choices[0].finish_reason in ("stop", "length")
    stats = reply.model_extra["dflash"]
    assert stats["generation_tokens"] == n and 0 <= stats["acceptance_rate"] <= 1
    assert stats["proposed"] > 0 and stats["tau"] >= 1
    kinds = stats["chain_cycles"] + stats["tree_cycles"] + stats["plain_cycles"]
    assert kinds == stats["cycles"] and stats["strategy"]
    assert "drafting_off_reason" in stats and "drafting_off_since_cycle" in stats

    completion = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12)
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
    for chunk in chunks[1:-1]:  # each chunk's content, by where it came from, and live stats
        live = chunk.model_extra["dflash"]
        pieces = "".join(piece for piece, _ in live["sources"])
        assert pieces == (chunk.choices[0].delta.content or "") and live["generation_tps"] > 0
    assert (
        chunks[-1].usage.completion_tokens == finals[0].model_extra["dflash"]["generation_tokens"]
    )

    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, stream=True)
    streamed = "".join(c.choices[0].text for c in stream)
    assert (
        streamed
        == client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10).choices[0].text
    )


def test_a_request_can_turn_drafting_off(client, loaded):
    """`dflash: {"draft": false}`: the same greedy text, decoded in plain steps."""
    off = {"dflash": {"draft": False}}
    for stream in (False, True):
        reply = chat(client, PROMPTS[4], max_tokens=12, stream=stream, extra_body=off)
        chunks = list(reply) if stream else [reply]
        blocks = [c.model_extra["dflash"] for c in chunks if "dflash" in c.model_extra]
        stats = blocks[-1]
        assert stats["strategy"] == f"plain {stats['cycles']}" and stats["accepted"] == 0
        parts = [c.choices[0].delta if stream else c.choices[0].message for c in chunks]
        text = "".join(part.content or "" for part in parts)
        assert text == greedy_text(loaded, PROMPTS[4], 12)[0]
        assert {source for b in blocks for _, source in b["sources"]} == {"target"}


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
    port, log, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"prompt": PROMPTS[0], "max_tokens": 3500, "stream": True}  # greedy: 2,524 tokens
    conn.request("POST", "/v1/completions", json.dumps(body), JSON)
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


MESSAGES = b'{"messages": [{"role": "user", "content": "hi"}]}'


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
        ("/v1/completions", b'{"prompt": "hi", "n": 3}', "n=3 is not supported"),
        ("/v1/completions", b'{"prompt": ["hi", "yo"]}', "one prompt per request"),
        ("/v1/completions", b'{"prompt": "hi", "echo": true}', "echo=true"),
        ("/v1/completions", b'{"prompt": "hi", "xtc_threshold": 0.7}', "xtc_threshold"),
        ("/v1/chat/completions", MESSAGES[:-1] + b', "tool_choice": "required"}', "tool_choice"),
        (
            "/v1/chat/completions",
            MESSAGES[:-1] + b', "response_format": {"type": "json_object"}}',
            "response_format",
        ),
        ("/v1/chat/completions", MESSAGES[:-1] + b', "stop": 5}', "stop"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
            b'{"url": "data:image/png;base64,AAAA"}}]}]}',
            "messages.0.content: image parts are not supported: this server prefills text",
        ),
    ],
)
def test_malformed_requests_get_400_with_a_message(server, path, body, message):
    status, reply = post(server[0], path, body)
    assert status == 400
    assert message in reply["error"]["message"]


def test_negative_max_tokens_is_a_bad_request_for_the_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        chat(client, "hi", max_tokens=-3)


def test_stop_strings_end_the_reply_before_them_streaming_or_not(client, loaded):
    reference, _ = greedy_text(loaded, PROMPTS[5], 40)
    early, late = stop_in(reference, 6), stop_in(reference, 14)
    expected = reference[: reference.index(early)]
    reply = chat(client, PROMPTS[5], max_tokens=40, stop=[late, early])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(chat(client, PROMPTS[5], max_tokens=40, stop=early, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == expected and not any(early in p for p in pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"

    reference, _ = greedy_text(loaded, PROMPTS[5], 40, chat=False)
    stop = stop_in(reference, 1)
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=40, stop=stop)
    assert completion.choices[0].text == reference[: reference.index(stop)]


def test_list_prompt_and_max_completion_tokens(client, loaded):
    text, n = greedy_text(loaded, PROMPTS[3], 9, chat=False)
    completion = client.completions.create(model=MODEL, prompt=[PROMPTS[3]], max_tokens=9)
    assert completion.choices[0].text == text and completion.usage.completion_tokens == n
    text, n = greedy_text(loaded, PROMPTS[4], 7)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}], max_completion_tokens=7
    )
    assert reply.choices[0].message.content == text and reply.usage.completion_tokens == n


def test_penalties_and_logit_bias_equal_mlx_lm_with_the_same_processors(client, loaded):
    settings = dict(
        repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={57: 6.0}
    )
    expected, n = greedy_text(loaded, PROMPTS[6], 24, **settings)
    assert expected != greedy_text(loaded, PROMPTS[6], 24)[0]  # the settings change the reply
    reply = chat(
        client,
        PROMPTS[6],
        max_tokens=24,
        presence_penalty=0.6,
        frequency_penalty=0.4,
        logit_bias={"57": 6.0},
        extra_body={"repetition_penalty": 1.3},
    )
    assert reply.choices[0].message.content == expected and reply.usage.completion_tokens == n
    bias = {57: -4.0, 120: 5.0}
    expected, _ = greedy_text(loaded, PROMPTS[7], 16, chat=False, logit_bias=bias)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPTS[7], max_tokens=16, logit_bias={"57": -4.0, "120": 5.0}
    )
    assert completion.choices[0].text == expected


def test_xtc_sampling_is_taken_as_mlx_lm_server_takes_it(client, loaded):
    """`xtc_probability` and `xtc_threshold` in a request: a seeded reply is the one the
    library gives with them, the newline and the EOS spared as mlx_lm.server spares them."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    xtc = {"xtc_probability": 0.5, "xtc_threshold": 0.05}
    asked = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=3)
    reply = client.completions.create(**asked, extra_body=xtc).choices[0].text
    spared = tuple(tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
    ids = tokenizer.encode(PROMPTS[1])
    settings = dict(max_tokens=16, temperature=1.0, seed=3, xtc_special_tokens=spared)
    assert reply == dflash_mlx.generate(model, draft, tokenizer, ids, **settings, **xtc)
    assert reply != client.completions.create(**asked).choices[0].text


@pytest.fixture(scope="module")
def tool_client(make_pair, tmp_path_factory):
    """A server on llama-tools: the same weights, a tool-calling chat template."""
    log = tmp_path_factory.mktemp("tool-server") / "server.log"
    with running_server(*make_pair("llama-tools"), log) as (port, _, _):
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0
        )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_tool_call_round_trip(tool_client, loaded):
    model, tokenizer, _ = loaded("llama-tools")
    call_token = tokenizer.convert_tokens_to_ids(helpers.TOOL_CALL)
    eos = tokenizer.eos_token_id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # The bias makes the model emit the call token once (the presence penalty then
    # outweighs it), then EOS: a tool call as a real model would make one.
    forced = dict(logit_bias={str(call_token): 100.0, str(eos): 50.0}, presence_penalty=200.0)
    for stream in (False, True):
        request = dict(
            model="llama-tools", messages=messages, tools=[WEATHER], max_tokens=8, **forced
        )
        if stream:
            chunks = list(tool_client.chat.completions.create(stream=True, **request))
            calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
            assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
            call = calls[0].choices[0].delta.tool_calls[0]
        else:
            reply = tool_client.chat.completions.create(**request)
            assert reply.choices[0].finish_reason == "tool_calls"
            assert reply.choices[0].message.content is None
            call = made = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}

    answer = [
        {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
        {"role": "tool", "tool_call_id": made.id, "content": "22 C and sunny"},
    ]
    reply = tool_client.chat.completions.create(
        model="llama-tools", messages=messages + answer, tools=[WEATHER], max_tokens=12
    )
    # What mlx-lm renders from the same conversation (arguments as an object).
    rendered_call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    template_messages = [
        *messages,
        {"role": "assistant", "content": "", "tool_calls": [rendered_call]},
        {"role": "tool", "content": "22 C and sunny"},
    ]
    ids = helpers.chat_ids(tokenizer, template_messages, [WEATHER])
    text = tokenizer.decode(ids)
    assert '"get_weather"' in text and "22 C and sunny" in text
    expected, n = decode_greedy(model, tokenizer, ids, 12)
    assert reply.choices[0].message.content == expected and reply.usage.completion_tokens == n
    assert reply.usage.prompt_tokens == len(ids)


def test_chat_template_kwargs_reach_the_template(tool_client, loaded):
    model, tokenizer, _ = loaded("llama-tools")
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ids = helpers.chat_ids(tokenizer, messages, style="terse")
    assert "(terse)" in tokenizer.decode(ids)
    reply = tool_client.chat.completions.create(
        model="llama-tools",
        messages=messages,
        max_tokens=10,
        extra_body={"chat_template_kwargs": {"style": "terse"}},
    )
    expected, _ = decode_greedy(model, tokenizer, ids, 10)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids)
    plain = tool_client.chat.completions.create(
        model="llama-tools", messages=messages, max_tokens=10
    )
    assert plain.usage.prompt_tokens < reply.usage.prompt_tokens


def test_logprobs_equal_mlx_lm_s_streaming_or_not(client, loaded):
    model, tokenizer, _ = loaded("llama-tied-gqa")
    settings = dict(presence_penalty=0.5)  # logprobs are after the processors, as mlx-lm's
    ids = helpers.chat_ids(tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    eos = set(tokenizer.eos_token_ids)
    tokens, vectors = helpers.mlx_lm_greedy(model, ids, 12, eos, **settings)
    request = dict(max_tokens=12, logprobs=True, top_logprobs=3, presence_penalty=0.5)

    def check(entries) -> None:
        assert [e.model_extra["id"] for e in entries] == tokens
        for entry, vector in zip(entries, vectors, strict=True):
            assert entry.logprob == pytest.approx(vector[entry.model_extra["id"]].item(), abs=1e-3)
            best = sorted(range(vector.size), key=lambda i: -vector[i].item())[:3]
            assert [t.model_extra["id"] for t in entry.top_logprobs] == best
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                [vector[i].item() for i in best], abs=1e-3
            )
            assert entry.token == tokenizer.convert_ids_to_tokens(entry.model_extra["id"])

    check(chat(client, PROMPTS[2], **request).choices[0].logprobs.content)
    chunks = list(chat(client, PROMPTS[2], stream=True, **request))
    check(
        [
            e
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
    )
    assert chat(client, PROMPTS[2], max_tokens=4).choices[0].logprobs is None

    completion = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, logprobs=2, presence_penalty=0.5
    )
    logprobs = completion.choices[0].logprobs  # the completions API's shape too
    assert logprobs.tokens == tokenizer.convert_ids_to_tokens(tokens)
    assert logprobs.token_logprobs == pytest.approx(
        [v[t].item() for t, v in zip(tokens, vectors, strict=True)], abs=1e-3
    )
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def wait_for(condition, what: str, timeout: float = 120) -> None:
    """Poll `condition` until true; generous: the machine may be loaded."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextmanager
def serving(worker, policy=None):
    """`create_app(worker, policy)` served by uvicorn on 127.0.0.1 in this process; yields
    the port."""
    config = uvicorn.Config(
        create_app(worker, "m", policy), host="127.0.0.1", port=free_port(), log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started
        yield config.port
    finally:
        server.should_exit = True
        thread.join()


def in_background(fn, *args):
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def test_chat_template_is_rendered_off_the_event_loop(make_pair, loaded):
    model, _, draft = loaded("llama-tied-gqa")
    tokenizer = load_tokenizer(make_pair("llama-tied-gqa")[0])
    rendering, release = threading.Event(), threading.Event()
    render = tokenizer.apply_chat_template

    def slow_template(*args, **kwargs):
        rendering.set()
        release.wait()
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = slow_template
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=8))
    with serving(worker) as port:
        body = json.dumps({"messages": [{"role": "user", "content": PROMPTS[0]}]}).encode()
        reply = in_background(post, port, "/v1/chat/completions", body)
        try:
            assert rendering.wait(120)
            assert get(port, "/health") == (200, {"status": "ok"})  # the loop is free
        finally:
            release.set()
        status, answer = reply.result(timeout=120)
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == greedy_text(loaded, PROMPTS[0], 8)[0]


def test_full_wait_queue_answers_503_with_retry_after(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    settings = GenerationSettings(max_tokens=6)
    worker = Worker(model, tokenizer, draft, settings, max_queue=1, max_batch=1)
    with serving(worker) as port:
        busy = threading.Event()
        worker.executor.submit(busy.wait)  # the model is busy until we say
        body = json.dumps({"prompt": PROMPTS[1], "max_tokens": 6}).encode()
        try:
            queued = [in_background(post, port, "/v1/completions", body) for _ in range(2)]
            wait_for(lambda: worker.pending == 2, "two requests to queue")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", body, JSON)
            refused = conn.getresponse()
            assert refused.status == 503 and int(refused.getheader("Retry-After")) > 0
            assert "busy" in json.loads(refused.read())["error"]["message"]
            conn.close()
        finally:
            busy.set()
        texts = {f.result(timeout=120)[1]["choices"][0]["text"] for f in queued}
        assert texts == {greedy_text(loaded, PROMPTS[1], 6, chat=False)[0]}
        wait_for(lambda: worker.pending == 0, "the queue to drain")
        assert post(port, "/v1/completions", body)[0] == 200


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-queue", "-1", "--max-queue must be at least 0"),
        ("--max-batch", "0", "--max-batch must be at least 1"),
        ("--max-connections", "0", "--max-connections must be at least 1"),
        ("--request-timeout", "0", "--request-timeout must be above 0"),
    ],
)
def test_limit_flags_are_checked(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:  # before anything loads: "x" is no model
        cli.main(["serve", "--model", "x", "--no-draft", flag, value])
    assert exit_info.value.code != 0 and message in capsys.readouterr().err


def test_non_streaming_client_disconnect_stops_its_generation(server):
    port, log, _ = server
    starts = log.read_text().count("generating:")
    stops = log.read_text().count("client gone: stopped after")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"prompt": PROMPTS[0], "max_tokens": 3500}  # greedy: 2,524 tokens
    conn.request("POST", "/v1/completions", json.dumps(body), JSON)
    wait_for(lambda: log.read_text().count("generating:") > starts, "the generation to start")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    gone = "client gone: stopped after"
    wait_for(lambda: log.read_text().count(gone) > stops, "the generation to stop", timeout=300)
    stopped_after = int(log.read_text().split(gone)[-1].split()[0])
    assert stopped_after < 2524


def test_server_reports_the_known_tau_of_an_oracle_drafter(loaded):
    model, tokenizer, draft = loaded("llama-untied-mha")
    prompt = [5, 17, 33, 80, 120]
    oracle, tau = oracle_for(model, tokenizer, draft, prompt, 25, 4)
    worker = Worker(model, tokenizer, oracle, GenerationSettings(max_tokens=25, block_size=4))
    with serving(worker) as port:
        status, reply = post(port, "/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert status == 200
    assert reply["dflash"]["tau"] == pytest.approx(tau) and tau > 3
    assert reply["dflash"]["acceptance_rate"] == 1.0


def test_a_model_without_a_chat_template_is_served_in_plain_role_format(
    no_template_pair, loaded, tmp_path
):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": PROMPTS[0]},
    ]
    with running_server(*no_template_pair, tmp_path / "server.log") as (port, log, _):
        client = openai_client(port)
        replies = [
            client.chat.completions.create(
                model="llama-no-chat-template", messages=messages, max_tokens=12
            )
            for _ in range(2)
        ]
        text, n = greedy_text(loaded, plain_chat(messages), 12, chat=False)
        assert [r.choices[0].message.content for r in replies] == [text, text]
        assert replies[0].usage.completion_tokens == n
        assert log.read_text().count("has no chat template") == 1  # warned once


CLOSED_WORKER = """
import sys
from dflash_mlx import GenerationSettings, load, load_draft
from dflash_mlx.serve import Job, Worker

model, tokenizer = load(sys.argv[1])
worker = Worker(model, tokenizer, load_draft(sys.argv[2]), GenerationSettings(max_tokens=8))
for kwargs in ({}, {"tree_budget": 4}):  # compiled norms, RoPE and exps on the worker thread
    job = Job(prompt=list(range(5, 30)), kwargs=kwargs)
    worker.executor.submit(lambda: list(worker.generate(job))).result()
worker.close()
"""


def test_a_closed_worker_lets_the_process_exit_cleanly(make_pair):
    """Without `Worker.close` this process aborted at exit in 11 of 12 runs ("terminate called
    without an active exception": MLX freeing the thread's compiled graphs during shutdown)."""
    target, draft = make_pair("llama-tied-gqa")
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", CLOSED_WORKER, str(target), str(draft)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr
