"""`--trust-remote-code` / `load(..., trust_remote_code=True)`, as mlx-lm has them: a target whose
tokenizer is its own Python code loads only when trusted, and every command that loads the
target's tokenizer takes the flag to mlx-lm's tokenizer loader."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import mlx_lm.utils
import pytest
from helpers import copy_dir

import dflash_mlx
from dflash_mlx import cli, load
from dflash_mlx.train import trainer

REMOTE_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class RemoteTokenizer(PreTrainedTokenizerFast):
    """The tiny tokenizer, as a checkpoint's own code (like Kimi's tiktoken tokenizer)."""
'''


@pytest.fixture(scope="module")
def remote_target(make_pair, workdir):
    """llama-tied-gqa's target, its tokenizer class given by a Python file in the checkpoint."""
    target = copy_dir(make_pair("llama-tied-gqa")[0], workdir / "llama-remote-tokenizer")
    (target / "tokenization_remote.py").write_text(REMOTE_TOKENIZER)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "RemoteTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_remote.RemoteTokenizer"]}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_a_tokenizer_that_is_code_loads_only_when_trusted(remote_target, loaded):
    with pytest.raises(ValueError, match="own tokenizer or model code: pass --trust-remote-code"):
        load(remote_target)
    _, tokenizer = load(remote_target, trust_remote_code=True)
    assert type(tokenizer._tokenizer).__name__ == "RemoteTokenizer"
    plain = loaded("llama-tied-gqa")[1]
    assert tokenizer.encode("Alice has 3 apples") == plain.encode("Alice has 3 apples")


class Reached(BaseException):  # passes through every handler on the way
    """Raised by the stand-in tokenizer loader: the command got that far, with this config."""


# every command that loads the target's tokenizer, with the arguments it needs to get there
SHIPPED = Path(dflash_mlx.__file__).parent / "drafters" / "smollm2-135m-instruct"
COMMANDS = {
    "generate": "generate --model {target} --no-draft -p hi",
    "chat": "chat --model {target} --no-draft",
    "serve": "serve --model {target} --no-draft",
    "cache-prompt": "cache-prompt --model {target} --no-draft -p hi --prompt-cache-file {work}/c",
    "bench": "bench --model {target} --limit 1",
    "demo": "demo --model {target}",
    "train data": "train data --model {target} --work {work} --num-prompts 1",
    "train features": "train features --model {target} --work {work}",
    "train fit": "train fit --model {target} --work {work}",
    "train export": "train export --model {target} --work {work} --out {work}/out --draft-vocab 8",
    "train finetune": "train finetune --model {target} --work {work} --from {work}/chats.jsonl "
    "--draft {shipped} --out {work}/tuned",
}


def subcommands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every subcommand and `train` stage, e.g. ("train fit", its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + name, sub
                yield from subcommands(sub, f"{prefix}{name} ")


@pytest.mark.parametrize("trusted", [False, True])
def test_every_command_that_loads_the_tokenizer_takes_the_flag_to_it(
    remote_target, monkeypatch, tmp_path, trusted
):
    flags = {
        name: {o for action in sub._actions for o in action.option_strings}
        for name, sub in subcommands(cli.build_parser())
    }
    takes_model = {name for name, options in flags.items() if "--model" in options}
    reads_files_only = {"info"}  # `info --model` reads the checkpoint's config and tensor names
    assert takes_model - reads_files_only == set(COMMANDS), (
        "a command that loads a tokenizer needs a line here"
    )
    assert all("--trust-remote-code" in flags[name] for name in COMMANDS)

    def tokenizer_loader(path, tokenizer_config_extra=None, eos_token_ids=None):
        raise Reached(tokenizer_config_extra)

    monkeypatch.setattr(mlx_lm.utils, "load_tokenizer", tokenizer_loader)
    drafter = SimpleNamespace(  # a DFlash 1 one
        config=SimpleNamespace(is_dflash2=False, mask_token_id=0, draft_vocab=None)
    )
    monkeypatch.setattr(trainer, "checkpoint_draft", lambda path: (drafter, 0))  # export's first
    (tmp_path / "chats.jsonl").write_text('{"prompt": "hi"}\n')  # finetune's conversations
    for name, command in COMMANDS.items():
        argv = command.format(target=remote_target, work=tmp_path, shipped=SHIPPED).split()
        with pytest.raises(Reached) as reached:
            cli.main(argv + ["--trust-remote-code"] * trusted)
        assert reached.value.args[0]["trust_remote_code"] is trusted, name
