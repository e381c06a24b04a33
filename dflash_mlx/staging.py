"""Outputs written beside their destination under a temporary name and renamed into place
once complete, so that a failed or killed write never leaves a half-written output.

The temporary name carries the writer's host and process id: a later write to the same
destination removes what a killed writer left, and never what a live one is still writing.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
from pathlib import Path

MARK = ".partial"


def _prefix(out: Path) -> str:
    return f".{out.name}{MARK}-{socket.gethostname()}-"


def staging_path(out: Path, suffix: str = "") -> Path:
    """Where this process writes `out` before renaming it into place (hidden, beside it)."""
    return out.with_name(f"{_prefix(out)}{os.getpid()}{suffix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(out: Path) -> None:
    """Remove what writers of `out` on this host left when they were killed."""
    prefix = _prefix(out)
    for path in out.parent.glob(glob.escape(prefix) + "*"):
        pid = re.match(r"\d+", path.name[len(prefix) :])
        if pid is None or _alive(int(pid.group())):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
