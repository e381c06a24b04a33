"""The target sharded over 2 local processes (MLX's ring backend on 127.0.0.1), as under
`mlx.launch` on several Macs: the same reply as one process, printed once, from generate,
chat, serve and bench; the same random draws on every rank; a rank that dies or hangs ends
the others with an error, never a hang."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from distributed_rank import MAX_TOKENS, QWEN3_5_UNTIED, SAMPLED, tapped_features
from helpers import chat_ids, parse_mlx_lm_verbose, reference_greedy, set_eos
from openai import APIConnectionError, InternalServerError, OpenAI
from test_families import PROMPT, build

import dflash_mlx
from dflash_mlx import stream_generate
from dflash_mlx.chat_format import chat_prompt

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
RANK_SCRIPT = Path(__file__).parent / "distributed_rank.py"
TIMEOUT = 420  # seconds for a whole 2-rank run: the ring backend is slow on a loaded 2-core box
RANKS = 2


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@contextmanager
def ranks(command: list[str], tmp_path: Path):
    """RANKS processes of `command` in one ring on 127.0.0.1, as `mlx.launch` starts them;
    killed (with anything they started) on the way out."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(RANKS)]))
    procs = [
        subprocess.Popen(
            command,
            env={**env(), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(RANKS)
    ]
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def outputs(procs) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) per rank, or a failure if any runs past TIMEOUT."""
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {procs.index(p)} still running after {TIMEOUT} s (a hang)")
        results.append((p.returncode, out, err))
    return results


def launcher() -> str:
    """The `mlx.launch` of the interpreter running the tests: a virtual environment's python
    run by its path, the environment not activated, has the script beside it, not on PATH
    (and mlx has no `python -m` form of it)."""
    beside = Path(sys.executable).with_name("mlx.launch")
    return str(beside) if beside.is_file() else "mlx.launch"


def launch(
    argv: list[str], stdin: str = "", cwd: Path | None = None, n: int = RANKS
) -> tuple[int, str, str]:
    """`mlx.launch -n N --backend ring -- python -m dflash_mlx ARGV`: (status, stdout,
    stderr). stdin is written and left open: mlx.launch forwards input, never its end."""
    port = free_ports(1)[0]
    command = [launcher(), "-n", str(n), "--backend", "ring", "-p", str(port), "--"]
    proc = subprocess.Popen(
        [*command, sys.executable, "-m", "dflash_mlx", *argv],
        env=env(),
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        proc.stdin.write(stdin)
        proc.stdin.flush()
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mlx.launch still running after {TIMEOUT} s (a hang)")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def one_process_reply(models: tuple, prompt: str | list[int], max_tokens: int) -> str:
    """The greedy reply of one process to a raw prompt or token ids, with the block size
    every launched run here uses."""
    model, tokenizer, drafter = models
    return dflash_mlx.generate(
        model, drafter, tokenizer, prompt, max_tokens=max_tokens, block_size=4
    )


def model_flags(pair: tuple[Path, Path], max_tokens: int) -> list[str]:
    target, draft = pair
    return ["--model", str(target), "--draft", str(draft), "-m", str(max_tokens)]


def test_mlx_launch_generate_prints_the_single_process_reply_once(make_pair, loaded, monkeypatch):
    """Over 4 ranks (4 KV heads), with the launcher found beside the interpreter while the
    environment is off PATH."""
    monkeypatch.setenv("PATH", os.defpath)
    tokenizer = loaded("llama-untied-mha")[1]
    prompt = "How many apples?"
    ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    expected = one_process_reply(loaded("llama-untied-mha"), ids, 8)  # 4 ranks share 2 cores
    assert len(expected) > 5
    argv = ["generate", *model_flags(make_pair("llama-untied-mha"), 8), "-p", prompt]
    status, out, err = launch([*argv, "--block-size", "4"], n=4)
    assert status == 0, err
    assert parse_mlx_lm_verbose(out)["reply"] == expected, err  # the stats from rank 0 only
    assert err.count("loading ") == 1, err  # (a slow prefill's bar may come too)


def test_mlx_launch_adapts_block_sizes_alike_on_every_rank(make_pair, loaded):
    """Without --block-size every rank chooses each cycle's size from the acceptance and the
    fixed cost table: the sizes change (the random drafter is never accepted), the ranks stay
    in step, and the reply is the one process's greedy reply, printed once. A qwen3 target:
    llama-tied-gqa is sharded over 2 ranks by the next tests (chat, bench, serve)."""
    model, tokenizer, drafter = loaded("qwen3-untied-mha")
    ids = chat_ids(tokenizer, [{"role": "user", "content": "How many apples?"}])
    expected = dflash_mlx.generate(model, drafter, tokenizer, ids, max_tokens=30, block_size=1)
    argv = ["generate", *model_flags(make_pair("qwen3-untied-mha"), 30), "-p", "How many apples?"]
    status, out, err = launch([*argv, "--json"])
    assert status == 0, err
    result = json.loads(out)
    assert result["text"] == expected
    assert 0 < result["proposed"] < 15 * result["cycles"]  # drafted, but not the full block
    assert err.count("loading ") == 1, err


def test_mlx_launch_chat_replies_as_one_process_with_the_prompt_cache(make_pair, loaded):
    tokenizer = loaded("llama-tied-gqa")[1]
    questions, messages, expected = ["How many apples?", "And pears?"], [], []
    for question in questions:  # one process, each turn prefilled whole
        messages.append({"role": "user", "content": question})
        ids = chat_ids(tokenizer, messages)
        expected.append(one_process_reply(loaded("llama-tied-gqa"), ids, 12))
        messages.append({"role": "assistant", "content": expected[-1]})
    argv = ["chat", *model_flags(make_pair("llama-tied-gqa"), 12), "--block-size", "4"]
    status, out, err = launch(argv, stdin="\n".join([*questions, "/stats", "/quit", ""]))
    assert status == 0, err
    assert out.startswith("dflash-mlx chat: /help for commands, /quit to exit\n>> "), out
    for reply in expected:  # as the pipe's text reads it: a "\r" ends a line
        shown = reply.replace("\r\n", "\n").replace("\r", "\n")
        assert out.count(f">> {shown}\n[") == 1, (reply, out)  # printed once, by rank 0
    new = [int(n) for n in re.findall(r"\((\d+) new\)\]", out)]
    assert len(new) == 2 and new[1] < len(chat_ids(tokenizer, messages))
    assert "[2 turns, 4 messages" in out


def test_mlx_launch_bench_runs_in_lockstep_and_rank_0_alone_reports(make_pair, loaded, tmp_path):
    tokenizer = loaded("llama-tied-gqa")[1]
    prompt = "How many apples?"
    ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    expected = one_process_reply(loaded("llama-tied-gqa"), ids, 8)
    (tmp_path / "prompts.json").write_text(json.dumps([prompt]))  # read by rank 0 alone
    argv = ["bench", *model_flags(make_pair("llama-tied-gqa"), 8), "--block-size", "4"]
    argv[argv.index("-m")] = "--max-tokens"
    argv += ["--prompts", "prompts.json", "--out", "bench.json"]
    status, out, err = launch(argv, cwd=tmp_path)
    assert status == 0, err
    assert (tmp_path / "bench.json").is_file(), f"no bench.json; stdout:\n{out}\nstderr:\n{err}"
    results = json.loads((tmp_path / "bench.json").read_text())
    assert results["prompts"][0]["dflash_text"] == expected
    assert results["overall"]["identical"] == 1  # mlx-lm's decoding of the sharded target
    assert out.count("Per prompt") == 1 and err.count("wrote bench.json") == 1, err


def openai_client(port: int) -> OpenAI:
    return OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
    )


def when_up(call, procs):
    """`call()`, once rank 0's server answers: it opens its port when every rank has loaded."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return call()
        except APIConnectionError:
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise
            time.sleep(1)


def test_serve_under_the_launcher_answers_the_openai_client_and_ends_cleanly(
    make_pair, loaded, tmp_path
):
    tokenizer = loaded("llama-tied-gqa")[1]
    messages = [{"role": "user", "content": "How many apples?"}]
    expected = one_process_reply(loaded("llama-tied-gqa"), chat_ids(tokenizer, messages), 12)
    text = chat_prompt(tokenizer, messages)  # sent as a text completion: encoded with the BOS
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "dflash_mlx", "serve", "--block-size", "4", "--port", str(port)]
    with ranks([*argv, *model_flags(make_pair("llama-tied-gqa"), 12)], tmp_path) as procs:
        client = openai_client(port)
        reply = when_up(
            lambda: client.chat.completions.create(model="llama-tied-gqa", messages=messages), procs
        )
        again = client.completions.create(
            model="llama-tied-gqa", prompt=text, max_tokens=5, stop=["zzz"]
        )
        procs[0].send_signal(signal.SIGTERM)  # shut the server down: the other rank is released
        results = outputs(procs)
    assert reply.choices[0].message.content == expected
    assert again.choices[0].text == one_process_reply(loaded("llama-tied-gqa"), text, 5)
    statuses = [rc for rc, _, _ in results]  # uvicorn ends on the signal it was sent, as alone
    assert statuses == [-signal.SIGTERM, 0], [err for _, _, err in results]
    assert "Finished server process" in results[0][2]
    assert results[1][1] == "" and "Uvicorn running" not in results[1][2]


