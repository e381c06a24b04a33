"""`dflash-mlx serve` against clients that send too much, too slowly, from the wrong place or
with values no sampler should see: each is refused before it costs anything (in OpenAI's
JSON error shape, a client still sending included), while `/health` stays quick and the
server's memory flat. A request that fails in generation, or whose client leaves, ends
alone; SIGTERM ends every stream with a finish reason within seconds. A live server on
127.0.0.1."""

import http.client
import json
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from test_server import (
    JSON,
    PROMPTS,
    get,
    greedy_text,
    post,
    running_server,
    serving,
    start_server,
    wait_for,
)

from dflash_mlx import GenerationSettings
from dflash_mlx.response import GenerationResponse
from dflash_mlx.serve import (
    CLIENT_GONE,
    NO_LOGPROB,
    PROMPT_CHARS_PER_TOKEN,
    Policy,
    Worker,
    logprob_entries,
)

REQUEST_TIMEOUT_S = 2
MAX_CONNECTIONS = 16
MAX_BODY_BYTES = 4 * 2**20  # the default
FLAGS = ["--request-timeout", str(REQUEST_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]
FLAGS += ["--allowed-hosts", "api.example.test", "--allowed-origins", "http://app.example.test"]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, prlimit")


@pytest.fixture(scope="module")
def server(make_pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    with running_server(*make_pair("llama-tied-gqa"), log, *FLAGS) as s:
        yield s


def ask(port: int, method: str, path: str, body=None, headers=None):
    """(status, headers, body) of one request; a body that is an iterable goes chunked."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        chunked = body is not None and not isinstance(body, bytes)
        conn.request(method, path, body, headers or {}, encode_chunked=chunked)
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def refusal(port: int, path: str, body, headers=None) -> tuple[int, dict]:
    """Status and OpenAI-shaped error of a request; the error is one line of JSON."""
    status, _, raw = ask(port, "POST", path, body, JSON if headers is None else headers)
    assert b"\n" not in raw
    return status, json.loads(raw)["error"]


def quick_health(port: int, since: float | None = None) -> None:
    """/health answers before the request timeout: had clients that connected at `since`
    (default: now) blocked it, it would have waited for that timeout to drop them."""
    since = time.monotonic() if since is None else since
    assert get(port, "/health") == (200, {"status": "ok"})
    assert time.monotonic() - since < REQUEST_TIMEOUT_S


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def until_closed(sock: socket.socket, timeout: float = 10) -> tuple[float, bytes]:
    """What the server sends on `sock` until it closes it, and how long that took."""
    sock.settimeout(timeout)
    tic, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open {timeout} s, having sent {data!r}")
    return time.monotonic() - tic, data


HEAD = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
SHORT_BODY = (HEAD + 'Content-Length: 100\r\n\r\n{"prompt": ').encode()  # 88 bytes short
# a request waiting for the server's go-ahead to send its body, which never comes
AWAITING_BODY = (HEAD + "Expect: 100-continue\r\nContent-Length: 100\r\n\r\n").encode()
OVER_LIMIT = (HEAD + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n").encode()  # no body sent
HI = {"prompt": "hi", "max_tokens": 2}
TEXT = "/v1/completions"
TOO_LONG = "a" * (PROMPT_CHARS_PER_TOKEN * 4096 + 1)  # the test models' context: 4096 tokens


def huge_prompt_chunks():
    """A valid JSON request whose body is over the limit, in 64 KiB chunks."""
    yield b'{"max_tokens": 2, "prompt": "'
    for _ in range(MAX_BODY_BYTES // 2**16 + 1):
        yield b"a" * 2**16
    yield b'"}'


@pytest.mark.parametrize(
    "key, value",
    [("chat_template", "{{ 'pwned' }}"), ("tokenize", True), ("add_generation_prompt", 0)],
)
def test_a_request_may_not_choose_the_chat_template(server, key, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {key: value}}
    status, error = refusal(server[0], "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and error["param"] == "chat_template_kwargs" and key in error["message"]


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    port = server[0]
    with connect(port) as sock:  # its Content-Length says so: answered without the body
        sock.sendall(OVER_LIMIT)
        _, data = until_closed(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"--max-body-bytes" in body
    assert json.loads(body)["error"]["message"]
    status, error = refusal(  # chunked: counted while read
        port, "/v1/completions", huge_prompt_chunks(), {**JSON, "Transfer-Encoding": "chunked"}
    )
    assert status == 413 and "--max-body-bytes" in error["message"]
    quick_health(port)


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server):
    body = json.dumps({"prompt": TOO_LONG}).encode()
    status, error = refusal(server[0], "/v1/completions", body)
    assert status == 400 and error["param"] == "prompt" and str(len(TOO_LONG)) in error["message"]
    body = json.dumps({"messages": [{"role": "user", "content": TOO_LONG}]}).encode()
    status, error = refusal(server[0], "/v1/chat/completions", body)
    assert status == 400 and error["param"] == "messages"


def test_stop_strings_are_bounded_in_number_and_length(server):
    port = server[0]
    for stop in [[str(i) for i in range(17)], ["x" * 1001]]:
        status, error = refusal(port, "/v1/completions", json.dumps({**HI, "stop": stop}).encode())
        assert status == 400 and error["param"] == "stop"
    most = [chr(65 + i) * 1000 for i in range(16)]
    assert post(port, "/v1/completions", json.dumps({**HI, "stop": most}).encode())[0] == 200


@pytest.mark.parametrize(
    "name, value",
    [
        ("seed", "-1"),
        ("seed", str(2**70)),
        ("temperature", "NaN"),
        ("top_p", "NaN"),
        ("min_p", "Infinity"),
        ("presence_penalty", "NaN"),
        ("frequency_penalty", "-Infinity"),
        ("repetition_penalty", "Infinity"),
        ("logit_bias", '{"5": NaN}'),
    ],
)
def test_out_of_range_seeds_and_non_finite_numbers_get_400_naming_them(server, name, value):
    body = f'{{"prompt": "hi", "max_tokens": 2, "{name}": {value}}}'.encode()
    status, error = refusal(server[0], "/v1/completions", body)
    assert status == 400 and error["param"].startswith(name) and name in error["message"]


@pytest.mark.parametrize(
    "arguments, words",
    [
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
        ('{"a": NaN}', "NaN"),
        ('{"a": -Infinity}', "-Infinity"),
    ],
)
def test_tool_call_arguments_too_deep_or_not_finite_get_400(server, arguments, words):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    body = json.dumps({"messages": messages, "max_tokens": 2}).encode()
    status, error = refusal(server[0], "/v1/chat/completions", body)
    assert status == 400 and words in error["message"], error
    assert error["param"].startswith("messages.1.tool_calls.0.function.arguments")


def many_messages(size: int) -> bytes:
    """A chat body of one-character messages, `size` bytes long (its tail blanks): within the
    body limit, but over the characters a prompt may have."""
    one = b'{"role": "user", "content": "a"}, '
    head, tail = b'{"max_tokens": 2, "messages": [', b'{"role": "user", "content": "a"}]}'
    body = head + one * ((size - len(head) - len(tail)) // len(one)) + tail
    return body + b" " * (size - len(body))


def test_large_bodies_leave_the_event_loop_to_the_other_clients(server):
    """Three bodies of ~120,000 messages (3.9 MiB, and one exactly at the limit) sent at once:
    each refused with 400, while /health and another client's requests go on about as before
    (goals on an idle machine: /health within 0.2 s, requests within 2x; here generous)."""
    port = server[0]
    normal = json.dumps({"prompt": "hi", "max_tokens": 8}).encode()

    def timed() -> float:
        tic = time.monotonic()
        assert post(port, TEXT, normal)[0] == 200
        return time.monotonic() - tic

    alone = sorted(timed() for _ in range(3))[1]
    bodies = [many_messages(int(3.9 * 2**20))] * 2 + [many_messages(MAX_BODY_BYTES)]
    health, done = [], threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            tic = time.monotonic()
            assert get(server[0], "/health")[0] == 200
            health.append(time.monotonic() - tic)
            time.sleep(0.02)

    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        poller = pool.submit(poll_health)
        big = [pool.submit(post, port, "/v1/chat/completions", body) for body in bodies]
        during = [timed() for _ in range(3)]
        answers = [b.result() for b in big]
        done.set()
        poller.result()
    for status, reply in answers:
        assert status == 400 and "characters, over the" in reply["error"]["message"], reply
    assert max(health) < 1.0, f"/health took up to {max(health):.2f} s"
    assert max(during) < 2 * alone + 2.0, f"{during} against {alone:.2f} s alone"


def test_logit_bias_keys_are_ascii_digits_and_health_answers_head(server):
    port = server[0]
    for key in ("\u0661\u0662", "\uff11\uff12", "1.5", "-3"):  # Arabic-Indic, fullwidth
        body = json.dumps({**HI, "logit_bias": {key: 1.0}}).encode()
        status, error = refusal(port, TEXT, body)
        assert status == 400 and error["param"] == "logit_bias" and "ASCII" in error["message"]
    assert post(port, TEXT, json.dumps({**HI, "logit_bias": {"12": 1.0}}).encode())[0] == 200
    status, headers, raw = ask(port, "HEAD", "/health")
    assert status == 200 and raw == b"" and headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    "raw",
    [
        HEAD.encode() + b"Content-Length: abc\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n",
        bytes.fromhex("16030100a5010000a10303") + bytes(80),  # the start of a TLS hello
    ],
    ids=["content-length-abc", "two-hosts", "tls"],
)
def test_requests_http_cannot_parse_get_json_in_openais_shape(server, raw):
    sock = connect(server[0])
    try:
        sock.sendall(raw)
        _, answer = until_closed(sock)
    finally:
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_only_json_is_taken(server):
    port, body = server[0], json.dumps(HI).encode()
    for headers in ({"Content-Type": "text/plain"}, {}):  # what a web page may send unasked
        status, error = refusal(port, "/v1/completions", body, headers)
        assert status == 415 and "application/json" in error["message"]
    headers = {"Content-Type": "application/json; charset=utf-8"}
    assert ask(port, "POST", "/v1/completions", body, headers)[0] == 200


def test_the_host_header_must_name_this_server(server):
    port = server[0]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        status, _, raw = ask(port, "GET", "/v1/models", headers={"Host": host})
        assert status == 421 and json.loads(raw)["error"]["param"] == "Host"
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1", "API.example.test"):
        assert ask(port, "GET", "/v1/models", headers={"Host": host})[0] == 200


def test_cors_lets_in_only_the_allowed_origins(server):
    port = server[0]
    preflight = {"Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "content-type"
    status, headers, _ = ask(
        port,
        "OPTIONS",
        "/v1/completions",
        headers={**preflight, "Origin": "http://app.example.test"},
    )
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example.test"
    _, headers, _ = ask(port, "GET", "/v1/models", headers={"Origin": "http://app.example.test"})
    assert headers["access-control-allow-origin"] == "http://app.example.test"
    for method, headers in (("OPTIONS", preflight), ("GET", {})):
        _, answer, _ = ask(
            port, method, "/v1/models", headers={**headers, "Origin": "http://x.test"}
        )
        assert "access-control-allow-origin" not in answer
    refused = {**preflight, "Origin": "http://x.test"}
    status, _, raw = ask(port, "OPTIONS", "/v1/completions", headers=refused)
    assert status == 400 and "Disallowed CORS origin" in json.loads(raw)["error"]["message"]
    for path in ("/docs", "/redoc", "/openapi.json"):  # no --docs
        assert ask(port, "GET", path)[0] == 404


def test_docs_only_when_asked_and_no_cors_by_default(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    settings = GenerationSettings(max_tokens=4)
    with serving(Worker(model, tokenizer, draft, settings), Policy(docs=True)) as port:
        assert [ask(port, "GET", p)[0] for p in ("/docs", "/openapi.json")] == [200, 200]
    with serving(Worker(model, tokenizer, draft, settings)) as port:
        preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
        status, headers, _ = ask(port, "OPTIONS", "/v1/completions", headers=preflight)
        assert status == 405 and "access-control-allow-origin" not in headers
        assert ask(port, "GET", "/docs")[0] == 404


def test_idle_connections_neither_lock_clients_out_nor_stay_open(server):
    port = server[0]
    first = time.monotonic()
    idle = [connect(port) for _ in range(100)]
    try:
        quick_health(port, first)  # over --max-connections: the longest idle made room
        for sock in idle:  # and none is held past the request timeout
            assert until_closed(sock)[1] == b""
    finally:
        for sock in idle:
            sock.close()
    quick_health(port)


def test_slow_clients_are_dropped_without_a_traceback(server):
    port, log, _ = server
    first = time.monotonic()
    with connect(port) as short, connect(port) as dribbling:
        short.sendall(SHORT_BODY)
        dribbling.sendall(b"GET /health HTTP/1.1\r\nHo")  # a head that never ends
        quick_health(port, first)
        for sock in (short, dribbling):
            seconds, data = until_closed(sock)
            assert data == b"" and seconds < REQUEST_TIMEOUT_S + 5
    wait_for(lambda: CLIENT_GONE in log.read_text(), "the dropped client to be logged", 10)
    assert "Traceback" not in log.read_text()


def test_requests_in_flight_are_bounded_by_max_connections(server):
    port = server[0]
    busy = []
    try:
        # each busy before the next (idle ones make room); the one that reaches the limit,
        # with them, is the one refused (uvicorn's count)
        for _ in range(MAX_CONNECTIONS - 1):
            busy.append(connect(port))
            busy[-1].sendall(AWAITING_BODY)
            assert busy[-1].recv(100).startswith(b"HTTP/1.1 100 Continue")  # reading its body
        assert ask(port, "GET", "/health")[0] == 503  # until the request timeout drops them
        for sock in busy:
            until_closed(sock)
    finally:
        for sock in busy:
            sock.close()
    quick_health(port)


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


def abuse(port: int) -> None:
    """One of each bad request, /health quick after each, and 100 idle connections and a
    stalled request."""
    first = time.monotonic()
    stalled = connect(port)
    stalled.sendall(SHORT_BODY)
    idle = [connect(port) for _ in range(100)]
    quick_health(port, first)
    for sock in [stalled, *idle]:
        sock.close()
    chunked = {**JSON, "Transfer-Encoding": "chunked"}
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"tokenize": 1},
    }
    text = "/v1/completions"
    for status, path, body, headers in [
        (413, text, b"", {**JSON, "Content-Length": str(MAX_BODY_BYTES + 1)}),
        (413, text, huge_prompt_chunks(), chunked),
        (400, text, json.dumps({"prompt": TOO_LONG}).encode(), JSON),
        (400, text, b'{"prompt": "hi", "presence_penalty": NaN}', JSON),
        (400, text, b'{"prompt": "hi", "seed": -1}', JSON),
        (400, text, json.dumps({**HI, "stop": ["x"] * 17}).encode(), JSON),
        (400, "/v1/chat/completions", json.dumps(chat).encode(), JSON),
        (415, text, json.dumps(HI).encode(), {"Content-Type": "text/plain"}),
        (421, text, json.dumps(HI).encode(), {**JSON, "Host": "evil.example"}),
    ]:
        assert ask(port, "POST", path, body, headers)[0] == status
        quick_health(port)


@linux_only
def test_abuse_leaves_health_quick_and_memory_flat(server):
    port, _, process = server
    abuse(port)  # the first round allocates what later ones reuse
    before = rss_kib(process.pid)
    for _ in range(3):
        abuse(port)
    after = rss_kib(process.pid)
    assert abs(after - before) <= before / 10, (before, after)


@linux_only
def test_running_out_of_file_descriptors_is_logged_once_with_a_count(server):
    """asyncio logs a traceback per failed accept, ~2,000 a second while the limit holds."""
    port, log, process = server
    soft, hard = resource.prlimit(process.pid, resource.RLIMIT_NOFILE)
    waiting = []
    try:
        in_use = len(os.listdir(f"/proc/{process.pid}/fd"))
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (in_use + 2, hard))
        waiting = [connect(port) for _ in range(24)]
        out = "Too many open files"
        wait_for(lambda: out in log.read_text(), "the server to run out of descriptors", 10)
        time.sleep(1.5)  # asyncio retries the accepts after a second
    finally:
        resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (soft, hard))
        for sock in waiting:
            sock.close()
    text = log.read_text()
    assert 1 <= sum(out in line for line in text.splitlines()) < 10
    assert "Traceback" not in text
    wait_for(lambda: get(port, "/health")[0] == 200, "the server to take connections again", 10)
    quick_health(port)


def strict_json(text: str | bytes):
    """JSON as the spec has it: NaN and Infinity (Python's own extension) refused."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def events_of(raw: bytes) -> list:
    """A stream's events, each strict JSON, and the closing [DONE]."""
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [strict_json(e) for e in events[:-1]]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "name, value",
    [
        ("repetition_context_size", 2**31 + 5),  # MLX slices with 32-bit integers
        ("presence_context_size", 2**31 + 5),
        ("frequency_context_size", 2**40),
        ("temperature", 1e-300),  # 1 / temperature is infinite in float32
        ("temperature", 1e308),
        ("top_k", 2**40),
        ("presence_penalty", 1e308),
        ("frequency_penalty", -1e308),
        ("repetition_penalty", 1e308),
        ("repetition_penalty", 1e-300),
        ("logit_bias", {"1": 1e308}),
        ("logit_bias", {"1": -101}),
        ("logit_bias", {str(2**40): 1}),
        ("top_logprobs", 21),
        ("logprobs", 21),
        ("max_tokens", 10**12),
        ("max_tokens", 4097),  # the test models' context: 4096 tokens
        ("max_completion_tokens", 2**70),
        ("n", 2**70),
        ("seed", 2**70),
        ("stop", ["x"] * 1000),
    ],
)
def test_every_number_out_of_what_the_model_takes_gets_400_naming_it(server, name, value):
    body = json.dumps({**CHAT, name: value}).encode()
    status, error = refusal(server[0], "/v1/chat/completions", body)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert error["param"].startswith(name) and name in error["message"]


def test_a_request_failing_in_generation_fails_alone_as_the_server_s_error(loaded, monkeypatch):
    """A logits processor that fails from its third call on, inside a decoding cycle shared with
    normal requests: that request alone gets a 500 (JSON, a server error), the others
    their greedy replies."""
    import dflash_mlx.serve.worker as server_module

    make = server_module.make_logits_processors

    def failing_on_a_marker(**settings):
        processors = make(**settings)
        if settings.get("logit_bias") != {7: 0.5}:
            return processors
        calls = []

        def fail(tokens, logits):
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("a processor failed")
            return logits

        return [*processors, fail]

    monkeypatch.setattr(server_module, "make_logits_processors", failing_on_a_marker)
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=24))
    normal = {"prompt": PROMPTS[1], "max_tokens": 24}
    failing = {**normal, "logit_bias": {"7": 0.5}}
    bodies = [normal, failing, normal, {**failing, "stream": True}, normal]
    posted = [json.dumps(body).encode() for body in bodies]
    with serving(worker) as port, ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: ask(port, "POST", TEXT, body, JSON), posted))
    expected = greedy_text(loaded, PROMPTS[1], 24, chat=False)[0]
    for body, (status, _, raw) in zip(bodies, answers):
        if body is normal:
            assert status == 200 and strict_json(raw)["choices"][0]["text"] == expected
        elif body.get("stream"):
            error = events_of(raw)[-1]["error"]
            assert error["type"] == "server_error" and "a processor failed" in error["message"]
        else:
            error = strict_json(raw)["error"]
            assert status == 500 and error["type"] == "server_error"
            assert "a processor failed" in error["message"]


