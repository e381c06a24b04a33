"""benchmarks/cycle_cost.py: a real run reports every measurement; ablations stay per instance."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cycle_cost.py"
spec = importlib.util.spec_from_file_location("cycle_cost", SCRIPT)
cycle_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cycle_cost)

ABLATIONS = {"attention", "attention_projections", "mlp", "norms_rope", "lm_head"}
PARTS = ABLATIONS | {"other", "graph_build"}


def run_script(*args: str) -> dict:
    out = Path(args[args.index("--json") + 1])
    cmd = [sys.executable, str(SCRIPT), "--rounds", "1", "--reps", "1", "--prompt-tokens", "8"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "verify forward (synced)" in proc.stdout and "norm+rope" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("variant", ["random tiny, 4-bit", "model dir with drafter"])
def test_script_reports_every_measurement(variant, make_pair, tmp_path):
    out = str(tmp_path / "cost.json")
    if variant == "random tiny, 4-bit":
        args = ["--shape", "tiny", "--dtype", "bfloat16", "-q", "4", "--block-size", "4"]
        args += ["--tree-budgets", "2,5"]
        results = run_script(*args, "--max-tokens", "10", "--positions", "1,2", "--json", out)
        block = 4
        assert results["config"]["q_bits"] == 4 and results["config"]["weights"] == "random"
    else:  # qwen3 (q/k norms), untied LM head, the drafter's own block size (16)
        target, draft = make_pair("qwen3-untied-mha")
        args = ["--model", str(target), "--draft", str(draft), "--positions", "1"]
        results = run_script(*args, "--max-tokens", "20", "--json", out)
        block = 16
        assert results["config"]["weights"] == "checkpoint"

    step = results["mlx_lm_step"]["ms"]
    cycle = results["cycle"]
    assert cycle["block_size"] == block and cycle["accepted_per_cycle"] >= 0
    for t in (
        results["mlx_lm_step"],
        results["loop_block1"],
        *(cycle[k] for k in ("cycle", "draft", "verify")),
    ):
        assert t["ms"] > 0 and t["steps"] == pytest.approx(t["ms"] / step)
    assert math.isfinite(cycle["host"]["ms"])
    assert set(results["trees"]) == ({"2", "5"} if block == 4 else set())
    for budget, tree in results["trees"].items():
        assert tree["nodes"] == int(budget) + 1 and 1 <= tree["depth"] <= int(budget)
        assert tree["accepted_per_cycle"] >= 0
        for t in (tree["forward"], tree["cycle"]):
            assert t["ms"] > 0 and t["steps"] == pytest.approx(t["ms"] / step)
    parts = cycle["draft"]["ms"] + cycle["verify"]["ms"] + cycle["host"]["ms"]
    assert parts == pytest.approx(cycle["cycle"]["ms"])  # the split adds up to the cycle
    assert set(results["forward"]) == ({"1", "2", "4"} if block == 4 else {"1", "16"})
    for f in results["forward"].values():
        assert f["full"]["ms"] > 0 and f["vs_one_position"] > 0
        assert set(f["ablated_ms"]) == ABLATIONS and all(ms > 0 for ms in f["ablated_ms"].values())
        assert set(f["parts_ms"]) == PARTS and f["parts_ms"]["graph_build"] > 0
        assert all(math.isfinite(ms) for ms in f["parts_ms"].values())


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablation_changes_only_this_instance_and_is_undone(name):
    model, other = cycle_cost.random_target("tiny"), cycle_cost.random_target("tiny")
    x, y = mx.array([[1, 2, 3, 4]]), mx.array([[5, 6, 7, 8]])
    before, other_before = model(x), other(x)
    pick, make = cycle_cost.ablations(model)[name]
    with cycle_cost.ablated(model, pick, make):
        assert not mx.allclose(model(x), before)
        # the stand-in keeps its input in the graph, else lazy evaluation would skip the rest
        assert not mx.array_equal(model(x), model(y))
        assert mx.array_equal(other(x), other_before)
    assert mx.array_equal(model(x), before)


def test_script_rejects_a_budget_without_full_cycles_in_one_line():
    """In this process: `sys.exit(message)`, which a child prints as its one line with status 1."""
    with pytest.raises(SystemExit) as exit_info:
        cycle_cost.main(["--shape", "tiny", "--max-tokens", "10"])
    assert exit_info.value.code == (
        "cycle_cost.py: error: --max-tokens (10) must exceed the block size + 2 (18) "
        "to time full cycles"
    )


@pytest.mark.parametrize("quantize", [[], ["-q", "4"]], ids=["float32", "4-bit"])
def test_verify_ops_reports_every_op_at_every_size(quantize, tmp_path):
    """benchmarks/verify_ops.py, a real run: every op of a layer and the forward's three
    phases at each size, positive, per call; the CUDA kernel's rows only where it can run."""
    script = SCRIPT.parent / "verify_ops.py"
    out = tmp_path / "ops.json"
    args = ["--shape", "tiny", "--rounds", "1", "--reps", "1", "--positions", "1,3"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, *quantize, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SCRIPT.parent,
    )
    assert proc.returncode == 0, proc.stderr
    timings = json.loads(out.read_text())["us"]
    ops = {key.rpartition("@")[0] for key in timings}
    linears = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    phases = {"forward: build", "forward: hand over", "forward: finish"}
    assert linears | phases | {"rms_norm", "rope", "cache+sdpa"} <= ops
    assert ("cache+kernel" in ops) == (
        getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
    )
    assert all(f"{op}@{n}" in timings for op in ops for n in (1, 3))
    assert all(v > 0 for v in timings.values())
    for op in linears:
        assert f"{op:>22s}" in proc.stdout


def test_the_split_verify_meets_one_more_cached_position_each_time():
    """As real cycles do; in a cache of its own, so the forward table's shapes stay fixed."""
    args = cycle_cost.parse_args(
        ["--shape", "tiny", "--block-size", "4", "--prompt-tokens", "8", "--positions", "1"]
    )
    model, tokenizer = cycle_cost.load_target(args)
    bench = cycle_cost.CycleCost(model, tokenizer, cycle_cost.make_draft(args, model), args)
    for grown in range(1, 4):
        assert bench.verify_at_a_new_length() > 0
        assert bench.growing_cache[0].offset == 8 + grown
    assert bench.cache[0].offset == 8


def test_cuda_linear_runs_where_mlx_has_a_gpu_and_says_why_not_elsewhere():
    """benchmarks/cuda_linear.py, a real run: on a GPU both parts, side by side; elsewhere one
    line naming what it needs."""
    script = SCRIPT.parent / "cuda_linear.py"
    args = ["--shape", "tiny", "--rounds", "1", "--reps", "1", "--max-tokens", "24"]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SCRIPT.parent,
    )
    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        assert proc.returncode == 0, proc.stderr
        assert "q_proj" in proc.stdout and "verify forward" in proc.stdout
    else:
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "needs MLX's CUDA backend" in proc.stderr


def test_batched_forward_reports_every_rows_and_positions_pair():
    """benchmarks/batched_forward.py, a real run on random weights: one line per (rows,
    positions) pair, every time positive."""
    script = SCRIPT.parent / "batched_forward.py"
    args = ["--shape", "tiny", "--rows", "1,3", "--positions", "1,2", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--context", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=SCRIPT.parent,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.count("|") == 3]
    pairs = [tuple(map(int, cells[0].split())) for cells in rows[1:]]
    assert pairs == [(1, 1), (1, 2), (3, 1), (3, 2)]
    assert all(float(cells[k].split()[0]) > 0 for cells in rows[1:] for k in (1, 2, 3))
