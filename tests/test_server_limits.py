"""`dflash-mlx serve` against clients that send too much, too slowly, from the wrong place or
with values no sampler should see: each is refused before it costs anything, while
`/health` stays quick and the server's memory flat. A live server on 127.0.0.1."""

import http.client
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

import pytest
from test_server import JSON, get, post, running_server, serving, wait_for

from dflash_mlx import GenerationSettings
from dflash_mlx.server import CLIENT_GONE, PROMPT_CHARS_PER_TOKEN, Policy, Worker

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
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
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