def test_logprobs_at_the_extremes_are_valid_json_streaming_or_not(server):
    port = server[0]
    logprobs = {"logprobs": True, "top_logprobs": 20}
    for bias, status in (({"1": 1e308}, 400), ({"57": 100, "58": -100, "120": 100}, 200)):
        body = {**CHAT, "max_tokens": 6, "logit_bias": bias, **logprobs}
        got, _, raw = ask(port, "POST", "/v1/chat/completions", json.dumps(body).encode(), JSON)
        assert got == status, raw
        answer = strict_json(raw)
        stream = json.dumps({**body, "stream": True}).encode()
        got, _, raw = ask(port, "POST", "/v1/chat/completions", stream, JSON)
        assert got == status
        if status == 200:
            entries = answer["choices"][0]["logprobs"]["content"]
            assert entries and all(len(e["top_logprobs"]) == 20 for e in entries)
            events = events_of(raw)
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_logprob_that_is_not_a_number_reads_as_openai_s_floor(loaded):
    _, tokenizer, _ = loaded("llama-tied-gqa")
    row = mx.array([[-math.inf, math.nan, -math.inf, 0.0, -math.inf]])  # token 3 certain
    fields = dict(accepted=0, proposed=0, prompt_tokens=1, prompt_tps=0.0, generation_tps=0.0)
    response = GenerationResponse("", [1], generation_tokens=1, peak_memory=0.0, **fields)
    response.logprobs = row
    [entry] = logprob_entries(tokenizer, response, 3)
    strict_json(json.dumps(entry))
    assert entry["logprob"] == NO_LOGPROB and entry["top_logprobs"][0] == {
        "id": 3,
        "token": tokenizer.convert_ids_to_tokens(3),
        "logprob": 0.0,
    }
    assert [t["logprob"] for t in entry["top_logprobs"][1:]] == [NO_LOGPROB, NO_LOGPROB]


