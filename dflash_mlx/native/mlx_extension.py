"""MLX extensions of this package: a C kernel and a C++ MLX primitive calling it, bound with
nanobind in MLX's own domain, built once per machine.

Built against the installed wheel's headers and library, cached by `native.py` under a key of
the sources, compilers, flags, nanobind, MLX and Python, with OpenMP where the compiler has it
and on one thread where it has not (`few_rows_quantized.py`, `cpu_attention.py`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from . import native

CXX_FLAGS = ("-O2", "-fPIC", "-fvisibility=hidden", "-DNB_COMPACT_ASSERTIONS")


def _build_commands(
    name: str, c_source: Path, cxx_source: Path, c_flags: tuple[str, ...], openmp: bool
) -> tuple[Path, Callable[[str, str], list[list[str]]]]:
    """Where the extension lives and the compiler command lines that build it (`native.build`)."""
    import nanobind

    nb = Path(nanobind.__file__).parent
    mlx_dir, python = Path(mx.__file__).parent, sysconfig.get_paths()["include"]
    cc, cxx = native.compiler("c"), native.compiler("c++")
    omp = ["-fopenmp"] if openmp else []

    def commands(out: str, scratch: str) -> list[list[str]]:
        kernel, backend, ext = (os.path.join(scratch, f"{n}.o") for n in ("k", "nb", "ext"))
        nb_includes = [f"-I{nb / 'include'}", f"-I{python}"]
        return [
            [cc, *c_flags, *omp, "-c", str(c_source), "-o", kernel],
            [
                cxx,
                *CXX_FLAGS,
                "-std=c++17",
                "-fno-strict-aliasing",
                "-DNB_BUILD",
                *nb_includes,
                f"-I{nb / 'ext' / 'robin_map' / 'include'}",
                "-c",
                str(nb / "src" / "nb_combined.cpp"),
                "-o",
                backend,
            ],  # fmt: skip
            [
                cxx,
                *CXX_FLAGS,
                "-std=c++20",
                "-DNB_DOMAIN=mlx",
                *nb_includes,
                f"-I{mlx_dir / 'include'}",
                "-c",
                str(cxx_source),
                "-o",
                ext,
            ],  # fmt: skip
            [
                cxx,
                "-shared",
                *omp,
                ext,
                backend,
                kernel,
                f"-L{mlx_dir / 'lib'}",
                "-lmlx",
                f"-Wl,-rpath,{mlx_dir / 'lib'}",
                "-o",
                out,
            ],  # fmt: skip
        ]

    key = [c_source.read_text(), cxx_source.read_text(), cc, cxx, *c_flags, *CXX_FLAGS, *omp]
    key += [nanobind.__version__, mx.__version__, str(mlx_dir), sys.version]
    return native.cached_path(name, key), commands


def load(name: str, c_source: Path, cxx_source: Path, c_flags: tuple[str, ...]) -> ModuleType:
    """The extension `_<name>` (its NB_MODULE name) built from these sources, built first where
    it is not yet; RuntimeError with the compiler's last words where it cannot be built."""
    builds = [_build_commands(name, c_source, cxx_source, c_flags, omp) for omp in (True, False)]
    path = next((p for p, _ in builds if p.exists()), None)
    errors = []
    for candidate, commands in builds if path is None else []:
        try:
            native.build(candidate, commands)
            path = candidate
            break
        except RuntimeError as exc:
            errors.append(str(exc))
    if path is None:
        raise RuntimeError(errors[0])
    spec = importlib.util.spec_from_file_location(f"_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_checked(
    name: str,
    c_source: Path,
    cxx_source: Path,
    c_flags: tuple[str, ...],
    disabled_by: str,
    check: Callable[[ModuleType], str | None],
) -> tuple[ModuleType | None, str]:
    """(the extension, "") once built and passing `check` on MLX's CPU stream (which returns
    what is wrong, or None), else (None, why not): turned off by the environment variable
    `disabled_by`, not built, or failing its check."""
    if os.environ.get(disabled_by, "") not in ("", "0"):
        return None, f"disabled by {disabled_by}"
    try:
        ext = load(name, c_source, cxx_source, c_flags)
    except (ImportError, OSError, RuntimeError) as exc:
        return None, f"not built ({exc})"
    try:
        with mx.stream(mx.cpu):
            wrong = check(ext)
    except (TypeError, RuntimeError) as exc:  # TypeError: another nanobind ABI than MLX's
        wrong = f"failed: {exc}"
    return (None, wrong) if wrong else (ext, "")
