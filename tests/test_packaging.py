"""The declared minimum versions are true: every mlx-lm name the package uses exists in the
mlx-lm it declares, and the MLX floors are the ones that mlx-lm needs."""

import ast
import importlib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import dflash_mlx

tomllib = pytest.importorskip("tomllib")

PACKAGE = Path(dflash_mlx.__file__).parent
PYPROJECT = PACKAGE.parent / "pyproject.toml"

# (module, name) -> the first mlx-lm release that has it, read from mlx-lm's release tags and
# the 0.32.0 / 0.32.1 wheels. "0.22.0" stands for "already in 0.22.0", the oldest release of
# the ml-explore/mlx-lm repository (all of these are older than any floor we could declare).
FIRST_RELEASE = {
    ("mlx_lm", "__version__"): "0.22.0",
    ("mlx_lm", "stream_generate"): "0.22.0",
    ("mlx_lm.generate", "BatchGenerator"): "0.28.0",
    ("mlx_lm.generate", "TextStateMachine"): "0.32.0",
    ("mlx_lm.generate", "generation_stream"): "0.24.1",
    ("mlx_lm.generate", "make_text_state_machine"): "0.32.0",
    ("mlx_lm.generate", "wired_limit"): "0.24.1",
    ("mlx_lm.models.activations", "swiglu"): "0.30.4",
    ("mlx_lm.models.base", "create_attention_mask"): "0.24.1",  # with return_array
    ("mlx_lm.models.base", "create_causal_mask"): "0.22.0",
    ("mlx_lm.models.base", "gather_last_axis"): "0.32.1",
    # in the 0.32.0 wheel (older releases not checked: below any floor we declare)
    ("mlx_lm.models.cache", "CacheList"): "0.32.0",
    ("mlx_lm.models.cache", "ChunkedKVCache"): "0.32.0",
    ("mlx_lm.models.deepseek_v41", "LayerCache"): "0.32.0",
    # in the 0.32.1 wheel, the floor we declare (older releases not checked)
    ("mlx_lm.generate", "DEFAULT_QUANTIZED_KV_START"): "0.32.1",
    ("mlx_lm.models.cache", "QuantizedKVCache"): "0.32.1",
    ("mlx_lm.models.deepseek_v32", "DeepseekV32Attention"): "0.32.1",
    ("mlx_lm.models.deepseek_v32", "Indexer"): "0.32.1",
    ("mlx_lm.tuner.utils", "load_adapters"): "0.32.1",
    ("mlx_lm.processors", "PROCESSORS"): "0.32.1",
    ("mlx_lm.processors", "load_processor"): "0.32.1",
    ("mlx_lm.models.base", "scaled_dot_product_attention"): "0.22.0",
    ("mlx_lm.models.cache", "ArraysCache"): "0.26.1",
    ("mlx_lm.models.cache", "BatchKVCache"): "0.28.0",
    ("mlx_lm.models.cache", "KVCache"): "0.22.0",
    ("mlx_lm.models.cache", "RotatingKVCache"): "0.22.0",
    ("mlx_lm.models.cache", "_BaseCache"): "0.22.0",
    ("mlx_lm.models.cache", "make_prompt_cache"): "0.22.0",
    ("mlx_lm.models.rope_utils", "Llama3RoPE"): "0.22.0",
    ("mlx_lm.models.rope_utils", "ProportionalRoPE"): "0.31.2",
    ("mlx_lm.models.rope_utils", "initialize_rope"): "0.22.0",
    ("mlx_lm.sample_utils", "apply_min_p"): "0.22.0",
    ("mlx_lm.sample_utils", "apply_top_k"): "0.22.0",
    ("mlx_lm.sample_utils", "apply_top_p"): "0.22.0",
    ("mlx_lm.sample_utils", "make_logits_processors"): "0.22.0",
    ("mlx_lm.sample_utils", "make_sampler"): "0.22.0",
    ("mlx_lm.server", "ToolCallFormatter"): "0.31.2",
    ("mlx_lm.tokenizer_utils", "StreamingDetokenizer"): "0.22.0",
    ("mlx_lm.tokenizer_utils", "TokenizerWrapper"): "0.22.0",
    ("mlx_lm.utils", "dequantize_model"): "0.22.0",
    ("mlx_lm.utils", "load"): "0.22.0",
    ("mlx_lm.utils", "load_tokenizer"): "0.22.0",
    ("mlx_lm.utils", "save_config"): "0.22.0",
}
# mlx-lm release -> the MLX it requires (its wheel's metadata: `mlx>=` on macOS, `mlx[cpu]>=`,
# `mlx[cuda13]>=` in its extras); ours must be no lower, or pip may pair it with an older one.
MLX_FOR_MLX_LM = {"0.32.1": "0.32.2"}


