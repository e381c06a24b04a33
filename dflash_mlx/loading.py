"""What loading a target and a drafter share: finding the checkpoint, reading its
config, and the dtype it runs in on this device.

Kept apart from `target.py` and `checkpoint.py` so both take these from here and
neither imports the other for them.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model


def resolve_path(path_or_repo: str | Path, what: str, patterns: list[str]) -> Path:
    """A local directory as is, otherwise a hub snapshot, with an error that says which failed."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_repo)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"{what} directory not found: {name}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as exc:  # the hub client raises many types; all mean "not available"
        raise FileNotFoundError(
            f"could not fetch {what} '{name}' from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "If this machine is offline, pass a local directory instead."
        ) from None


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None


def dtype_for_device(device_type: mx.DeviceType) -> mx.Dtype | None:
    """float32 on the CPU, where bf16 and quantized matmuls are not BLAS-accelerated;
    `None` (keep the checkpoint's dtype and quantization) on a GPU, Metal or CUDA."""
    return None if device_type == mx.gpu else mx.float32


def default_dtype() -> mx.Dtype | None:
    """`dtype_for_device` for the device MLX runs on by default."""
    return dtype_for_device(mx.default_device().type)


def cast_model(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """Dequantize and cast to `dtype`; `None` keeps the checkpoint's dtype and quantization."""
    if dtype is None:
        return
    dequantize_model(model)
    model.set_dtype(dtype)
