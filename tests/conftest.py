import json
import os
import sys
from pathlib import Path

import pytest

# No test may reach the real hub: where packets are dropped a look-up hangs to its timeout.
# Set before anything imports huggingface_hub (it reads the variable once); subprocesses inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"

import dflash_mlx  # noqa: E402  (binds the system BLAS before anything imports mlx)

sys.path.insert(0, str(Path(__file__).parent))

import helpers  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.cuda` tests run only where MLX's CUDA backend has a GPU."""
    import mlx.core as mx

    if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (MLX's CUDA backend)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


TARGETS = {
    "llama-tied-gqa": dict(family="llama", tied=True, heads=4, kv_heads=2),
    "llama-untied-mha": dict(family="llama", tied=False, heads=4, kv_heads=4, seed=3),
    "qwen3-tied-gqa": dict(family="qwen3", tied=True, heads=4, kv_heads=1, bos=False, seed=5),
    "qwen3-untied-mha": dict(family="qwen3", tied=False, heads=2, kv_heads=2, seed=7),
    # llama-tied-gqa's weights with a tool-calling chat template (helpers.TOOL_CHAT_TEMPLATE)
    "llama-tools": dict(family="llama", tied=True, heads=4, kv_heads=2, tools=True),
}


@pytest.fixture(scope="session")
def make_pair(workdir):
    """(target dir, drafter dir) for a named target variant, built once per session."""
    built = {}

    def make(name: str):
        if name not in built:
            target = helpers.save_target(workdir / name, **TARGETS[name])
            draft = helpers.save_draft(
                workdir / f"{name}-draft", helpers.read_config(target), target_layer_ids=[1, 3]
            )
            built[name] = (target, draft)
        return built[name]

    return make


@pytest.fixture(scope="session")
def no_template_pair(make_pair, workdir):
    """llama-tied-gqa's target and drafter, the target's tokenizer without a chat template."""
    target, draft = make_pair("llama-tied-gqa")
    bare = helpers.copy_dir(target, workdir / "llama-no-chat-template")
    config = json.loads((target / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    return bare, draft


@pytest.fixture(scope="session")
def loaded(make_pair):
    """Loaded (model, tokenizer, draft) per target variant, cached for the session."""
    cache = {}

    def get(name: str):
        if name not in cache:
            target, draft = make_pair(name)
            model, tokenizer = dflash_mlx.load(target)
            cache[name] = (model, tokenizer, dflash_mlx.load_draft(draft))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def train_target_dir(workdir):
    """The test helper's target with its matrices scaled down (as in test_train's
    `test_a_few_hundred_steps_raise_tau`): its replies then have structure to learn."""
    import mlx.core as mx

    path = helpers.save_target(workdir / "train-target-scaled")
    weights = mx.load(str(path / "model.safetensors"))
    scaled = {k: v * 0.6 if v.ndim == 2 and "embed" not in k else v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), scaled)
    return path


@pytest.fixture(scope="session")
def train_data(train_target_dir, tmp_path_factory):
    """A `train` work dir with the target's replies to 64 prompts (one feature chunk) and
    their features of `helpers.TRAIN_TAPS`; tests train in copies (`helpers.train_work`)."""
    from dflash_mlx import cli

    work = tmp_path_factory.mktemp("train-data")
    common = ["--model", str(train_target_dir), "--work", str(work)]
    data = ["--num-prompts", "64", "--max-tokens", "12", "--batch-size", "64"]
    cli.main(["train", "data", *common, *data])
    cli.main(["train", "features", *common, "--taps", ",".join(map(str, helpers.TRAIN_TAPS))])
    return work


@pytest.fixture
def launched(monkeypatch):
    """Each cycle launched meanwhile, as (its rows, which rows were trees, which of those
    held the prompt lookup's grafts)."""
    from dflash_mlx.decode import cycle
    from dflash_mlx.decode.cycle import TreeRow
    from dflash_mlx.decode.proposers import LookupProposer

    seen = []
    launch = cycle.launch

    def recorded(rows):
        pending = launch(rows)
        trees = [isinstance(row, TreeRow) and len(row.tree) > 1 for row in pending.rows]
        grafted = [
            isinstance(row.reply.state.proposer, LookupProposer)
            and isinstance(row, TreeRow)
            and any(node >= 0 for node in row.tree.chain.tolist())
            for row in pending.rows
        ]
        seen.append((len(pending.rows), trees, grafted))
        return pending

    monkeypatch.setattr(cycle, "launch", recorded)
    return seen