def test_serve_ends_with_an_error_when_a_rank_died_between_requests(make_pair, tmp_path):
    port = free_ports(1)[0]
    argv = [sys.executable, "-m", "dflash_mlx", "serve", "--port", str(port)]
    with ranks([*argv, *model_flags(make_pair("llama-tied-gqa"), 4)], tmp_path) as procs:
        client = openai_client(port)
        when_up(client.models.list, procs)
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        with pytest.raises((APIConnectionError, InternalServerError)):  # 500, or the server gone
            client.completions.create(model="llama-tied-gqa", prompt="hello")
        rc, _, err = outputs(procs[:1])[0]
    assert rc == 1, err
    assert err.strip().splitlines()[-1].startswith("dflash-mlx serve: error: rank 0: [ring]")


@pytest.fixture(scope="module")
def rank_replies(make_pair, tmp_path_factory) -> list[dict]:
    """Each rank's JSON line from one run of distributed_rank.py (sampling, then qwen3_5
    tensor and pipeline parallel), in rank order."""
    target, draft = make_pair("llama-tied-gqa")  # the target to sample, and its tokenizer
    command = [sys.executable, str(RANK_SCRIPT), str(target), str(draft)]
    with ranks(command, tmp_path_factory.mktemp("ranks")) as procs:
        results = outputs(procs)
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    replies = [json.loads(out) for _, out, _ in results]
    assert [r["rank"] for r in replies] == list(range(RANKS))
    return replies


