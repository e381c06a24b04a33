"""`dflash-mlx demo` on a tiny target, and the shipped drafter's files."""

from __future__ import annotations

import argparse
import json

from dflash_mlx import demo
from dflash_mlx.draft import DFlashConfig


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
    lines = out.splitlines()
    assert any(line.startswith("DFlash :") and "tau" in line for line in lines)
    assert any(line.startswith("mlx-lm :") and "output identical" in line for line in lines)
    assert lines[-1].startswith("speedup: ") and lines[-1].endswith("x")


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
