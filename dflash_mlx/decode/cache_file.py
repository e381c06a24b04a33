"""Prompt caches on disk: a long prompt (a document, a system prompt) prefilled once and
reused by later runs, as `mlx_lm.cache_prompt` does, with the drafter's caches beside
the target's in one `.safetensors` file.

A cache is only right for the weights that made it, so the file names them by a
fingerprint (`fingerprint`: every weight's name, shape and dtype and a few of its
values) and `load_prompt_cache` refuses it for any other target or drafter. Each cache
(each of a `CacheGroup`'s on its own) is saved as its attributes (arrays, lists of
arrays, numbers, strings) and restored into a fresh cache of the same class made for
the model, so every cache class the targets use (mlx-lm's and `models/rollback.py`'s)
round-trips without a table of them.

A file comes from elsewhere (another run, a copy, a download), so nothing in it is used
before it is checked. It must be a regular file (a named pipe would block the read for
ever) whose tensors each have bytes of their own inside it. Its `digest` (SHA-256 over the
other metadata and every tensor's name, dtype, shape and bytes, written by
`save_prompt_cache`) must match: a value changed with the same dtype and shape, a token list
or cache options rewritten would load and silently give another reply. Then it is checked
against what the loaded models' own caches hold after one token: the same fields, arrays of
the same dtype and shape but for the positions, the same settings (a window's size), and as
many positions held as it has tokens. A file without a digest was written by an older
version: nothing proves it whole, so it is refused with the line to make it again.

The caches are made with the cache options the file records (`max_kv_size`, `kv_bits`,
`kv_group_size`, `quantized_kv_start`, as `make_prompt_cache` takes them): like mlx-lm's, a
prompt cache keeps the options it was made with.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..models.draft import DFlashDraft
from ..models.mtp import MTPDraft
from ..models.rollback import QuantizingKVCache, cache_parts
from ..models.target import TargetAdapter
from ..staging import remove_stale, staging_path
from .prompt_cache import CACHE_SETTINGS, PromptCache, make_prompt_cache
from .settings import GenerationSettings, is_int

FORMAT = "dflash-mlx prompt cache 1"
METADATA = ("format", "model", "draft", "tokens", "layout", "options", "digest")
DEFAULT_OPTIONS = GenerationSettings().cache_options
SCALARS = (int, float, bool, str, type(None))
REMAKE = "make it again with dflash-mlx cache-prompt"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header
# How many of its first positions a cache with keys and values no longer holds: a chunk's
# (mlx-lm's `ChunkedKVCache`) and a sliding window's (`rollback.WindowKVCache`) attributes.
DROPPED = ("start_position", "dropped")
# A cache's numbers that count positions; any other is a setting of the model's caches.
COUNTERS = ("offset", *DROPPED)
# The fields whose arrays (or a quantized cache's packed arrays, scales and biases) run over
# positions, on the second last axis.
POSITIONED = ("keys", "values")


class PromptCacheError(ValueError):
    """A file that is no prompt cache for the loaded target and drafter (one line: why)."""


def fingerprint(module: nn.Module | None) -> str:
    """What tells one model's weights from another's, cheaply ("" for no drafter)."""
    if module is None:
        return ""
    params = tree_flatten(module.parameters())
    samples = [p.reshape(-1)[:16].astype(mx.float32) for _, p in params]
    mx.eval(samples)
    digest = hashlib.sha256()
    for (name, p), sample in zip(params, samples):
        digest.update(f"{name}{p.shape}{p.dtype}".encode())
        digest.update(np.asarray(sample).tobytes())
    return digest.hexdigest()[:32]


def digest(arrays: dict[str, mx.array], metadata: dict[str, str]) -> str:
    """SHA-256 over `metadata` (but its digest) and every array's name, dtype, shape and bytes:
    what proves a file whole."""
    hashed = hashlib.sha256()
    described = {name: value for name, value in metadata.items() if name != "digest"}
    hashed.update(json.dumps(described, sort_keys=True).encode())
    for name in sorted(arrays):
        array = arrays[name]
        hashed.update(json.dumps([name, str(array.dtype), array.shape]).encode())
        hashed.update(np.asarray(array.reshape(-1).view(mx.uint8)).tobytes())
    return hashed.hexdigest()


def _fields(cache: Any, key: str, arrays: dict[str, mx.array]) -> dict[str, list]:
    """`cache`'s attributes as JSON-able tags, its arrays added to `arrays` under `key`.
    Anything else (a rollback's snapshot of the last forward) is not state to keep."""
    fields = {}
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            arrays[f"{key}.{name}"] = value
            fields[name] = ["array"]
        elif isinstance(value, list | tuple) and all(
            v is None or isinstance(v, mx.array) for v in value
        ):
            for i, v in enumerate(value):
                if v is not None:
                    arrays[f"{key}.{name}.{i}"] = v
            fields[name] = ["arrays", [v is not None for v in value]]
        elif isinstance(value, SCALARS):
            fields[name] = ["value", value]
    return fields


def _keyed(cache: PromptCache) -> list[tuple[str, Any]]:
    """(key, cache) for every cache a file keeps, each of a `CacheGroup`'s on its own."""
    parts = (("target", cache_parts(cache.target)), ("draft", cache.draft))
    return [(f"{part}.{i}", c) for part, caches in parts for i, c in enumerate(caches)]


def save_prompt_cache(
    path: str | Path,
    cache: PromptCache,
    model: nn.Module,
    draft: DFlashDraft | None,
    options: dict[str, Any] | None = None,
) -> None:
    """Write `cache` (made with `model`, `draft` and the cache `options` given to
    `make_prompt_cache`, the defaults for those left out) to exactly `path`, atomically."""
    _check_drafter(draft)
    arrays: dict[str, mx.array] = {}
    layout = [
        {"class": type(c).__name__, "fields": _fields(c, key, arrays)} for key, c in _keyed(cache)
    ]
    metadata = {
        "format": FORMAT,
        "model": fingerprint(model),
        "draft": fingerprint(draft),
        "tokens": json.dumps(cache.tokens),
        "layout": json.dumps(layout),
        "options": json.dumps({**DEFAULT_OPTIONS, **(options or {})}),
    }
    metadata["digest"] = digest(arrays, metadata)
    path = Path(path)
    remove_stale(path)  # what a killed run left
    staged = staging_path(path, ".safetensors")  # a name without it would get it appended
    try:
        mx.save_safetensors(str(staged), arrays, metadata)
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def load_prompt_cache(
    path: str | Path,
    model: nn.Module,
    draft: DFlashDraft | None,
    asked: dict[str, Any] | None = None,
) -> PromptCache:
    """The prompt cache saved at `path`, made with the cache options it records, or a
    one-line `PromptCacheError` if it is not one, was made for another target or drafter,
    holds anything their caches would not, or was made with other options than `asked`
    sets (those left at their defaults are the file's)."""
    _check_drafter(draft)
    _check_file(path)
    try:
        arrays, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise _unreadable(path, str(exc)) from None
    _check_metadata(path, metadata, arrays, model, draft)
    tokens = _tokens(path, metadata, TargetAdapter(model).vocab_size)
    options = _options(path, metadata)
    _check_asked(path, options, asked or {})
    cache, probe = _made(path, model, draft, options), _probe(model, draft, options)
    layout = _layout(path, metadata, cache)
    used: set[str] = set()
    for (key, c), (_, reference), entry in zip(_keyed(cache), _keyed(probe), layout):
        _as_in_file(c, entry)
        _as_in_file(reference, entry)
        _restore(path, key, c, reference, entry, arrays, used)
        if c.offset != len(tokens):
            raise _corrupt(path, f"{key} holds {c.offset} positions for {len(tokens)} tokens")
        _check_held(path, key, c)
    if unknown := sorted(set(arrays) - used):
        raise _corrupt(path, f"an unknown tensor {unknown[0]!r}")
    cache.tokens = tokens
    return cache


def _check_drafter(draft: nn.Module | None) -> None:
    """Refuse the MTP layers in one line: their caches wait on the reply's tokens, which a
    file does not lay out for them yet."""
    if isinstance(draft, MTPDraft):
        raise ValueError(
            "prompt cache files do not keep the MTP layers' caches: leave out "
            "--prompt-cache-file with --draft mtp"
        )


def _corrupt(path: str | Path, problem: str) -> PromptCacheError:
    return PromptCacheError(f"{path} is not a prompt cache as written: {problem} ({REMAKE})")


def _check_file(path: str | Path) -> None:
    """Refuse at once what is not a regular file (a named pipe would block the read for ever),
    and a safetensors header whose tensors share bytes or lie outside the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe opens without a writer
    except OSError as exc:
        raise _unreadable(path, exc.strerror) from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise PromptCacheError(f"{path} is not a regular file, so no prompt cache")
    with os.fdopen(fd, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if not 0 < length <= min(MAX_HEADER_BYTES, status.st_size - 8):
            raise _unreadable(path, "no safetensors header fits in it")
        try:
            header = json.loads(file.read(length))
        except (ValueError, RecursionError):
            raise _unreadable(path, "its safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise _unreadable(path, "its safetensors header is not a table of tensors")
    data = status.st_size - 8 - length
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets))):
            raise _unreadable(path, f"its header does not place the tensor {name!r}")
        if not 0 <= offsets[0] <= offsets[1] <= data:
            raise _unreadable(path, f"the tensor {name!r} lies outside the file")
        spans.append((*offsets, name))
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise _unreadable(path, f"the tensors {first!r} and {second!r} share bytes")


def _unreadable(path: str | Path, why: str) -> PromptCacheError:
    return PromptCacheError(f"{path}: cannot read a prompt cache from it ({why})")


def _check_metadata(
    path: str | Path,
    metadata: dict[str, str],
    arrays: dict[str, mx.array],
    model: nn.Module,
    draft: DFlashDraft | None,
) -> None:
    if metadata.get("format") != FORMAT:
        raise PromptCacheError(f"{path} is not a dflash-mlx prompt cache (dflash-mlx cache-prompt)")
    if "digest" not in metadata:
        raise PromptCacheError(
            f"{path} was written by an older dflash-mlx, without the digest that proves a file "
            f"whole: {REMAKE}"
        )
    if missing := [name for name in METADATA if name not in metadata]:
        raise _corrupt(path, f"no {missing[0]!r} field")
    if unknown := sorted(set(metadata) - set(METADATA)):
        raise _corrupt(path, f"an unknown field {unknown[0]!r}")
    if metadata["digest"] != digest(arrays, metadata):
        raise _corrupt(path, "its contents do not match its digest (changed after it was written)")
    if metadata["model"] != fingerprint(model):
        raise PromptCacheError(f"{path} was made for another target model (or another dtype)")
    if metadata["draft"] != fingerprint(draft):
        made_with = "another drafter" if metadata["draft"] else "no drafter"
        raise PromptCacheError(
            f"{path} was made with {made_with}: give the drafter it was made with"
        )


def _json(path: str | Path, metadata: dict[str, str], name: str) -> Any:
    try:
        return json.loads(metadata[name])
    except json.JSONDecodeError:
        raise _corrupt(path, f"its {name!r} field is not JSON") from None
    except RecursionError:
        raise _corrupt(path, f"its {name!r} field is nested too deeply") from None


def _tokens(path: str | Path, metadata: dict[str, str], vocab_size: int) -> list[int]:
    tokens = _json(path, metadata, "tokens")
    if not isinstance(tokens, list) or not tokens:
        raise _corrupt(path, "its 'tokens' field is no list of tokens")
    if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise _corrupt(path, f"its tokens are not all ids of this model's (0 to {vocab_size - 1})")
    return tokens


def _options(path: str | Path, metadata: dict[str, str]) -> dict[str, Any]:
    """The cache options the file's caches were made with, checked as `stream_generate`
    checks them."""
    options = _json(path, metadata, "options")
    if not isinstance(options, dict) or set(options) != set(CACHE_SETTINGS):
        raise _corrupt(path, f"its 'options' field does not name the options {CACHE_SETTINGS}")
    try:
        GenerationSettings(**options)
    except ValueError as exc:
        raise _corrupt(path, f"its cache options: {exc}") from None
    return options


def _check_asked(path: str | Path, options: dict[str, Any], asked: dict[str, Any]) -> None:
    """Refuse cache options asked for beside the file that are not its own, as mlx-lm's
    generate refuses another `--kv-bits` than its prompt cache's: a cache is made once."""
    for name, value in asked.items():
        if value not in (DEFAULT_OPTIONS[name], options[name]):
            flag = "--" + name.replace("_", "-")
            raise PromptCacheError(
                f"{path} was made with {name}={options[name]!r}, not {value!r}: leave out "
                f"{flag} (the file's cache options are used), or make the file with it"
            )


def _made(
    path: str | Path, model: nn.Module, draft: DFlashDraft | None, options: dict[str, Any]
) -> PromptCache:
    """Fresh caches made with the file's `options` (which may not fit these models)."""
    try:
        return make_prompt_cache(model, draft, **options)
    except ValueError as exc:
        raise _corrupt(path, f"its cache options: {exc}") from None


def _as_in_file(cache: Any, entry: Any) -> None:
    """Quantize `cache` if it is a `QuantizingKVCache` that the file's `entry` records
    quantized (its fields have the quantization's `bits`)."""
    fields = entry.get("fields") if isinstance(entry, dict) else None
    if isinstance(cache, QuantizingKVCache) and isinstance(fields, dict) and "bits" in fields:
        cache.quantize()


def _layout(path: str | Path, metadata: dict[str, str], cache: PromptCache) -> list:
    """The file's layout, one entry per cache of `cache` and of the same class."""
    layout = _json(path, metadata, "layout")
    classes = [type(c).__name__ for _, c in _keyed(cache)]
    if not isinstance(layout, list) or classes != [
        entry.get("class") if isinstance(entry, dict) else None for entry in layout
    ]:
        raise PromptCacheError(f"{path} holds other caches than this model makes")
    return layout


def _probe(model: nn.Module, draft: DFlashDraft | None, options: dict[str, Any]) -> PromptCache:
    """Fresh caches after one token: what the models' own caches hold, for a file's to match.
    Only what feeds the caches is evaluated (the drafter gets zero features)."""
    probe = make_prompt_cache(model, draft, **options)
    target = TargetAdapter(model)
    target.model(mx.array([[0]]), cache=probe.target)
    if draft is not None:
        width = len(draft.config.target_layer_ids) * draft.config.hidden_size
        hidden = target.embed_tokens(mx.array([0])).dtype
        draft.append_context(mx.zeros((1, 1, width), dtype=hidden), [probe.draft])
    mx.eval([c.state for _, c in _keyed(probe)])
    return probe


def _restore(
    path: str | Path,
    key: str,
    cache: Any,
    reference: Any,
    entry: dict,
    arrays: dict[str, mx.array],
    used: set[str],
) -> None:
    """Set the fresh `cache` to the fields `entry` records, each checked against the same
    field of `reference` (the probe's cache) before it is set."""
    fields = entry.get("fields")
    if set(entry) != {"class", "fields"} or not isinstance(fields, dict):
        raise _corrupt(path, f"the layout of {key} is not a class and its fields")
    fresh, probed = vars(cache), vars(reference)
    dtypes = {a.dtype for _, a in tree_flatten(probed) if isinstance(a, mx.array)}
    for name, tag in fields.items():
        if name not in fresh:
            raise _corrupt(path, f"{key} has a field {name!r} its {type(cache).__name__} has not")
        value = _value(path, f"{key}.{name}", tag, arrays, used)
        _check_field(path, f"{key}.{name}", value, fresh[name], probed.get(name), dtypes)
        setattr(cache, name, tuple(value) if isinstance(probed.get(name), tuple) else value)
    for name, expected in probed.items():
        if _holds_arrays(expected) and not _holds_arrays(getattr(cache, name)):
            raise _corrupt(path, f"{key} has no {name!r}")


def _value(path: str | Path, name: str, tag: Any, arrays: dict[str, mx.array], used: set[str]):
    """The value `tag` records for field `name`: its arrays taken from `arrays` (into `used`)."""
    kind, *rest = tag if isinstance(tag, list) and tag else [None]
    if kind == "value" and len(rest) == 1 and isinstance(rest[0], SCALARS):
        return rest[0]
    if kind == "array" and not rest:
        names = [name]
    elif kind == "arrays" and len(rest) == 1 and isinstance(rest[0], list):
        names = [f"{name}.{i}" if kept is True else None for i, kept in enumerate(rest[0])]
    else:
        raise _corrupt(path, f"the field {name} is recorded as {tag!r}")
    if missing := [n for n in names if n is not None and n not in arrays]:
        raise _corrupt(path, f"no tensor {missing[0]!r}")
    used.update(n for n in names if n is not None)
    if kind == "array":
        return arrays[name]
    return [None if n is None else arrays[n] for n in names]


def _holds_arrays(value: Any) -> bool:
    return isinstance(value, mx.array) or (
        isinstance(value, list | tuple) and any(isinstance(v, mx.array) for v in value)
    )


def _check_field(
    path: str | Path, name: str, value: Any, fresh: Any, probed: Any, dtypes: set[mx.Dtype]
) -> None:
    """`value` fits what the model's cache holds in field `name`: `probed` after one token,
    `fresh` before any (a setting, such as a window's size, is as the model makes it)."""
    if isinstance(probed, list | tuple):
        if not isinstance(value, list) or len(value) != len(probed):
            raise _corrupt(path, f"{name} is not {len(probed)} arrays")
        positions = name.rpartition(".")[2] in POSITIONED
        for i, (v, p) in enumerate(zip(value, probed)):
            _check_array(path, f"{name}.{i}", v, p, positions)
    elif isinstance(probed, mx.array):
        _check_array(path, name, value, probed, positions=True)
    elif fresh is None and isinstance(value, mx.array):  # only a longer prompt fills it
        if value.dtype not in dtypes:
            raise _corrupt(path, f"{name} is {_described(value)}, not of this model's dtype")
    elif type(value) is not type(fresh):
        raise _corrupt(path, f"{name} is {value!r}, not of type {type(fresh).__name__}")
    elif name.rpartition(".")[2] in COUNTERS:
        if value < 0:
            raise _corrupt(path, f"{name} is {value!r}")
    elif value != fresh:
        raise _corrupt(path, f"{name} is {value!r} where this model's is {fresh!r}")


def _check_array(path: str | Path, name: str, value: Any, probed: Any, positions: bool) -> None:
    """`value` has `probed`'s dtype and shape, but for the positions axis (the second last,
    as in mlx-lm's (batch, heads, positions, head dim) keys) if `positions`."""
    if probed is None or value is None:
        if (probed is None) != (value is None):
            raise _corrupt(path, f"{name} is {'not ' if value is None else ''}empty")
        return
    if not isinstance(value, mx.array):
        raise _corrupt(path, f"{name} is not an array")
    shape, expected = list(value.shape), list(probed.shape)
    if positions and len(shape) == len(expected) > 1:
        shape[-2] = expected[-2]
    if value.dtype != probed.dtype or shape != expected:
        raise _corrupt(
            path,
            f"{name} is {_described(value)} where this model's caches hold {_described(probed)}",
        )


def _described(array: mx.array) -> str:
    return f"{str(array.dtype).removeprefix('mlx.core.')} {tuple(array.shape)}"


def _check_held(path: str | Path, key: str, cache: Any) -> None:
    """A cache with keys and values (mlx-lm's protocol) holds every position from its first
    to its offset (the positions a window or a chunk has dropped are not held), and one
    quantized from a position on holds at least that many."""
    first = sum(getattr(cache, name, 0) for name in DROPPED)
    if first > cache.offset:
        raise _corrupt(path, f"{key} starts at position {first}, after its last")
    if isinstance(cache, QuantizingKVCache) and cache.quantized:
        if cache.offset < (start := cache.quantization[2]):
            raise _corrupt(path, f"{key} is quantized from position {start} but holds fewer")
    needed = cache.offset - first
    for name in POSITIONED:
        held = getattr(cache, name, None)
        held = held[0] if isinstance(held, tuple) else held  # quantized: the packed values
        if isinstance(held, mx.array) and held.shape[-2] < needed:
            raise _corrupt(path, f"{key}.{name} holds {held.shape[-2]} of {needed} positions")
