"""mlx-lm's command lines work with `dflash-mlx` in place of `mlx_lm`: every flag of
mlx_lm.generate, chat, server and cache_prompt is taken, or refused by name with a reason."""

import argparse
import io
import json
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

import mlx.core as mx
import pytest
from helpers import chat_ids, mlx_lm_greedy, parse_mlx_lm_verbose
from mlx.utils import tree_flatten
from mlx_lm import cli as mlx_lm_cli
from test_cli import dflash, dflash_in_process
from test_server import running_server

from dflash_mlx import cli
from dflash_mlx.chat_format import chat_prompt
from dflash_mlx.options import generation_settings, load_models

TIMEOUT = 120
# mlx-lm's command -> ours
COMMANDS = {
    "generate": "generate",
    "chat": "chat",
    "server": "serve",
    "cache_prompt": "cache-prompt",
}
# what a refused flag's command needs besides it to get as far as the refusal
REQUIRED = {"cache-prompt": ["--prompt-cache-file", "x.safetensors"]}


def run_mlx_lm(argv: list[str]) -> str:
    """What `python -m mlx_lm ARGV` prints, run in this process (a fresh interpreter would
    take seconds to import it): mlx-lm's own command-line entry point, its argv swapped."""
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["mlx_lm", *argv]), redirect_stdout(out):
        try:
            mlx_lm_cli.main()
        except SystemExit as exit_info:
            assert exit_info.code in (None, 0), out.getvalue()
    return out.getvalue()


def mlx_lm_flags(command: str) -> set[str]:
    """Every option string `python -m mlx_lm <command> --help` lists."""
    help_text = run_mlx_lm([command, "--help"])
    options = help_text.split("\noptions:\n", 1)[1]
    flags = set()
    for spec in re.findall(r"^  (-\S.*?)(?:  |$)", options, re.M):
        flags.update(part.split()[0] for part in spec.split(", "))
    return flags


def subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every subcommand and `train` stage, with the top-level parser."""
    yield prefix.strip() or "dflash-mlx", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subparsers(sub, f"{prefix}{name} ")


def our_flags(command: str) -> set[str]:
    sub = dict(subparsers(cli.build_parser()))[command]
    return {o for action in sub._actions for o in action.option_strings}


def refusal(argv: list[str], capsys) -> str:
    """The one-line error `dflash-mlx ARGV` exits with (status 2, a usage error)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("mlx_command", COMMANDS)
def test_every_mlx_lm_flag_is_taken_or_refused_with_a_reason(mlx_command, capsys):
    command = COMMANDS[mlx_command]
    theirs, ours = mlx_lm_flags(mlx_command), our_flags(command)
    assert {"--model", "--max-tokens", "--trust-remote-code"} & theirs  # the help was read
    assert sorted(theirs - ours - set(cli.REFUSED)) == []
    for flag in sorted(theirs - ours):
        argv = [command, "--model", "m", *REQUIRED.get(command, []), flag, "1"]
        assert refusal(argv, capsys) == (
            f"dflash-mlx {command}: error: {flag} (mlx-lm's) is not supported here: "
            + cli.REFUSED[flag]
        )


def test_an_unknown_flag_names_the_one_it_likely_meant(capsys):
    assert refusal(["generate", "--model", "m", "--draft-modl", "d"], capsys) == (
        "dflash-mlx generate: error: unrecognized argument --draft-modl; "
        "did you mean --draft-model?"
    )
    assert refusal(["serve", "--model", "m", "--max-tokenz=5"], capsys).endswith(
        "unrecognized argument --max-tokenz; did you mean --max-tokens?"
    )
    assert refusal(["train", "fit", "--stpes", "5"], capsys).endswith(
        "unrecognized argument --stpes; did you mean --steps?"
    )
    assert refusal(["chat", "--model", "m", "--zzz"], capsys).endswith(
        "unrecognized argument --zzz; dflash-mlx chat --help lists the flags"
    )