def test_seeded_sampling_draws_the_same_tokens_on_every_rank(rank_replies, loaded):
    sampled = [r["sample"] for r in rank_replies]
    assert len({s["seed"] for s in sampled}) == 1, "every rank must use rank 0's seed"
    assert all(s["tokens"] == sampled[0]["tokens"] for s in sampled)
    model, tokenizer, drafter = loaded("llama-tied-gqa")
    mx.random.seed(sampled[0]["seed"])  # one process with that seed draws the same tokens
    responses = stream_generate(model, drafter, tokenizer, PROMPT, max_tokens=MAX_TOKENS, **SAMPLED)
    assert [t for r in responses for t in r.tokens] == sampled[0]["tokens"]


@pytest.mark.parametrize("mode", ["qwen3_5", "pipeline"])
def test_qwen3_5_tensor_or_pipeline_parallel_equals_mlx_lm_greedy(rank_replies, mode):
    """Tensor parallel with a vocabulary-sharded head; pipeline parallel with the drafter's
    tapped layers (and recurrent caches to roll back) on different ranks."""
    model = build("qwen3_5", fields=QWEN3_5_UNTIED)
    expected = reference_greedy(model, PROMPT, MAX_TOKENS, set())
    for reply in rank_replies:
        assert reply[mode]["tokens"] == expected
        if mode == "pipeline":  # the drafter's input, gathered from both ranks, is one process's
            assert reply[mode]["features"] == pytest.approx(tapped_features(model), rel=1e-4)


