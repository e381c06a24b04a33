"""Primitives of the drafter's graphs in one cycle: its forward and head with a chain's choice
or a tree's ranking, and its context append after the verdict.

    python benchmarks/drafter_primitives.py                  # Qwen3-8B's drafter shape
    python benchmarks/drafter_primitives.py --shape qwen3-4b --context 1024

Each primitive is work the host does twice: once to build it, once to dispatch it when the
graph is evaluated (a GPU kernel launch, or a CPU loop of its own). The graphs are built as
a cycle builds them on this machine's default device (`proposers.chains`, `proposers.trees`,
`proposers.observe`) and walked from their outputs (`mx.export_to_dot`). The drafter has
the shape's drafter layers and width (`cycle_cost.SHAPES`, `DRAFT_LAYERS`, bf16) and its
weights and caches are evaluated first, so only the cycle's own primitives count; the target
is the shape with 2 layers and a 4,096-token vocabulary (only its embedding and head are in
these graphs).
"""

from __future__ import annotations

import argparse
import importlib
import re
import tempfile

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx

# isort: on

from cycle_cost import DRAFT_LAYERS, SHAPES

from dflash_mlx.decode import proposers
from dflash_mlx.decode.proposers import DrafterProposer, LookupProposer
from dflash_mlx.decode.settings import GenerationSettings
from dflash_mlx.models.checkpoint import init_draft
from dflash_mlx.models.target import TargetAdapter


def primitives(*outputs: mx.array) -> int:
    """How many primitives the graph of `outputs` holds (evaluated arrays hold none)."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return len(re.findall(r'label ="[A-Za-z]', open(f.name).read()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=list(DRAFT_LAYERS))
    parser.add_argument("--context", type=int, default=512, help="positions the cache holds")
    args = parser.parse_args()
    config = dict(SHAPES[args.shape], num_hidden_layers=2, vocab_size=4096)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    draft = init_draft(model, num_layers=DRAFT_LAYERS[args.shape], block_size=16, seed=1)
    model.set_dtype(mx.bfloat16)
    draft.set_dtype(mx.bfloat16)
    mx.eval(model.parameters(), draft.parameters())
    cache = draft.make_cache()
    width = len(draft.config.target_layer_ids) * config["hidden_size"]
    draft.append_context(mx.zeros((1, args.context + 8, width), mx.bfloat16), [cache])
    for c in cache:
        c.trim(8)  # room for the append below, as between two of the cache's growths
    mx.eval([a for c in cache for a in (c.keys, c.values)])
    verifier = GenerationSettings().verifier.for_reply()
    drafter = DrafterProposer(draft, TargetAdapter(model), cache, verifier.propose)
    repeating = LookupProposer([*range(40), *range(40), 5], drafter)  # its chain: 8 tokens
    root = mx.array([5])
    counts = {}
    ((drafts, _),) = proposers.chains([proposers.ChainRequest(drafter, root, 15)])
    counts["chain of 16: forward, head, choice"] = primitives(drafts)
    for name, proposer in (("", drafter), (", the lookup's chain grafted", repeating)):
        (tree,) = proposers.trees([proposers.TreeRequest(proposer, root, 8, 8)])
        counts[f"tree of 8: forward, head, ranking{name}"] = primitives(*tree.parts())
    proposers.observe([drafter], mx.zeros((1, 9, width), mx.bfloat16), [3])
    counts["context append of 3 positions"] = primitives(
        *[a for c in cache for a in (c.keys, c.values)]
    )
    layers = DRAFT_LAYERS[args.shape]
    print(f"{args.shape}'s drafter ({layers} layers), bf16, {mx.default_device()}:")
    for name, count in counts.items():
        print(f"  {name:<62} {count:5d}")


if __name__ == "__main__":
    main()
