"""The bench: end to end through its command line, and its measurements against known answers."""

import argparse
import json
import math
import subprocess
import sys

import pytest
from helpers import reference_greedy
from test_cli import dflash_in_process
from test_generate import OracleDraft

from dflash_mlx import stream_generate
from dflash_mlx.chat_format import render
from dflash_mlx.cli import bench
from dflash_mlx.decode.adaptive import AdaptiveBlock, AdaptiveStrategy

PROMPTS = [
    {"id": "code", "category": "coding", "prompt": "def add(a, b):"},
    {"id": "math", "category": "math", "prompt": "How many positive divisors does 196 have?"},
    "The quick brown fox",
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash_mlx.cli.bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_bench_end_to_end(make_pair, tmp_path):
    target, draft = make_pair("llama-tied-gqa")
    prompts = tmp_path / "small.json"
    prompts.write_text(json.dumps(PROMPTS))
    out, png = tmp_path / "x.json", tmp_path / "x.png"
    # a fixed block: with the default adaptive size (chosen by the clock) a prompt may get
    # plain steps only, and then no draft positions and no draft time to check
    args = [
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--max-tokens",
        "24",
        "--block-size",
        "16",
    ]
    proc = run_cli(*args, "--prompts", str(prompts), "--out", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())

    assert results["config"]["block_size"] == 16 and not results["config"]["random_draft"]
    assert [r["id"] for r in results["prompts"]] == ["code", "math", "p03"]
    assert set(results["verify_cost_ms"]) == {"1", "8", "16"}
    for r in [*results["prompts"], results["overall"]]:
        for system in ("ar", "dflash"):
            assert r[system]["decode_tps"] > 0 and r[system]["e2e_tps"] > 0
            assert r[system]["ttft_s"] > 0 and r[system]["peak_memory_gb"] > 0
        assert r["speedup_decode"] == pytest.approx(
            r["dflash"]["decode_tps"] / r["ar"]["decode_tps"]
        )
        rates = r["acceptance"]["per_position"]
        assert len(rates) == 15 and all(0 <= x <= 1 for x in rates)
        assert 1 <= r["acceptance"]["tau"] <= 16
        split = r["split_ms"]
        assert split["verify"] > 0 and split["draft"] > 0 and split["rollback"] >= 0
        assert split["cycle"] == pytest.approx(sum(split[k] for k in (*bench.PARTS, "host")))
    for r in results["prompts"]:
        assert r["dflash"]["generated_tokens"] == r["ar"]["generated_tokens"]
        assert r["identical"] is True and r["divergence"] is None
    assert results["overall"]["identical"] == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "overall" in proc.stdout and "verify forward" in proc.stdout


def test_bench_with_the_library_default(make_pair, tmp_path):
    """The default run: chains or trees chosen per cycle (by the clock, so which prompts draft
    varies); the replies stay identical and the report well-formed whatever it chose."""
    target, draft = make_pair("llama-tied-gqa")
    prompts = tmp_path / "small.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "x.json"
    args = f"--model {target} --draft {draft} --max-tokens 24 --no-split --prompts {prompts}"
    proc = dflash_in_process(f"bench {args} --out {out}")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert results["overall"]["identical"] == 3
    for r in [*results["prompts"], results["overall"]]:
        rates = r["acceptance"]["per_position"]
        assert len(rates) <= 16 and all(0 <= x <= 1 for x in rates)  # trees: 16 nodes
        assert 1 <= r["acceptance"]["tau"] <= 16


def test_bench_runs_the_library_default_and_counts_its_cycles(loaded, monkeypatch):
    """Unset, the bench's replies play what `stream_generate` plays by default (chains or
    trees chosen per cycle), one policy going on from prompt to prompt; asked to adapt a
    block size, the adaptive chain; the report counts the kinds of cycle each played."""
    model, tokenizer, draft = loaded("llama-tied-gqa")
    policies = []

    def spy(*args, **kwargs):
        policies.append(kwargs["block_policy"])
        return stream_generate(*args, **kwargs)

    monkeypatch.setattr(bench, "stream_generate", spy)
    prompts = [{"id": "a", "prompt": "def add(a, b):"}, {"id": "b", "prompt": "The quick"}]
    results = bench.bench(model, tokenizer, draft, prompts, max_tokens=12, split=False)
    assert isinstance(policies[0], AdaptiveStrategy) and len(policies) == 3  # warm-up + 2
    assert all(p is policies[0] for p in policies)
    per_prompt = [r["cycle_kinds"] for r in results["prompts"]]
    overall = results["overall"]["cycle_kinds"]
    assert overall == {k: sum(kinds[k] for kinds in per_prompt) for k in overall}
    assert all(sum(kinds.values()) > 0 for kinds in per_prompt)

    policies.clear()
    bench.bench(
        model, tokenizer, draft, prompts[:1], max_tokens=8, split=False, block_size=4,
        adaptive=True, baseline=False,
    )  # fmt: skip
    assert isinstance(policies[0], AdaptiveBlock) and policies[0].block_size == 4
    policies.clear()
    fixed = bench.bench(
        model, tokenizer, draft, prompts[:1], max_tokens=8, split=False, block_size=4,
        baseline=False,
    )  # fmt: skip
    assert policies == [None, None]
    assert fixed["overall"]["cycle_kinds"]["trees"] == 0


def test_bench_rejects_bad_options_cleanly(tmp_path):
    proc = dflash_in_process(f"bench --max-tokens 0 --out {tmp_path / 'x.json'}")
    assert proc.returncode == 1
    assert proc.stderr.strip() == "dflash-mlx bench: error: --max-tokens must be at least 1, got 0"


def test_acceptance_per_position_known_pattern():
    # (committed, accepted, proposed) per cycle; the last cycle was cut short by max_tokens.
    cycles = [(4, 3, 4), (1, 0, 4), (5, 4, 4), (2, 1, 2)]
    stats = bench.acceptance(cycles)
    assert stats["tau"] == 3.0
    assert stats["per_position"] == [3 / 4, 2 / 4, 2 / 3, 1 / 3]


def test_oracle_drafter_is_fully_accepted_and_instances_restored(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = {"id": "p", "category": "", "prompt": "def add(a, b):"}
    ids = render(tokenizer, prompt["prompt"], chat=True)
    expected = reference_greedy(model, ids, 40, set(tokenizer.eos_token_ids))
    oracle = OracleDraft(draft, ids + expected)
    classes = type(model), type(oracle)
    results = bench.bench(model, tokenizer, oracle, [prompt], block_size=8, max_tokens=40)

    (r,) = results["prompts"]
    assert r["identical"] and r["dflash"]["generated_tokens"] == len(expected)
    assert r["acceptance"]["per_position"] == [1.0] * 7
    cycles = math.ceil((len(expected) - 1) / 8)
    assert r["acceptance"]["tau"] == pytest.approx((len(expected) - 1) / cycles)
    assert (type(model), type(oracle)) == classes


def test_tree_budget_bench_is_identical_to_ar_with_every_part_timed(loaded):
    model, tokenizer, draft = loaded("llama-tied-gqa")
    prompt = {"id": "p", "category": "", "prompt": "def add(a, b):"}
    results = bench.bench(model, tokenizer, draft, [prompt], tree_budget=4, max_tokens=30)
    (r,) = results["prompts"]
    assert r["identical"] and r["dflash"]["generated_tokens"] == 30
    assert r["split_ms"]["verify"] > 0 and r["split_ms"]["draft"] > 0
    assert max(len(r["acceptance"]["per_position"]), 1) <= 4  # at most 4 nodes per tree


def test_divergence_reports_first_index_and_top2_gap(loaded):
    model, tokenizer, _ = loaded("llama-tied-gqa")
    ids = render(tokenizer, "The quick brown fox", chat=False)
    ar = reference_greedy(model, ids, 8, set())
    other = (ar[3] + 1) % 300
    d = bench.divergence(model, ids, ar, ar[:3] + [other] + ar[4:])
    assert d["index"] == 3 and d["ar_token"] == ar[3] and d["dflash_token"] == other
    assert d["top2"][0] == ar[3] and d["top2_gap"] >= 0
    assert bench.divergence(model, ids, ar, list(ar)) is None
    assert bench.divergence(model, ids, ar, ar[:5])["index"] == 5


def test_bench_chooses_prompts_by_category_and_limit():
    chosen = bench.chosen_prompts(argparse.Namespace(prompts=None, category="coding", limit=3))
    assert len(chosen) == 3 and {p["category"] for p in chosen} == {"coding"}
    with pytest.raises(ValueError, match="no prompt of category 'poetry'"):
        bench.chosen_prompts(argparse.Namespace(prompts=None, category="poetry", limit=None))