def mlx_lm_names_used() -> set[tuple[str, str]]:
    """(module, name) for every `from mlx_lm... import name` and `mlx_lm.name` in the package."""
    used = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
                used |= {(node.module, alias.name) for alias in node.names}
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("mlx_lm.")]
                used |= {tuple(m.rsplit(".", 1)) for m in modules}  # (package, submodule)
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "mlx_lm":
                used.add(("mlx_lm", node.attr))
    return used


def declared() -> dict[str, list[Requirement]]:
    """Requirement name -> its requirements in pyproject.toml (dependencies and extras)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    specs = [*project["dependencies"], *project["optional-dependencies"]["cuda"]]
    found: dict[str, list[Requirement]] = {}
    for spec in specs:
        requirement = Requirement(spec)
        found.setdefault(requirement.name, []).append(requirement)
    return found


def floor(requirement: Requirement) -> Version:
    (spec,) = [s for s in requirement.specifier if s.operator == ">="]
    return Version(spec.version)


def test_every_mlx_lm_name_used_is_in_the_declared_mlx_lm():
    used = mlx_lm_names_used()
    unknown = sorted(used - set(FIRST_RELEASE))
    assert not unknown, f"add the first mlx-lm release of {unknown} to FIRST_RELEASE"
    assert not set(FIRST_RELEASE) - used, "FIRST_RELEASE lists names the package no longer uses"
    (mlx_lm,) = declared()["mlx-lm"]
    newer = {pair: v for pair, v in FIRST_RELEASE.items() if Version(v) > floor(mlx_lm)}
    assert not newer, f"pyproject.toml declares {mlx_lm} but the package uses {newer}"
    for module, name in used:  # the table names real things
        assert hasattr(importlib.import_module(module), name)


def test_mlx_floors_are_the_ones_the_declared_mlx_lm_needs():
    (mlx_lm,) = declared()["mlx-lm"]
    assert str(floor(mlx_lm)) in MLX_FOR_MLX_LM, f"add the MLX that {mlx_lm} requires"
    needed = Version(MLX_FOR_MLX_LM[str(floor(mlx_lm))])
    mlx = declared()["mlx"]
    assert {str(r.marker) for r in mlx} == {
        'platform_system == "Darwin"',
        'platform_system != "Darwin"',
        'platform_system == "Linux"',
    }, "MLX on macOS, MLX's CPU build elsewhere, and the cuda extra"
    assert {floor(r) for r in mlx} == {needed}


def test_the_server_page_ships_in_the_package():
    """A non-editable install has the chat page's files: pyproject's package data takes each
    file the page serves, and the page serves each file there is."""
    from dflash_mlx.serve.page import FILES, STATIC

    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["dflash_mlx.serve"]
    shipped = {p.relative_to(STATIC.parent).as_posix() for p in STATIC.iterdir()}
    assert shipped == {f"static/{name}" for name, _ in FILES.values()}
    assert all(any(fnmatch(f, g) for g in globs) for f in shipped), (shipped, globs)
