"""Recurrent rollback cost per cycle against the verify forward it follows.

For a hybrid Qwen3.5 target (mlx-lm's qwen3_5 class, random weights, fp32):
time the verify forward of a block (logits and caches evaluated), then
`TargetAdapter.rollback` keeping m of its positions (the replay of the
committed prefix through the recurrent layers, caches evaluated). m = block
(everything accepted) costs nothing and is not timed. Medians over interleaved
repetitions. Configs: a tiny one (hidden 64, 6 layers) and one with
SmolLM2-135M's sizes (hidden 576, 30 layers, 9/3 heads, MLP 1536, vocab 49152).

    python benchmarks/rollback_cost.py [--block 16] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx
from mlx_lm.models import qwen3_5

# isort: on

from dflash_mlx.models.rollback import RecurrentCache
from dflash_mlx.models.target import TargetAdapter

LINEAR = dict(linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6)
CONFIGS = {
    "tiny (hidden 64, 6 layers)": dict(
        LINEAR,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "SmolLM2-sized (hidden 576, 30 layers)": dict(
        LINEAR,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
}


def timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def measure(config: dict, block: int, reps: int, kept: list[int]) -> dict[str, float]:
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", **config}))
    mx.eval(model.parameters())
    target = TargetAdapter(model)
    cache = target.make_cache()
    tokens = mx.random.randint(0, config["vocab_size"], (1, 128 + block))
    times: dict[str, list[float]] = {"verify": [], **{f"rollback m={m}": [] for m in kept}}

    def forward(tokens: mx.array) -> mx.array:  # mlx-lm's forward, checkpointing its caches
        return target.forward(tokens, [cache], prompt=True).logits

    mx.eval(forward(tokens[:, :128]), [c.state for c in cache])
    prompt_state = [list(c.cache) if isinstance(c, RecurrentCache) else None for c in cache]
    for _ in range(reps):
        for m in kept:  # interleaved, so load from other processes hits all alike
            verify = tokens[:, 128 : 128 + block]
            times["verify"].append(
                timed(lambda v=verify: mx.eval(forward(v), [c.state for c in cache]))
            )
            times[f"rollback m={m}"].append(
                timed(
                    lambda m=m: (
                        target.rollback(cache, block - m),
                        mx.eval([c.state for c in cache]),
                    )
                )
            )
            for c, state in zip(cache, prompt_state):  # back to the prompt
                if state is None:
                    c.trim(c.offset - 128)
                else:
                    c.cache, c.offset = list(state), 128
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    kept = [1, args.block // 2, args.block - 1]
    for name, config in CONFIGS.items():
        result = measure(config, args.block, args.reps, kept)
        verify = result.pop("verify")
        print(f"{name}: verify of {args.block} positions {verify:.2f} ms")
        for key, ms in result.items():
            print(f"  {key}: {ms:.2f} ms ({ms / verify:.0%} of the verify)")


if __name__ == "__main__":
    main()