def test_no_flag_is_taken_for_a_prefix_of_another(capsys):
    """argparse would take `--chat-template x` for `--chat-template-args x` on a parser
    without `--chat-template`, and `--max-tok 5` for `--max-tokens 5`."""
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--chat-template", "{{ messages }}"])
    assert args.chat_template_source == "{{ messages }}" and args.chat_template_args == {}
    assert "did you mean --max-tokens?" in refusal(
        ["generate", "--model", "m", "--max-tok", "5"], capsys
    )
    assert "did you mean --chat-template-args?" in refusal(
        ["serve", "--model", "m", "--chat-template-arg", "{}"], capsys
    )


def test_choices_take_any_case():
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--log-level", "INFO", "--dtype", "Float32"])
    assert (args.log_level, args.dtype) == ("info", "float32")  # uvicorn's and MLX's spelling
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--log-level", "LOUD"])


def test_mlx_lm_names_mean_what_they_mean_in_mlx_lm(tmp_path, capsys):
    parser = cli.build_parser()
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    serve = parser.parse_args(
        ["serve", "--model", "m", "--draft-model", "d", "--decode-concurrency", "3"]
        + ["--chat-template", str(template), "--num-draft-tokens", "4"]
    )
    assert (serve.draft, serve.max_batch) == ("d", 3)
    assert serve.chat_template_source == "{{ messages[0]['content'] }}"  # the file's template
    generate = parser.parse_args(
        ["generate", "--model", "m", "--num-draft-tokens", "4", "--system-prompt", "s"]
        + ["--ignore-chat-template", "--kv-bits", "4", "--max-kv-size", "64"]
    )
    settings = generation_settings(generate)
    assert settings.block_size == 5  # four drafted tokens and the one they follow
    assert (settings.kv_bits, settings.kv_group_size, settings.quantized_kv_start) == (4, 64, 5000)
    assert (settings.max_kv_size, settings.prefill_step_size) == (64, 2048)
    assert generate.system == "s" and generate.chat_template is False
    ours = parser.parse_args(["generate", "--model", "m", "--block-size", "5", "--system", "s"])
    assert generation_settings(ours).block_size == 5 and ours.system == "s"
    missing = refusal(["serve", "--model", "m", "--chat-template", str(tmp_path / "none")], capsys)
    assert missing.endswith(f"no file {tmp_path / 'none'} (and no Jinja template: it has no '{{')")


def test_xtc_and_min_tokens_to_keep_reach_the_sampler_as_mlx_lm_sets_them(loaded):
    """mlx_lm.generate's XTC spares the tokenizer's newline and end-of-sequence tokens."""
    tokenizer = loaded("llama-tied-gqa")[1]
    flags = "--xtc-probability 0.5 --xtc-threshold 0.2 --min-tokens-to-keep 3 --min-p 0.1"
    args = cli.build_parser().parse_args(["generate", "--model", "m", *shlex.split(flags)])
    settings = generation_settings(args, tokenizer)
    assert (settings.xtc_probability, settings.xtc_threshold) == (0.5, 0.2)
    assert settings.min_tokens_to_keep == 3
    spared = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
    assert settings.xtc_special_tokens == tuple(spared) and spared
    for flag, value, bounds in (
        ("--xtc-threshold", "0.7", "must be in [0, 0.5], got 0.7"),
        ("--xtc-probability", "2", "must be in [0, 1], got 2.0"),
        ("--min-tokens-to-keep", "0", "must be at least 1, got 0"),
    ):
        args = cli.build_parser().parse_args(["generate", "--model", "m", flag, value])
        with pytest.raises(ValueError) as bad:
            generation_settings(args)
        assert str(bad.value) == f"{flag} {bounds}"


def test_generate_with_xtc_gives_one_seeded_reply_drafting_or_not(make_pair):
    """Under the coupled rule a seeded reply does not depend on the cycles' shapes: with XTC
    too, chains, trees or plain steps give the same reply, and not the one without XTC."""
    target, draft = make_pair("llama-tied-gqa")
    line = f"generate --model {target} -p 'Alice has' -m 24 --temp 1 --seed 3 --verbose F"
    xtc = "--xtc-probability 0.5 --xtc-threshold 0.05"
    replies = set()
    for drafting in (f"--draft {draft}", f"--draft {draft} --block-size 3", "--no-draft"):
        out = dflash_in_process(f"{line} {drafting} {xtc}")
        assert out.returncode == 0, out.stderr
        replies.add(out.stdout)
    assert len(replies) == 1
    assert dflash_in_process(f"{line} --no-draft").stdout not in replies


