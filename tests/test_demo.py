"""`dflash-mlx demo` on a tiny target, and the shipped drafter's files."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers import copy_dir, set_eos
from test_families import build

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.cli import demo
from dflash_mlx.cli.bench import render
from dflash_mlx.decode.adaptive import AdaptiveBlock
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.draft import DFlashConfig
from dflash_mlx.models.gguf import smollm2_model_dir


def demo_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_demo_streams_a_reply_and_compares_with_mlx_lm(make_pair, capsys):
    target, draft = make_pair("llama-tied-gqa")
    demo.run(demo_args(model=target, draft=str(draft), prompt="Add two numbers.", max_tokens=24))
    out = capsys.readouterr().out
    assert out.startswith("> Add two numbers.")
    assert "\n[cut at 24 tokens: --max-tokens]\n\n" in out  # the reply did not end by itself
    lines = out.splitlines()
    assert any(line.startswith("DFlash :") and "tau" in line for line in lines)
    assert any(line.startswith("mlx-lm :") and "output identical" in line for line in lines)
    assert lines[-1].startswith("speedup: ") and lines[-1].endswith("x")


def test_demo_says_nothing_of_a_cut_where_the_reply_ended_by_itself(make_pair, tmp_path, capsys):
    target, draft = make_pair("llama-tied-gqa")
    model, tokenizer = load(target)
    ids = render(tokenizer, "Add two numbers.", chat=True)
    responses = stream_generate(model, None, tokenizer, ids, max_tokens=8)
    reply = [t for r in responses for t in r.tokens]
    ending = copy_dir(target, tmp_path / "ending")
    set_eos(ending, reply[3])  # its fourth reply token ends the reply
    demo.run(demo_args(model=ending, draft=str(draft), prompt="Add two numbers.", max_tokens=24))
    assert "[cut at" not in capsys.readouterr().out


def test_demo_verifies_trees_or_the_chain(make_pair, capsys):
    target, draft = make_pair("llama-tied-gqa")
    default = "(chains or trees by measured cost)"
    for budget, shape in ((6, "(trees of 6)"), (0, "(chain)"), (None, default)):
        demo.run(demo_args(model=target, draft=str(draft), max_tokens=24, tree_budget=budget))
        lines = capsys.readouterr().out.splitlines()
        assert any(line.startswith("DFlash :") and line.endswith(shape) for line in lines)
        assert any("output identical" in line for line in lines)
    with pytest.raises(ValueError, match="--tree-budget must be 0"):
        demo.run(demo_args(model=target, draft=str(draft), tree_budget=-1))


def test_demo_runs_the_chain_for_a_target_that_cannot_verify_trees(capsys):
    model = build("qwen3_5")  # recurrent layers
    draft = init_draft(model, num_layers=1, block_size=4)
    setting = demo.verify_setting(model, draft, 6)
    assert isinstance(setting["block_policy"], AdaptiveBlock) and "tree_budget" not in setting
    note = capsys.readouterr().out
    assert note.startswith("note: tree verification does not support") and "chain" in note
    assert isinstance(demo.verify_setting(model, draft, None)["block_policy"], AdaptiveBlock)


def test_demo_without_baseline(make_pair, capsys):
    target, draft = make_pair("llama-tied-gqa")
    demo.run(demo_args(model=target, draft=str(draft), max_tokens=8, no_baseline=True))
    out = capsys.readouterr().out
    assert "DFlash :" in out and "mlx-lm" not in out


def test_shipped_drafter_matches_smollm2():
    cfg = DFlashConfig.from_dict(json.loads((demo.SHIPPED_DRAFTER / "config.json").read_text()))
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (576, 49152, 30)
    assert cfg.block_size == 16
    size = sum(f.stat().st_size for f in demo.SHIPPED_DRAFTER.iterdir())
    assert size <= 25 * 2**20
    assert (demo.SHIPPED_DRAFTER / "README.md").read_text().startswith("# ")


def test_the_shipped_drafter_attends_to_its_own_window_unless_told_otherwise():
    """Trained on sequences of a few hundred tokens, it drafts from the last 256 positions of
    a long context (better and cheaper there); 0 or a number overrides that."""
    windows = [
        {layer.self_attn.window for layer in load_draft(demo.SHIPPED_DRAFTER, **arg).layers}
        for arg in ({}, {"context_window": 0}, {"context_window": 1024})
    ]
    assert windows == [{256}, {None}, {1024}]


SMOLLM2_PROMPTS = [
    "Explain what a Python list comprehension is, with a short example.",
    "Write a Python function that returns the factorial of n.",
]


@pytest.mark.slow
def test_shipped_drafter_drafts_well_for_smollm2():
    """The shipped weights, loaded strictly, are accepted as in the bench (τ 1.50 there)."""
    model, tokenizer = load(smollm2_model_dir())
    draft = load_draft(demo.SHIPPED_DRAFTER)
    tokens, cycles = 0, 0
    for prompt in SMOLLM2_PROMPTS:
        ids = render(tokenizer, prompt, chat=True)
        responses = list(stream_generate(model, draft, tokenizer, ids, max_tokens=64))
        tokens += responses[-1].generation_tokens - 1  # the first came from the prefill
        cycles += len(responses) - 1
        print(prompt, responses[-1].generation_tokens, len(responses))
    assert tokens / cycles >= 1.3, tokens / cycles
