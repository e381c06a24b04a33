"""`dflash-mlx generate`, `chat` and `info` as a user runs them: subprocesses and a pty where
the process is what is checked (its streams, stdin, a terminal, imports), `cli.main` in this
process where what a command computes is."""

import argparse
import io
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import mlx.core as mx
import pexpect
import pytest
from helpers import chat_ids, copy_dir, mlx_lm_greedy, parse_mlx_lm_verbose, save_target
from test_generate import oracle_for

from dflash_mlx import GenerationSettings, cli, options
from dflash_mlx.chat_format import plain_chat
from dflash_mlx.cli.chat import Chat

TIMEOUT = 90
STATS = r"\[(interrupted; )?(\d+) tokens, [^\]]*prompt (\d+) tokens \((\d+) new\)\]"


def greedy_text(
    loaded,
    prompt: str,
    max_tokens: int,
    chat: bool = True,
    name: str = "llama-tied-gqa",
    **settings,
) -> tuple[str, int]:
    """Text and token count of mlx-lm's own greedy decode of `prompt` (a user message, or
    the raw text), as streamed text; `settings` for `make_logits_processors`."""
    model, tokenizer, _ = loaded(name)
    ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
    return decode_greedy(model, tokenizer, ids, max_tokens, **settings)


def decode_greedy(
    model, tokenizer, prompt: str | list[int], max_tokens: int, **settings
) -> tuple[str, int]:
    """`greedy_text` of a raw prompt (encoded with the tokenizer's special tokens, as
    mlx_lm.generate encodes a prompt without the chat template) or of token ids."""
    eos = set(tokenizer.eos_token_ids)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    tokens, _ = mlx_lm_greedy(model, ids, max_tokens, eos, **settings)
    return detokenized(tokenizer, tokens), len(tokens)


def detokenized(tokenizer, tokens: list[int]) -> str:
    """The text of `tokens` but its EOS tokens, as generate streams it."""
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in tokens:
        if t not in eos:
            detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def dflash(command: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash_mlx", *shlex.split(command)]
    return subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT, env=env
    )