def test_serve_chat_template_and_extra_eos_tokens_reach_the_tokenizer(make_pair):
    target, _ = make_pair("llama-tied-gqa")
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    argv = ["serve", "--model", str(target), "--no-draft", "--chat-template", template]
    args = cli.build_parser().parse_args([*argv, "--extra-eos-token", "<|im_start|>", "5"])
    _, tokenizer, _ = load_models(args)
    assert chat_prompt(tokenizer, [{"role": "user", "content": "hi"}]) == "[hi]"
    assert {tokenizer.convert_tokens_to_ids("<|im_start|>"), 5} <= set(tokenizer.eos_token_ids)
    args = cli.build_parser().parse_args([*argv, "--extra-eos-token", "no such token"])
    with pytest.raises(ValueError, match="^--extra-eos-token: 'no such token' is not a token"):
        load_models(args)


def test_every_flag_says_what_it_does_and_its_default():
    for name, parser in subparsers(cli.build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            text = formatter._expand_help(action) if action.help else ""
            where = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert text.strip(), f"{where} has no help"
            if cli.shown_default(action):
                default = action.default
                shown = {str(default), format(default, "g") if isinstance(default, float) else ""}
                assert any(s and s in text for s in shown), f"{where}: no default in {text!r}"


def mlx_lm_generate(line: str) -> str:
    """What `python -m mlx_lm generate LINE` prints."""
    return run_mlx_lm(["generate", *shlex.split(line)])


def save_adapter(target: Path, path: Path) -> Path:
    """A LoRA adapter for `target`'s last two layers, as mlx-lm's trainer saves one, with
    random (non-zero) weights so that it changes the replies."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    config = {"fine_tune_type": "lora", "num_layers": 2}
    config["lora_parameters"] = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    model, _ = load(str(target))
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    mx.random.seed(0)
    weights = {k: mx.random.normal(v.shape) for k, v in tree_flatten(model.trainable_parameters())}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def test_generate_runs_mlx_lm_command_lines_unchanged(make_pair, loaded, tmp_path):
    """mlx_lm.generate command lines, `mlx_lm` swapped for `dflash-mlx` and a drafter added,
    print what mlx_lm.generate prints for them (greedy): a raw prompt, a chat with a system
    prompt and an extra end-of-sequence token, one with the reply's start given (a target
    without a BOS token), a templated prompt for a tokenizer that adds a BOS (mlx-lm adds
    none: the template writes the special tokens), and one with a LoRA adapter.
    Each runs in this process; the first again as a child, whose streams hold nothing else."""
    target, draft = make_pair("qwen3-tied-gqa")
    model, tokenizer, _ = loaded("qwen3-tied-gqa")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = chat_ids(tokenizer, messages)
    tokens, _ = mlx_lm_greedy(model, ids, 16, set(tokenizer.eos_token_ids))
    stop = tokens[3]  # a token of the reply, made an end of sequence: the reply ends before it
    templated = (
        f"--model {target} --prompt Hi --max-tokens 16 --system-prompt 'Be brief.' "
        f"--extra-eos-token {stop} --verbose False --temp 0.0 --top-p 1.0 --seed 0"
    )
    prefilled = f"--model {target} --prompt Hi -m 8 --prefill-response 'The ans' --verbose F"
    llama, llama_draft = make_pair("llama-tied-gqa")
    raw = f"--model {llama} --prompt 'Alice has' -m 8 --ignore-chat-template --verbose False"
    adapted = f"{raw} --adapter-path {save_adapter(llama, tmp_path / 'adapter')}"
    with_bos = f"--model {llama} --prompt 'Alice has' -m 8 --verbose False"
    lines = ((templated, draft), (prefilled, draft), (raw, llama_draft), (adapted, llama_draft))
    lines += ((with_bos, llama_draft),)
    commands, replies = [], []
    for line, drafter in lines:
        expected = mlx_lm_generate(line)
        commands.append(f"generate {line} --draft-model {drafter} --num-draft-tokens 3")
        ours = dflash_in_process(commands[-1])
        assert ours.returncode == 0, ours.stderr
        assert ours.stdout == expected and ours.stderr == ""  # --verbose False: the reply alone
        replies.append(expected)
    child = dflash(commands[0])
    assert (child.returncode, child.stdout, child.stderr) == (0, replies[0], "")
    assert replies[0] == tokenizer.decode(tokens[: tokens.index(stop)]) + "\n"
    assert replies[3] != replies[2]  # the adapter changed the reply


def test_generate_prints_mlx_lm_stats_lines_then_what_drafting_did(make_pair):
    """Verbose (the default), stdout holds what mlx_lm.generate prints, parsed in its wording:
    the same reply between its rules, its three stats lines with the same counts, then one
    line on speculation whose numbers agree with them; stderr only the loading line."""
    target, draft = make_pair("llama-tied-gqa")
    line = f"--model {target} --prompt 'Alice has' -m 12 --ignore-chat-template"
    theirs = parse_mlx_lm_verbose(mlx_lm_generate(line))
    out = dflash(f"generate {line} --draft-model {draft} --num-draft-tokens 3")
    assert out.returncode == 0 and out.stderr.startswith("loading "), out.stderr
    ours = parse_mlx_lm_verbose(out.stdout)
    assert (ours["reply"], ours["prompt_tokens"]) == (theirs["reply"], theirs["prompt_tokens"])
    assert ours["generation_tokens"] == theirs["generation_tokens"] == 12
    assert ours["prompt_tps"] > 0 and ours["generation_tps"] > 0 and ours["peak_memory"] > 0
    speculation = re.fullmatch(
        r"Speculation: (\d+\.\d\d) tokens per verify cycle over (\d+) cycles, (\d+) of "
        r"(\d+) tokens from accepted drafts \((.+)\), first token after \d+ ms\n",
        ours["rest"],
    )
    assert speculation, ours["rest"]
    *numbers, kinds = speculation.groups()
    tau, cycles, accepted, tokens = map(float, numbers)
    by_kind = [int(n) for n in re.findall(r"(?:chains|trees|plain) (\d+)", kinds)]
    assert tokens == 12 and sum(by_kind) == cycles and round((tokens - 1) / cycles, 2) == tau
    assert accepted <= tokens - 1 - cycles  # each cycle commits its accepted drafts and one more


def test_serve_says_it_is_loading_before_it_is_ready(make_pair, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    with running_server(target, draft, tmp_path / "serve.log", "--log-level", "INFO") as (
        _,
        log,
        _,
    ):
        lines = log.read_text().splitlines()
    loading = next(i for i, line in enumerate(lines) if line.startswith(f"loading {target}"))
    ready = next(i for i, line in enumerate(lines) if "Uvicorn running" in line)
    assert loading < ready and f"the drafter {draft}" in lines[loading]


def test_bench_without_a_drafter_says_it_is_random(make_pair, tmp_path):
    from dflash_mlx.cli.bench import RANDOM_DRAFTER_WARNING

    target, _ = make_pair("llama-tied-gqa")
    flags = f"--model {target} --limit 1 --max-tokens 4 --no-baseline --no-split"
    command = f"bench {flags} --out {tmp_path / 'b.json'} --plot {tmp_path / 'b.png'}"
    out = dflash_in_process(command)
    assert out.returncode == 0, out.stderr
    assert RANDOM_DRAFTER_WARNING in out.stderr.splitlines()
    assert "RANDOM" in RANDOM_DRAFTER_WARNING


@pytest.mark.parametrize(
    ("module", "command"),
    [("generate", "generate"), ("cli.chat", "chat"), ("cli.bench", "bench")],
)
def test_python_m_a_command_module_runs_that_command(module, command):
    """`python -m dflash_mlx.generate` is `dflash-mlx generate`, without runpy's warning that
    the package imported the module first."""
    cmd = [sys.executable, "-m", f"dflash_mlx.{module}", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith(f"usage: dflash-mlx {command} ")
