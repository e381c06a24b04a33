"""The target sharded over 2 local processes (MLX's ring backend on 127.0.0.1), as under
`mlx.launch` on several Macs: the same reply as one process, printed once; the same random
draws on every rank; a rank that dies ends the others with an error, never a hang."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import pytest
from distributed_rank import MAX_TOKENS, QWEN3_5_UNTIED
from helpers import reference_greedy, set_eos
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


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-untied-mha"])
def test_mlx_launch_generate_prints_the_single_process_reply_once(make_pair, loaded, name):
    target, draft = make_pair(name)
    model, tokenizer, drafter = loaded(name)
    prompt = "How many apples?"
    text = chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    expected = dflash_mlx.generate(model, drafter, tokenizer, text, max_tokens=20, block_size=4)
    assert len(expected) > 5
    port = free_ports(1)[0]
    command = ["mlx.launch", "-n", str(RANKS), "--backend", "ring", "-p", str(port), "--"]
    command += [sys.executable, "-m", "dflash_mlx", "generate", "--model", str(target)]
    command += ["--draft", str(draft), "-p", prompt, "-m", "20", "--block-size", "4"]
    proc = subprocess.Popen(  # stdin kept open: mlx.launch forwards it to every rank
        command,
        env=env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mlx.launch still running after {TIMEOUT} s (a hang)")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert out == expected + "\n", err
    assert err.count("tok/s") == 1, err  # the stats line, from rank 0 only


def test_seeded_sampling_draws_the_same_tokens_on_every_rank(make_pair, loaded, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    command = [sys.executable, str(RANK_SCRIPT), "sample", str(target), str(draft)]
    with ranks(command, tmp_path) as procs:
        results = outputs(procs)
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    replies = [json.loads(out) for _, out, _ in results]
    assert [r["rank"] for r in replies] == list(range(RANKS))
    assert len({r["seed"] for r in replies}) == 1, "every rank must use rank 0's seed"
    assert all(r["tokens"] == replies[0]["tokens"] for r in replies)
    model, tokenizer, drafter = loaded("llama-tied-gqa")
    mx.random.seed(replies[0]["seed"])  # one process with that seed draws the same tokens
    kwargs = dict(max_tokens=MAX_TOKENS, block_size=4, temperature=1.0)
    responses = stream_generate(model, drafter, tokenizer, PROMPT, **kwargs)
    assert [t for r in responses for t in r.tokens] == replies[0]["tokens"]


def test_qwen3_5_with_a_vocabulary_sharded_head_equals_mlx_lm_greedy(make_pair, tmp_path):
    target, _ = make_pair("llama-tied-gqa")  # for its tokenizer
    expected = reference_greedy(build("qwen3_5", fields=QWEN3_5_UNTIED), PROMPT, MAX_TOKENS, set())
    with ranks([sys.executable, str(RANK_SCRIPT), "qwen3_5", str(target)], tmp_path) as p:
        results = outputs(p)
    assert all(rc == 0 for rc, _, _ in results), [err for _, _, err in results]
    for _, out, _ in results:
        assert json.loads(out)["tokens"] == expected


def test_a_killed_rank_ends_the_others_with_an_error(make_pair, tmp_path):
    source, draft = make_pair("qwen3-untied-mha")
    target = shutil.copytree(source, tmp_path / "no-eos")
    set_eos(target, 10**6)  # never generated: the reply runs until the kill
    command = [sys.executable, "-m", "dflash_mlx", "generate", "--model", str(target)]
    command += ["--draft", str(draft), "-p", "hello", "-m", "4000", "--block-size", "4"]
    with ranks(command, tmp_path) as procs:
        first = []  # rank 0 writes its reply as it goes: wait for it, so both ranks are decoding
        reader = threading.Thread(target=lambda: first.append(procs[0].stdout.read(1)))
        reader.start()
        reader.join(TIMEOUT)
        assert first and first[0], "rank 0 wrote nothing"
        os.killpg(procs[1].pid, signal.SIGKILL)
        try:
            procs[0].wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still running {TIMEOUT} s after rank 1 was killed (a hang)")
        err = procs[0].stderr.read()
    assert procs[0].returncode == 1, err
    assert err.strip().splitlines()[-1].startswith("dflash-mlx generate: error: rank 0: [ring]")


@pytest.mark.parametrize("command", ["chat", "serve", "bench"])
def test_subcommands_without_lockstep_refuse_on_every_rank(make_pair, tmp_path, command):
    target, draft = make_pair("llama-tied-gqa")
    argv = [sys.executable, "-m", "dflash_mlx", command, "--model", str(target)]
    with ranks([*argv, "--draft", str(draft)], tmp_path) as procs:
        results = outputs(procs)
    for rc, _, err in results:
        assert rc == 1
        assert err.strip() == (
            f"dflash-mlx {command}: error: '{command}' does not run under mlx.launch yet; use "
            "'dflash-mlx generate' for a target sharded over several machines"
        )
