"""What loading a target and a drafter share: finding the checkpoint, reading its
config, and the dtype it runs in on this device.

Kept apart from `target.py` and `checkpoint.py` so both take these from here and
neither imports the other for them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model

logger = logging.getLogger(__name__)
# The CPU default (float32) keeps a checkpoint's quantization where dequantized weights would
# take more than this share of the machine's memory (benchmarks/README.md, "CPU: float32 or
# kept quantized").
FLOAT32_MEMORY_SHARE = 0.5


def resolve_path(path_or_repo: str | Path, what: str, patterns: list[str]) -> Path:
    """A local directory as is, otherwise a hub snapshot, with an error that says which failed."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_repo)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") != 1
    if looks_local:
        raise FileNotFoundError(f"{what} directory not found: {name}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as exc:
        raise hub_error(exc, what, name) from exc


def hub_error(exc: Exception, what: str, name: str) -> Exception:
    """What a failed hub download means for the user: gated, refused, missing or offline."""
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    if isinstance(exc, errors.GatedRepoError):
        return PermissionError(
            f"{what} '{name}' is a gated repository on the Hugging Face hub: accept its terms "
            "on its page, then log in with a token that may read it (`hf auth login`)"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return FileNotFoundError(
            f"{what} '{name}' was not found on the Hugging Face hub (HTTP {status}); if it is "
            "private, log in with a token that may read it (`hf auth login`)"
        )
    if isinstance(exc, errors.HfHubHTTPError) and status in (401, 403):
        return PermissionError(
            f"the Hugging Face hub refused access to {what} '{name}' (HTTP {status}: {detail}); "
            "check your token (`hf auth login`)"
        )
    if isinstance(exc, errors.LocalEntryNotFoundError | errors.OfflineModeIsEnabled):
        return FileNotFoundError(
            f"{what} '{name}' is not in the local hub cache and the hub could not be reached "
            f"({detail}). If this machine is offline, pass a local directory instead."
        )
    return FileNotFoundError(
        f"could not fetch {what} '{name}' from the Hugging Face hub ({detail})"
    )


def safetensors(path: Path) -> Iterator[tuple[Path, dict[str, mx.array]]]:
    """Each *.safetensors file in `path` and its tensors (read lazily: only those used are
    loaded), or a one-line error."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {path}")
    for file in files:
        try:
            tensors = mx.load(str(file))
        except Exception as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from None
        yield file, tensors


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


KEEP_CHECKPOINT = "checkpoint"  # as a `dtype`: keep the checkpoint's dtype and quantization
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_dtype(dtype: mx.Dtype | str | None) -> mx.Dtype | None:
    """The dtype to cast a loaded model to: `dtype`, its name, the device's default (None),
    or None to keep the checkpoint's dtype and quantization ("checkpoint")."""
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, str):
        if dtype == KEEP_CHECKPOINT:
            return None
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join([*DTYPES, KEEP_CHECKPOINT])}, got {dtype!r}"
            )
        return DTYPES[dtype]
    return dtype


def float32_bytes(model: nn.Module) -> int:
    """What the model's weights would take dequantized to float32."""
    count = sum(p.size for _, p in tree_flatten(model.parameters()))
    for module in model.modules():
        if isinstance(getattr(module, "bits", None), int) and "scales" in module:
            packed, biases = module.weight.size, module.get("biases")
            count += packed * 32 // module.bits - packed - module.scales.size
            count -= 0 if biases is None else biases.size
    return 4 * count


def physical_memory() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_cast(model: nn.Module, dtype: mx.Dtype | None) -> mx.Dtype | None:
    """`dtype` for a model loaded without one, unless that is float32 and its dequantized
    weights would take over `FLOAT32_MEMORY_SHARE` of the machine's memory: then None, the
    checkpoint's dtype and quantization kept (slower on a CPU, but it fits), said once."""
    if dtype is None or dtype != mx.float32:  # MLX's Dtype compares with dtypes alone
        return dtype
    needed, memory = float32_bytes(model), physical_memory()
    if needed <= FLOAT32_MEMORY_SHARE * memory:
        return dtype
    logger.warning(
        f"the target would take {needed / 2**30:.1f} GB in float32, over half of this "
        f"machine's {memory / 2**30:.1f} GB: its checkpoint's dtype and quantization are kept "
        "(dtype='float32' or --dtype float32 dequantizes it anyway)"
    )
    return None


def cast_model(model: nn.Module, dtype: mx.Dtype | None) -> None:
    """Dequantize and cast to `dtype`; `None` keeps the checkpoint's dtype and quantization."""
    if dtype is None:
        return
    dequantize_model(model)
    model.set_dtype(dtype)


def load_checked(
    model: nn.Module, weights: dict[str, mx.array], quantization: dict | None, what: str
) -> None:
    """Load `weights` into `model`, quantized first as `quantization` says where `weights`
    holds a layer's scales, or say in one line which do not fit (`what`: whose weights)."""
    if quantization:
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda name, m: f"{name}.scales" in weights,
        )
    expected = {name for name, _ in tree_flatten(model.parameters())}
    missing = sorted(expected - weights.keys())
    unexpected = sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what} do not match its config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, param in tree_flatten(model.parameters()):
        if param.shape != weights[name].shape:
            raise ValueError(
                f"{what}: {name} has shape {weights[name].shape}, config implies {param.shape}"
            )
    model.load_weights(list(weights.items()))