def dflash_in_process(command: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`dflash(command, stdin)` run in this process (`cli.main`), for checks of what a command
    computes: a child process would add seconds of imports and check nothing more."""
    out, err = io.StringIO(), io.StringIO()
    stdin_bytes = io.TextIOWrapper(io.BytesIO(stdin.encode()))  # a pipe's: text over bytes
    with mock.patch.object(sys, "stdin", stdin_bytes), redirect_stdout(out):
        with redirect_stderr(err):
            try:
                cli.main(shlex.split(command))
                status = 0
            except SystemExit as exit_info:
                status = exit_info.code or 0
    return subprocess.CompletedProcess(command, status, out.getvalue(), err.getvalue())


def test_generate_json_from_stdin_equals_greedy(make_pair, loaded):
    target, draft = make_pair("llama-tied-gqa")
    out = dflash(f"generate --model {target} --draft {draft} --json -m 16", "How many apples?")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    text, n = greedy_text(loaded, "How many apples?", 16)
    assert result["text"] == text and result["generation_tokens"] == n
    assert result["proposed"] > 0 and result["tau"] >= 1 and result["ttft"] > 0


def test_generate_no_draft_plain_prompt_streams_text_then_says_drafting_was_off(make_pair, loaded):
    target, _ = make_pair("llama-tied-gqa")
    out = dflash(f"generate --model {target} --no-draft --no-chat-template -p 'Alice has' -m 12")
    assert out.returncode == 0, out.stderr
    text, n = greedy_text(loaded, "Alice has", 12, chat=False)
    ours = parse_mlx_lm_verbose(out.stdout)
    assert ours["reply"] == text and ours["generation_tokens"] == n
    assert ours["rest"].startswith(f"Speculation: 1.00 tokens per verify cycle over {n - 1} ")
    assert f"0 of {n} tokens from accepted drafts" in ours["rest"]
    assert f"(plain {n - 1}; off since cycle 1: no drafter)" in ours["rest"]


def test_generate_penalties_logit_bias_and_template_config_equal_mlx_lm(make_pair, loaded, capsys):
    target, draft = make_pair("llama-tools")
    flags = """--repetition-penalty 1.3 --frequency-penalty 0.4 --logit-bias '{"57": 6}'"""
    flags += """ --chat-template-config '{"style": "terse"}'"""
    command = f"generate --model {target} --draft {draft} --json -m 16 {flags}"
    out = dflash_in_process(command, "Alice has")
    assert out.returncode == 0, out.stderr
    model, tokenizer, _ = loaded("llama-tools")
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Alice has"}], style="terse")
    settings = dict(repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={57: 6.0})
    expected, n = decode_greedy(model, tokenizer, ids, 16, **settings)
    assert expected != decode_greedy(model, tokenizer, ids, 16)[0]
    assert json.loads(out.stdout)["text"] == expected
    with pytest.raises(SystemExit) as bad:  # a usage error, before anything loads
        cli.main(shlex.split(f"generate --model {target} --draft {draft} --logit-bias 5 -p x"))
    assert bad.value.code == 2 and "--logit-bias" in capsys.readouterr().err


def test_chat_template_config_reaches_every_turn(loaded, capsys):
    model, tokenizer, draft = loaded("llama-tools")
    chat = Chat(
        model, tokenizer, draft, GenerationSettings(max_tokens=4), None, True, {"style": "terse"}
    )
    chat.ask("How many apples?")
    ids = chat_ids(tokenizer, chat.messages[:1], style="terse")
    assert "(terse)" in tokenizer.decode(ids)
    assert chat.cache.tokens[: len(ids)] == ids


def test_a_prefill_that_takes_time_draws_its_progress_and_a_quick_one_does_not(
    make_pair, monkeypatch, capsys
):
    """The bar shows once the prefill has taken `PROGRESS_DELAY_S` (0 here: always; a long
    delay: never), counting the prompt's tokens; `--verbose False` draws none."""
    target, draft = make_pair("llama-tied-gqa")
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
    argv = ["generate", "--model", str(target), "--draft", str(draft), "-p", prompt, "-m", "2"]
    argv += ["--ignore-chat-template", "--prefill-step-size", "16"]
    monkeypatch.setattr(options, "PROGRESS_DELAY_S", 0.0)
    cli.main(argv)
    err = capsys.readouterr().err
    assert re.search(r"prefill: +0%.*\| 0/\d+ ", err), err
    assert err.startswith(f"loading {target} and the drafter {draft}...\n")
    cli.main([*argv, "--verbose", "False"])
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(options, "PROGRESS_DELAY_S", 3600.0)
    cli.main(argv)
    assert "prefill" not in capsys.readouterr().err


def test_no_draft_sampling_follows_the_seed(make_pair):
    target, _ = make_pair("llama-tied-gqa")
    run = "generate --model {} --no-draft --no-chat-template -p Alice -m 24 --temp 2 --seed {}"
    run += " --verbose False"  # the reply alone: the stats hold timings
    outs = [dflash_in_process(run.format(target, seed)) for seed in (1, 1, 2)]
    assert all(out.returncode == 0 for out in outs), outs[-1].stderr
    assert outs[0].stdout == outs[1].stdout != outs[2].stdout


def test_no_draft_loads_no_drafter(make_pair):
    from dflash_mlx.options import add_model_arguments, load_models

    target, _ = make_pair("llama-tied-gqa")
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert load_models(parser.parse_args(["--model", str(target), "--no-draft"]))[2] is None


EACH_COMMAND = """
import contextlib, io, json, sys
from dflash_mlx import cli
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
            status = 0
        except SystemExit as exit_info:
            status = exit_info.code or 0
    print(json.dumps([status, out.getvalue(), err.getvalue()]))
"""


def test_every_command_but_serve_runs_without_the_web_stack(make_pair, loaded, tmp_path):
    for package in ("fastapi", "uvicorn", "pydantic", "starlette"):  # shadowed: not installed
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            f'raise ModuleNotFoundError("No module named {package!r}", name={package!r})'
        )
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    target, _ = make_pair("llama-tied-gqa")
    commands = [
        "train --help",
        "info",
        f"generate --model {target} --no-draft --no-chat-template -p 'Alice has' -m 12 --verbose F",
        f"serve --model {target} --no-draft",
    ]
    # one child runs them all: a shadowed package fails every import of it, not just the first
    child = [sys.executable, "-c", EACH_COMMAND, json.dumps([shlex.split(c) for c in commands])]
    done = subprocess.run(child, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr
    train_help, info, out, serve = (
        subprocess.CompletedProcess(command, *json.loads(line))
        for command, line in zip(commands, done.stdout.splitlines(), strict=True)
    )

    assert "usage: dflash-mlx train" in train_help.stdout
    assert info.returncode == 0 and "block-attention kernels" in info.stdout, info.stderr
    assert out.returncode == 0, out.stderr
    assert out.stdout == greedy_text(loaded, "Alice has", 12, chat=False)[0] + "\n"
    assert serve.returncode == 1
    assert serve.stderr == (
        "dflash-mlx serve: error: serving needs uvicorn, which is not installed: "
        "pip install fastapi uvicorn\n"
    )


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line_before_loading(make_pair):
    """From stdin or the command line (a Latin-1 file, say), for generate and cache-prompt."""
    target, draft = make_pair("llama-tied-gqa")
    latin1 = "Café: how much?".encode("latin-1")
    models = ["--model", str(target), "--draft", str(draft)]
    runs = {
        "the prompt on stdin": (["generate", *models], latin1),
        "--prompt": (["generate", *models, "-p", latin1], b""),
        "the prompt on stdin ": (["cache-prompt", *models, "--prompt-cache-file", "x"], latin1),
    }
    for source, (argv, stdin) in runs.items():
        cmd = [sys.executable, "-m", "dflash_mlx", *argv]
        out = subprocess.run(cmd, input=stdin, capture_output=True, timeout=TIMEOUT)
        assert out.returncode == 1 and out.stdout == b""
        assert out.stderr.decode() == (
            f"dflash-mlx {argv[0]}: error: {source.strip()} is not UTF-8 text (byte 0xe9 at "
            "offset 3): convert it first, e.g. iconv -f latin1 -t utf-8\n"
        )  # no loading line: nothing was loaded


def test_a_model_as_the_drafter_or_a_drafter_for_another_model_is_one_line(make_pair, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    wider = save_target(tmp_path / "wider", hidden=128, layers=4, seed=2)
    errors = {}
    for name, models in (("model", (target, target)), ("other", (wider, draft))):
        out = dflash_in_process(f"generate --model {models[0]} --draft {models[1]} -p hi -m 2")
        assert out.returncode == 1
        assert out.stderr.count("\n") == 2 and out.stderr.startswith("loading "), out.stderr
        errors[name] = out.stderr.splitlines()[-1]
    assert errors["model"].startswith(
        f"dflash-mlx generate: error: {target} is a model, not a DFlash drafter: "
    )
    assert errors["other"] == (
        "dflash-mlx generate: error: the drafter was made for another model: hidden size 64 "
        "(the target's: 128); 6 layers (the target's: 4)"
    )


def test_unreachable_hub_model_is_a_clear_error(make_pair):
    _, draft = make_pair("llama-tied-gqa")
    command = f"generate --model no-such-org/no-such-model --draft {draft} -p x"
    out = dflash_in_process(command)
    assert out.returncode == 1
    assert "target model 'no-such-org/no-such-model' is not in the local hub cache" in out.stderr
    assert "If this machine is offline" in out.stderr and "Traceback" not in out.stderr


def test_draft_is_required_unless_no_draft_and_info_runs(make_pair, capsys):
    target, _ = make_pair("llama-tied-gqa")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", str(target), "-p", "x"])
    assert exit_info.value.code == 1
    assert "--draft-model is required (or pass --no-draft" in capsys.readouterr().err
    cli.main(["info"])
    out = capsys.readouterr().out
    for key in ("mlx ", "device", "metal available", "BLAS", "block-attention kernels", "cache"):
        assert key in out
    if mx.default_device() == mx.cpu:
        assert re.search(r"verify forward +cpu_math exps, compiled norms and RoPE", out)
    device = mx.default_device().type.name
    assert f"{device}: {mx.device_info()['device_name']}" in out
    rows = dict(re.split(r"  +", line, maxsplit=1) for line in out.splitlines())
    assert rows["package"] == os.path.dirname(options.__file__)  # the files that run
    pip = [sys.executable, "-m", "pip", "show", "dflash-mlx"]
    shown = subprocess.run(pip, capture_output=True, text=True, timeout=TIMEOUT).stdout
    fields = dict(line.split(": ", 1) for line in shown.splitlines() if ": " in line)
    assert rows["distribution"].startswith(f"dflash-mlx {fields['Version']}, ")
    if "Editable project location" in fields:  # as the README's install makes it
        assert rows["distribution"].endswith(f"editable from {fields['Editable project location']}")


@pytest.mark.cuda
def test_info_names_the_cuda_gpu_and_the_reference_kernels(capsys):
    cli.main(["info"])
    out = capsys.readouterr().out
    assert f"gpu: {mx.device_info()['device_name']} (CUDA)" in out
    assert re.search(r"cuda available +True", out)
    assert re.search(r"block-attention kernels +reference", out)
    assert re.search(r"verify forward +CUDA verify-attention and few-rows product kernels", out)
    assert re.search(r"models load in +the checkpoint's dtype", out)


def test_plain_role_format_is_mlx_lm_servers():
    from mlx_lm.server import convert_chat

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many apples?"},
        {"role": "assistant", "content": "Eight."},
        {"role": "user", "content": "And pears?"},
    ]
    assert plain_chat(messages) == convert_chat(messages)
    assert plain_chat(messages[1:2]) == "USER: How many apples?\nASSISTANT:"


def test_chat_without_a_chat_template_answers_in_plain_role_format(no_template_pair, loaded):
    target, draft = no_template_pair
    turns = "How many apples?\nAlice has 3 apples\n"
    out = dflash(f"chat --model {target} --draft {draft} -m 8", turns)
    assert out.returncode == 0, out.stderr
    text, n = greedy_text(
        loaded, plain_chat([{"role": "user", "content": "How many apples?"}]), 8, chat=False
    )
    assert f">> {text}\n[{n} tokens" in out.stdout
    assert out.stdout.count(" tokens, ") == 2  # both turns answered
    assert out.stderr.count("has no chat template") == 1  # warned once


def test_generate_without_a_chat_template_continues_the_raw_prompt(no_template_pair, loaded):
    target, draft = no_template_pair
    command = f"generate --model {target} --draft {draft} -p 'Alice has' -m 12 --verbose False"
    out = dflash_in_process(command)
    assert out.returncode == 0, out.stderr
    assert out.stdout == greedy_text(loaded, "Alice has", 12, chat=False)[0] + "\n"


def spawn_chat(make_pair, *flags: str):
    target, draft = make_pair("llama-tied-gqa")
    args = ["-m", "dflash_mlx", "chat", "--model", str(target), "--draft", str(draft), *flags]
    child = pexpect.spawn(sys.executable, args, encoding="utf-8", timeout=TIMEOUT)
    child.expect("Ctrl-D to exit")
    child.expect(">> ")
    return child


def turn(child, text: str) -> tuple[bool, int, int, int]:
    """(interrupted, tokens, prompt tokens, newly prefilled tokens) of the answer to `text`."""
    child.sendline(text)
    child.expect(STATS)
    interrupted, tokens, prompt, new = child.match.groups()
    child.expect(">> ")
    return bool(interrupted), int(tokens), int(prompt), int(new)


def test_chat_two_turns_stats_reset_and_exit(make_pair):
    child = spawn_chat(make_pair, "-m", "8", "--system", "Be brief.")
    first = turn(child, "How many apples?")
    assert not first[0] and first[1] <= 8 and first[3] == first[2]  # all new
    second = turn(child, "Alice has 3 apples")
    assert second[2] > first[2] + first[1] and 0 < second[3] < second[2]  # only the new part
    child.sendline("/stats")
    child.expect(r"\[2 turns, 5 messages, \d+ tokens generated")
    child.sendline("/reset")
    child.expect(r"\[new conversation\]")
    child.sendline("/stats")
    child.expect(r"\[0 turns, 1 messages, 0 tokens generated, [^\]]*, 0 tokens cached\]")
    assert turn(child, "How many apples?") == first  # a fresh start answers the same
    child.sendline("/help")
    child.expect(r"/quit +exit \(also /exit, or Ctrl-D\)")
    child.expect(">> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def test_chat_reads_a_pasted_line_longer_than_the_terminal_line_limit(make_pair, loaded):
    """A terminal in canonical mode keeps 4,095 bytes of a line and drops the rest; the
    paste arrives while the chat waits at its prompt and must reach the model whole."""
    try:
        os.close(os.openpty()[0])
    except OSError:
        pytest.skip("no pseudo-terminal on this machine")
    line = " ".join(f"Alice has {n} apples." for n in range(400))
    assert len(line) > 6000
    _, tokenizer, _ = loaded("llama-tied-gqa")
    prompt = len(chat_ids(tokenizer, [{"role": "user", "content": line}]))
    child = spawn_chat(make_pair, "-m", "1")
    # Written from a thread while `expect` reads: the echo of 6,000 characters fills the
    # terminal's output buffer, which would stall the child, and with it the write.
    writer = threading.Thread(target=write_all, args=(child.child_fd, (line + "\r").encode()))
    writer.start()
    # More tokens than the model's context: the chat says how many, and generates nothing.
    child.expect(r"(?:\[the conversation is|prompt) (\d+) tokens", timeout=30)
    writer.join()
    assert int(child.match.group(1)) == prompt > 4096
    child.sendline("/quit")
    child.expect(pexpect.EOF, timeout=10)
    child.close()
    assert child.exitstatus == 0


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_conversation(make_pair):
    child = spawn_chat(make_pair, "-m", "3000", "--block-size", "4")
    child.sendline("hello")  # greedy: over 1,500 tokens on this model
    child.expect("hello\r\n")
    child.expect(".")  # the answer has started
    child.sendintr()
    child.expect(STATS)
    assert child.match.group(1) == "interrupted; " and int(child.match.group(2)) < 3000
    first_prompt = int(child.match.group(3))
    child.expect(">> ")
    child.sendline("/stats")
    child.expect(r"\[1 turns, 2 messages")
    child.sendline("How many apples?")
    child.expect("apples\\?\r\n")
    child.expect(".")
    child.sendintr()
    child.expect(STATS)
    prompt, new = int(child.match.group(3)), int(child.match.group(4))
    assert prompt > first_prompt and new < prompt  # the partial answer is in the history
    child.expect(">> ")
    child.sendintr()  # at the prompt: a hint, not an exit
    child.expect("Ctrl-D or /quit to exit")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_ctrl_c_at_the_prompt_is_not_lost_before_the_read_starts(make_pair):
    """A Ctrl-C that lands after ">> " is shown and before the read is waiting does not
    interrupt the read. Blocking SIGINT in the main thread (another thread takes it)
    puts every Ctrl-C in that state; `input()` would then wait for Enter forever."""
    target, draft = make_pair("llama-tied-gqa")
    script = (
        "import signal, sys, threading; from dflash_mlx.cli import main; "
        "threading.Thread(target=threading.Event().wait, daemon=True).start(); "
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); main(sys.argv[1:])"
    )
    args = ["-c", script, "chat", "--model", str(target), "--draft", str(draft)]
    child = pexpect.spawn(sys.executable, args, encoding="utf-8", timeout=TIMEOUT)
    child.expect(">> ")
    child.sendintr()
    child.expect("Ctrl-D or /quit to exit")
    child.expect(">> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def chat_session(loaded, reuse: bool, capsys) -> tuple[list[dict], list[int]]:
    model, tokenizer, draft = loaded("llama-tied-gqa")
    chat = Chat(model, tokenizer, draft, GenerationSettings(max_tokens=12), "Be brief.", reuse)
    for text in ("How many apples?", "Alice has 3 apples", "def add(a, b):"):
        chat.ask(text)
    new = [int(n) for n in re.findall(r"\((\d+) new\)", capsys.readouterr().out)]
    return chat.messages, new


def test_chat_reports_the_known_tau_of_an_oracle_drafter(loaded, capsys):
    model, tokenizer, draft = loaded("llama-untied-mha")
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Alice has"}])
    oracle, tau = oracle_for(model, tokenizer, draft, ids, 21, 4)
    Chat(model, tokenizer, oracle, GenerationSettings(max_tokens=21, block_size=4), None, True).ask(
        "Alice has"
    )
    drafted = 20 - round(20 / tau)  # each cycle commits its accepted drafts and one more
    assert f"τ {tau:.2f}, {drafted} from accepted drafts" in capsys.readouterr().out


def test_chat_prompt_cache_is_lossless_and_prefills_less(loaded, capsys):
    cached, cached_new = chat_session(loaded, True, capsys)
    fresh, fresh_new = chat_session(loaded, False, capsys)
    assert cached == fresh
    assert cached_new[0] == fresh_new[0]
    assert all(c < f for c, f in zip(cached_new[1:], fresh_new[1:], strict=True))


def test_chat_overlong_conversation_is_a_message_not_a_crash(make_pair, workdir, capsys):
    import dflash_mlx

    target, draft_dir = make_pair("llama-tied-gqa")
    small = copy_dir(target, workdir / "small-context")
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    model, tokenizer = dflash_mlx.load(small)
    chat = Chat(
        model,
        tokenizer,
        dflash_mlx.load_draft(draft_dir),
        GenerationSettings(max_tokens=500),
        None,
        True,
    )
    chat.ask("hello")  # the answer is cut at the context's end
    assert chat.turns[-1].tokens + chat.turns[-1].last.prompt_tokens <= 64
    chat.ask("How many apples? " * 4)
    assert "the model's context holds 64: /reset to start a new one" in capsys.readouterr().out
    assert len(chat.messages) == 2
