"""Outputs staged beside their destination (`staging.py`): what a killed writer left goes
with the next write to the same destination, and what a live one is writing stays."""

import socket
import subprocess
import sys

from dflash_mlx.cli.convert import convert_draft


def dead_pid() -> int:
    """The id of a process that has ended."""
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    return ended.pid


def staged_by(out, pid: int, suffix: str):
    """The name a writer of `out` with process id `pid` (on this host) stages it under."""
    return out.with_name(f".{out.name}.partial-{socket.gethostname()}-{pid}{suffix}")


def test_convert_removes_what_a_killed_conversion_left(make_pair, tmp_path):
    _, draft_dir = make_pair("llama-tied-gqa")
    out = tmp_path / "converted"
    killed = dead_pid()
    left = [staged_by(out, killed, "-0123456789ab"), staged_by(out, killed, "-0123456789ab-old")]
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        writing = staged_by(out, live.pid, "-ba9876543210")
        for staged in [*left, writing]:
            staged.mkdir()
            (staged / "model.safetensors").write_bytes(b"half a drafter")
        convert_draft(draft_dir, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, writing.name])
    finally:
        live.kill()
        live.wait()
