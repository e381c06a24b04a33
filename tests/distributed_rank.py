"""One rank of the tests of tensor and pipeline parallelism, started by test_distributed.py;
each rank pays its imports once for three checks and prints one JSON line:

python distributed_rank.py TARGET DRAFT

sample    tokens of TARGET (sharded) sampled at temperature 1, and the seed they were drawn with
qwen3_5   greedy tokens of a tiny qwen3_5 (LM head sharded over the vocabulary), no EOS,
          TARGET's tokenizer
pipeline  the same, its layers split over the ranks (pipeline parallel), the drafter tapping
          layers on different ranks, and what the drafter saw
"""

import json
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

sys.path.insert(0, str(Path(__file__).parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import load_tokenizer  # noqa: E402
from test_families import GATED_DELTA, PROMPT, build  # noqa: E402

from dflash_mlx import load, load_draft, stream_generate  # noqa: E402
from dflash_mlx.models.checkpoint import init_draft  # noqa: E402
from dflash_mlx.models.distributed import shared_seed, world_group  # noqa: E402
from dflash_mlx.models.target import TargetAdapter, pipeline, shard  # noqa: E402

MAX_TOKENS = 24
QWEN3_5_UNTIED = dict(text_config=dict(GATED_DELTA, tie_word_embeddings=False))
DRAFT_VOCAB = list(range(0, 320, 3))  # through the vocabulary-sharded head: masked, not sliced
SAMPLED = dict(block_size=4, temperature=1.0)
TAPPED = [1, 3]  # split over 2 pipeline ranks: rank 1 holds layers 0-1, rank 0 layers 2-4


def tapped_features(model) -> list[float]:
    """Per prompt position, the sum of what the drafter sees: the TAPPED layers' outputs."""
    features = TargetAdapter(model).forward(mx.array(PROMPT)[None], None, taps=TAPPED).features
    return features.sum(axis=-1)[0].tolist()


def tokens_of(model, draft, tokenizer, prompt, **kwargs) -> list[int]:
    responses = stream_generate(model, draft, tokenizer, prompt, max_tokens=MAX_TOKENS, **kwargs)
    return [t for r in responses for t in r.tokens]


def sampled(group, target: str, draft_dir: str) -> dict:
    model, tokenizer = load(target, tensor_group=group)
    draft = load_draft(draft_dir)  # before seeding: loading may draw from the generator
    seed = shared_seed(None, group)
    mx.random.seed(seed)
    return {"seed": seed, "tokens": tokens_of(model, draft, tokenizer, PROMPT, **SAMPLED)}


def qwen3_5_greedy(group, tokenizer, mode: str) -> dict:
    model = build("qwen3_5", fields=QWEN3_5_UNTIED)
    draft = init_draft(model, num_layers=2, block_size=4)
    reply = {}
    if mode == "pipeline":
        draft.config.target_layer_ids = TAPPED
        pipeline(model, group)
        reply["features"] = tapped_features(model)
    else:
        draft.config.draft_vocab = DRAFT_VOCAB
        shard(model, group)
    return {"tokens": tokens_of(model, draft, tokenizer, PROMPT, block_size=4), **reply}


def main() -> None:
    group = world_group()
    target, draft = sys.argv[1:3]
    tokenizer = load_tokenizer(Path(target))
    tokenizer.eos_token_ids = []
    reply = {
        "rank": group.rank(),
        "sample": sampled(group, target, draft),
        **{mode: qwen3_5_greedy(group, tokenizer, mode) for mode in ("qwen3_5", "pipeline")},
    }
    print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
