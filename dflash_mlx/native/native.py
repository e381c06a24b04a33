"""Native code built once per machine with the system compiler, cached by what went into it.

A leaf module (no mlx import): `blas.py` builds its kernel before mlx is first imported.
Each build is keyed by its sources, compiler, flags and this CPU's features (a shared cache
may serve several CPUs), and written atomically, so concurrent imports see all of a
library or none of it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..paths import cache_dir


def compiler(language: str = "c") -> str:
    """The system C (`$CC`, cc, gcc) or C++ (`$CXX`, c++, g++) compiler."""
    names = ("CC", "cc", "gcc") if language == "c" else ("CXX", "c++", "g++")
    found = os.environ.get(names[0]) or shutil.which(names[1]) or shutil.which(names[2])
    if found is None:
        raise RuntimeError(f"no {'C' if language == 'c' else 'C++'} compiler ({names[1]}) found")
    return found


def cpu_features() -> str:
    """This CPU's feature line from /proc/cpuinfo ("" where there is none)."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    return next((ln for ln in open("/proc/cpuinfo") if ln.startswith(("flags", "Features"))), "")


HEADERS = (Path(__file__).with_name("threads.h"),)  # included by every kernel's C source


def cached_path(name: str, key: list[str]) -> Path:
    """Where the library `name` built from `key` (sources, compiler, flags) and the shared
    `HEADERS` lives for this CPU."""
    headers = [h.read_text() for h in HEADERS]
    text = "\0".join([*key, *headers, platform.machine(), cpu_features()])
    return cache_dir() / "kernels" / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"


def build(path: Path, commands: Callable[[str, str], list[list[str]]]) -> None:
    """Run `commands(out, scratch)` (compiler command lines that write the library `out`,
    with a scratch directory for objects) and move `out` to `path`; RuntimeError with the
    compiler's last words if one fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a build takes seconds: said, so the first run's wait is not a silent one
    name = path.stem.rsplit("-", 1)[0]
    print(f"dflash-mlx: building the {name} kernel for this machine (once)...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        out = os.path.join(scratch, path.name)
        for command in commands(out, scratch):
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{command[0]} failed: {done.stderr.strip()[-300:]}")
        os.replace(out, path)  # atomic: a concurrent import sees all of it or nothing