def test_a_body_over_the_limit_is_answered_413_to_clients_still_sending(server):
    """12 MB, refused at 4 MiB: the server reads and drops the rest before closing, so
    clients that send the whole body before reading read the 413, not a reset."""
    port = server[0]
    body = json.dumps({"prompt": "a" * 12 * 10**6}).encode()
    url = f"http://127.0.0.1:{port}{TEXT}"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, body, JSON), timeout=60)
    assert refused.value.code == 413
    assert "--max-body-bytes" in strict_json(refused.value.read())["error"]["message"]
    status, _, raw = ask(port, "POST", TEXT, body, JSON)
    assert status == 413 and "--max-body-bytes" in strict_json(raw)["error"]["message"]
    quick_health(port)


def test_the_bearer_scheme_in_any_case_and_404_for_another_model(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=4))
    with serving(worker, Policy(api_key="K")) as port:
        for scheme in ("bearer", "BEARER", "Bearer"):
            headers = {**JSON, "Authorization": f"{scheme} K"}
            assert ask(port, "POST", TEXT, json.dumps(HI).encode(), headers)[0] == 200
        headers = {**JSON, "Authorization": "Basic K"}
        assert ask(port, "POST", TEXT, json.dumps(HI).encode(), headers)[0] == 401
        headers = {**JSON, "Authorization": "bearer K"}
        for body in ({**HI, "model": "gpt-4"}, {**CHAT, "model": "gpt-4"}):
            path = TEXT if "prompt" in body else "/v1/chat/completions"
            status, _, raw = ask(port, "POST", path, json.dumps(body).encode(), headers)
            error = strict_json(raw)["error"]
            assert status == 404 and error["code"] == "model_not_found"
            assert error["param"] == "model" and "gpt-4" in error["message"]
        status, _, raw = ask(port, "POST", TEXT, json.dumps({**HI, "model": "m"}).encode(), headers)
        assert status == 200 and strict_json(raw)["model"] == "m"  # the id /v1/models lists


