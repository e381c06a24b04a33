"""The few-row quantized kernel against MLX's quantized products on a Mac, per product.

    python benchmarks/metal_quantized.py --shape qwen3-8b --bits 4
    python benchmarks/metal_quantized.py --shape qwen3-4b --bits 8 --dtype float16 --reps 50

For each linear layer of one block of a published shape (cycle_cost.py's `--shape`) and the
LM head, with random weights quantized in MLX's affine layout (`--bits`, `--group-size`),
at 1..16 rows: microseconds per product of

- MLX: `mx.quantized_matmul` on all rows at once (what a verify forward runs without the
  kernel: one GEMV per row, MLX's small-batch kernel or its matmul, by GPU and row count);
- kernel: `metal_quantized.quantized_rows` on all rows (each packed weight read once);
- rows x 1: `mx.quantized_matmul` one row at a time (what as many decoding steps run);

`--copies` distinct weights per layer are evaluated together (as a forward's layers are), so
the weights stream from memory rather than staying in the GPU's cache, and the three ways
alternate within every repetition. "same" says whether every row of the kernel's output
equals MLX's one-row product bit for bit (what keeps greedy output mlx-lm's).

Needs MLX's Metal backend; elsewhere it says so on one line and exits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx

# isort: on

from cycle_cost import DTYPES, SHAPES

from dflash_mlx.native.kernels import metal_quantized

ROWS = (1, 2, 4, 8, 16)


def layer_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """(K, N) of each product of one block and of the LM head."""
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    kv = shape["num_key_value_heads"] * head_dim
    inter = shape["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "lm_head (once)": (hidden, shape["vocab_size"]),
    }


def quantized_weights(k: int, n: int, copies: int, dtype, bits: int, group_size: int) -> list:
    weights = []
    for _ in range(copies):
        w, scales, biases = mx.quantize(
            mx.random.normal((n, k)).astype(dtype), group_size=group_size, bits=bits
        )
        weights.append((w, scales, biases))
    mx.eval(weights)
    return weights


def products(pairs: list, group_size: int, bits: int) -> dict[str, Callable[[], list]]:
    """The three ways to multiply each (x, (w, scales, biases)) of `pairs`."""

    def mlx(x, weight):
        return mx.quantized_matmul(x, *weight, group_size=group_size, bits=bits)

    return {
        "MLX": lambda: [mlx(x, weight) for x, weight in pairs],
        "kernel": lambda: [
            metal_quantized.quantized_rows(x, *weight, group_size, bits) for x, weight in pairs
        ],
        "rows x 1": lambda: [
            mx.concatenate([mlx(x[i : i + 1], weight) for i in range(x.shape[0])])
            for x, weight in pairs
        ],
    }


def timed(products, reps: int) -> dict[str, float]:
    """Median microseconds per product of each way, alternated within every repetition."""
    samples = {name: [] for name in products}
    for _ in range(reps + 1):  # the first repetition warms up and is dropped
        for name, build in products.items():
            start = time.perf_counter()
            outs = build()
            mx.eval(outs)
            samples[name].append((time.perf_counter() - start) / len(outs))
    return {name: 1e6 * statistics.median(v[1:]) for name, v in samples.items()}


def compare(args) -> None:
    dtype = DTYPES[args.dtype]
    gs, bits = args.group_size, args.bits
    print(f"{args.shape}, {args.bits}-bit, group {gs}, {args.dtype}: us per product")
    print(f"{'linear':>16s}{'rows':>6s}{'MLX':>10s}{'kernel':>10s}{'rows x 1':>10s}  same")
    for name, (k, n) in layer_shapes(SHAPES[args.shape]).items():
        if not metal_quantized.supports_weight(bits, gs, "affine", k, True):
            print(f"{name:>16s}  K={k}: not a format the kernel takes")
            continue
        copies = 1 if name.startswith("lm_head") else args.copies
        weights = quantized_weights(k, n, copies, dtype, bits, gs)
        for rows in ROWS:
            xs = [mx.random.normal((rows, k)).astype(dtype) for _ in weights]
            mx.eval(xs)
            ways = products(list(zip(xs, weights)), gs, bits)
            us = timed(ways, args.reps)
            pairs = zip(ways["kernel"](), ways["rows x 1"](), strict=True)
            same = all(mx.array_equal(a, b).item() for a, b in pairs)
            cells = "".join(f"{us[way]:10.1f}" for way in ways)
            print(f"{name:>16s}{rows:>6d}{cells}  {'yes' if same else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--bits", type=int, choices=metal_quantized.BITS, default=4)
    parser.add_argument("--group-size", type=int, choices=metal_quantized.GROUP_SIZES, default=64)
    parser.add_argument("--copies", type=int, default=8, help="distinct weights per layer")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if not mx.metal.is_available():
        print("metal_quantized.py: skipped, needs MLX's Metal backend (an Apple-silicon Mac)",
              file=sys.stderr)  # fmt: skip
        return 0
    mx.set_default_device(mx.gpu)
    failure = metal_quantized.self_check()
    print(f"self-check: {failure or 'every row bit for bit MLX one-row product'}")
    compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
