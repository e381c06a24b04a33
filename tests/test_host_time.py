"""benchmarks/host_time.py: a real run on the tiny shape reports every part of every cycle."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "host_time.py"


def test_the_script_reports_every_part_of_every_cycle(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(SCRIPT), "--shapes", "tiny", "--rounds", "2", "--context", "16"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["tiny"]
    assert set(results["steps"]) == {"chain 16", "tree 8", "block 1"}
    for part in ("drafter graph", "verify graph + verdict", "launch", "settle", "cycle"):
        assert results["ms"][f"chain 16: {part}"] > 0