def stream_request(port: int, body: dict) -> http.client.HTTPResponse:
    """An open streaming reply, its first event read (its generation has started)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", TEXT, json.dumps({**body, "stream": True}).encode(), JSON)
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    response.readline()
    return response


@linux_only
def test_sigterm_ends_every_stream_with_a_finish_reason_and_exits_within_5_s(make_pair, tmp_path):
    log = tmp_path / "server.log"
    port, process = start_server(*make_pair("llama-tied-gqa"), log)
    try:
        long = {"prompt": PROMPTS[0], "max_tokens": 3000}  # greedy: 2,524 tokens
        streams = [stream_request(port, long) for _ in range(8)]
        tic = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        seconds = time.monotonic() - tic
        for stream in streams:
            events = events_of(stream.read())
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert events[-1]["dflash"]["generation_tokens"] < 2524
    finally:
        process.kill()
    assert seconds < 5, (seconds, log.read_text()[-2000:])
    assert "Traceback" not in log.read_text()


ODD = [  # requests a burst mixes: refused, odd but served, cut off, normal
    {**CHAT, "repetition_context_size": 2**31 + 5, "repetition_penalty": 1.1},
    {**CHAT, "presence_penalty": 1e308},
    {**CHAT, "logit_bias": {"1": 1e308}, "logprobs": True, "top_logprobs": 5},
    {**CHAT, "max_tokens": 10**12},
    {**CHAT, "temperature": 1e-300, "top_k": 2**40},
    {**CHAT, "max_tokens": 8, "logit_bias": {"1": 100, "2": -100}, "logprobs": True},
    {**CHAT, "max_tokens": 8, "top_logprobs": 20, "stream": True},
    {**CHAT, "max_tokens": 8, "temperature": 100, "top_k": 2**31 - 1, "min_p": 1e-300},
    {**CHAT, "max_tokens": 8, "presence_penalty": -1000, "presence_context_size": 2**31 - 1},
    {**CHAT, "max_tokens": 8, "frequency_penalty": 1000, "repetition_penalty": 100},
]


def burst(port: int, rounds: int) -> list[int]:
    """`rounds` of every odd request, each beside three normal ones and a stream cut off
    after its first event; the statuses of the odd ones."""

    def normal(i: int) -> int:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12}
        return ask(port, "POST", TEXT, json.dumps(body).encode(), JSON)[0]

    def odd(body: dict) -> int:
        status, _, raw = ask(port, "POST", "/v1/chat/completions", json.dumps(body).encode(), JSON)
        if body.get("stream") and status == 200:
            events_of(raw)
        else:
            strict_json(raw)
        return status

    def cut_off(i: int) -> int:
        stream_request(port, {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 400}).close()
        return 200

    statuses = []
    with ThreadPoolExecutor(5) as pool:
        for i in range(rounds * len(ODD)):
            jobs = [pool.submit(odd, ODD[i % len(ODD)]), pool.submit(cut_off, i)]
            jobs += [pool.submit(normal, i + j) for j in range(3)]
            statuses.append(jobs[0].result(timeout=120))
            assert [job.result(timeout=120) for job in jobs[1:]] == [200] * 4
    return statuses


@linux_only
@pytest.mark.slow
def test_a_burst_of_odd_requests_beside_normal_ones_leaves_memory_flat(server):
    """Refused, odd and cut-off requests beside normal ones (250 in all): each odd one a 400
    or a 200, and the server's memory after the burst within 10 % of what it was after a
    round of the same."""
    port, _, process = server
    assert burst(port, 1) == [400] * 5 + [200] * 5  # warm-up: what later rounds reuse
    before = rss_kib(process.pid)
    assert burst(port, 4) == ([400] * 5 + [200] * 5) * 4
    after = rss_kib(process.pid)
    assert abs(after - before) <= before / 10, (before, after)


def test_unknown_paths_and_methods_answer_in_openai_s_shape(server):
    port = server[0]
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", TEXT, 405)):
        got, headers, raw = ask(port, method, path)
        error = strict_json(raw)["error"]
        assert got == status and error["type"] == "invalid_request_error" and error["message"]
    assert headers["allow"] == "POST"


def test_a_non_streaming_client_gone_stops_its_generation_within_a_cycle(loaded):
    """The client leaves while its reply is generating: its stop flag is set, and the
    generation ends at the cycle running then, far from its `max_tokens`."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings())
    generate, started = worker.generate, threading.Event()
    seen = []  # each response, and whether the generation was to stop by then

    def watched(job, stop):
        for response in generate(job, stop):
            seen.append((response, stop()))
            started.set()
            yield response

    worker.generate = watched
    with serving(worker) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": PROMPTS[0], "max_tokens": 3000}  # greedy: 2,524 tokens
        conn.request("POST", TEXT, json.dumps(body).encode(), JSON)
        assert started.wait(120)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        wait_for(lambda: worker.pending == 0, "the generation to stop", 120)
    assert [stopping for _, stopping in seen].count(True) <= 1  # the cycle running then
    assert seen[-1][0].finish_reason is None
    assert seen[-1][0].generation_tokens < 2524


def test_a_bug_is_answered_as_a_json_500(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    worker = Worker(model, tokenizer, draft, GenerationSettings(max_tokens=4))

    async def broken(render):
        raise RuntimeError("a bug")

    worker.prepare = broken
    with serving(worker) as port:
        status, _, raw = ask(port, "POST", TEXT, json.dumps(HI).encode(), JSON)
    error = strict_json(raw)["error"]
    assert status == 500 and error["type"] == "server_error" and "a bug" in error["message"]