HUNG = "no progress for 10 s: a peer stopped responding (--rank-timeout)"


@pytest.mark.parametrize(
    "how, error",
    [(signal.SIGKILL, "[ring] connection to a peer was lost"), (signal.SIGSTOP, HUNG)],
    ids=["killed", "hung"],  # hung: alive, its sockets open, never answering
)
def test_a_killed_or_hung_rank_ends_the_others_with_an_error(make_pair, tmp_path, how, error):
    source, draft = make_pair("qwen3-untied-mha")
    target = shutil.copytree(source, tmp_path / "no-eos")
    set_eos(target, 10**6)  # never generated: the reply runs until the kill
    command = [sys.executable, "-m", "dflash_mlx", "generate", "--model", str(target)]
    command += ["--draft", str(draft), "-p", "hello", "-m", "4000", "--block-size", "4"]
    with ranks([*command, "--rank-timeout", "10"], tmp_path) as procs:
        first = []  # rank 0 writes its reply as it goes: wait for it, so both ranks are decoding
        reader = threading.Thread(target=lambda: first.append(procs[0].stdout.read(1)))
        reader.start()
        reader.join(TIMEOUT)
        assert first and first[0], "rank 0 wrote nothing"
        os.killpg(procs[1].pid, how)
        hit = time.monotonic()
        try:
            procs[0].wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running {TIMEOUT} s after rank 1 was hit (a hang)")
        waited = time.monotonic() - hit
        err = procs[0].stderr.read()
    assert procs[0].returncode == 1, err
    last = err.strip().splitlines()[-1]
    # A killed peer is noticed by the ring, or by the watchdog when rank 0 meets no collective
    # first (a loaded machine); either way rank 0 ends with an error naming the peer.
    allowed = (error,) if how == signal.SIGSTOP else (error, HUNG)
    assert any(last.startswith(f"dflash-mlx generate: error: rank 0: {e}") for e in allowed), last
    if how == signal.SIGSTOP:
        assert waited >= 10  # the watchdog's timeout, not a lost connection


@pytest.mark.parametrize(
    "argv, error",
    [
        (
            ["convert", "in", "--out", "out"],
            "'convert' does not run under mlx.launch; generate, chat, serve and bench do",
        ),
        (
            ["generate", "--pipeline", "-p", "hi", "--no-draft", "--model", "TARGET"],
            "mlx-lm has no pipeline parallelism for model type 'llama'; shard it tensor "
            "parallel instead (without --pipeline)",
        ),
        (
            ["bench", "--prompts", "missing.json", "--model", "TARGET"],
            "[Errno 2] No such file or directory: 'missing.json'",  # rank 0's, on every rank
        ),
    ],
    ids=["convert", "pipeline-llama", "bench-prompts"],
)
def test_what_cannot_run_sharded_is_refused_on_every_rank(make_pair, tmp_path, argv, error):
    target = str(make_pair("llama-tied-gqa")[0])
    command = [sys.executable, "-m", "dflash_mlx", *(target if a == "TARGET" else a for a in argv)]
    with ranks(command, tmp_path) as procs:
        results = outputs(procs)
    for rc, _, err in results:
        assert rc == 1 and "Traceback" not in err
        # after at most the line that says what it loads
        assert err.strip().splitlines()[-1] == f"dflash-mlx {argv[0]}: error: {error}"
