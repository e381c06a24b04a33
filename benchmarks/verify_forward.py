"""The target's forward over n new positions: mlx-lm's as it is, and the loop's verify forward.

    python benchmarks/verify_forward.py                      # SmolLM2-135M fp32, 200-token context
    python benchmarks/verify_forward.py --rounds 15 --sizes 1,2,3,4,8,16
    python benchmarks/verify_forward.py --dtype checkpoint --sizes 1,4,16  # SmolLM2's own 4-bit
    python benchmarks/verify_forward.py -q 8 --sizes 1,4,16  # quantized here: 8-bit, group 64

`TargetAdapter.forward` (what the loop verifies with) takes the exps of the SwiGLUs
and attention softmaxes from `cpu_math` when there are several positions;
`model(...)` is mlx-lm's own forward. The matmuls of both go through the BLAS the
process bound (printed first): run it again with DFLASH_MLX_NO_FEW_ROWS=1 for
OpenBLAS without the few-row kernel. Each round times every size with both,
interleaved, after the context was prefilled (the cache is trimmed back after
each forward), so a burst of load from other jobs hits both alike. Reports the
median and the minimum over rounds (the minimum is the least disturbed by other
jobs on a shared machine), in ms and relative to the one-position forward.

With `--dtype checkpoint` a quantized target stays quantized (SmolLM2's checkpoint, imported
from its Q4_1 GGUF, is 4-bit in groups of 32 with an 8-bit tied head); `-q 4|8` quantizes it
here with MLX's affine layout (group 64). A quantized target gets a third variant: the verify
forward with MLX's own quantized products instead of the few-row product
(`few_rows_quantized.py`), the "before" of that product.
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)

# isort: on

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx import TargetAdapter, active_blas, load
from dflash_mlx.models.gguf import smollm2_model_dir
from dflash_mlx.models.loading import DTYPES, KEEP_CHECKPOINT
from dflash_mlx.native import few_rows_quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--context", type=int, default=200, help="prefilled positions")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", choices=[*DTYPES, KEEP_CHECKPOINT], default="float32")
    parser.add_argument("-q", "--q-bits", type=int, choices=(4, 8), help="quantize the target")
    args = parser.parse_args()

    model, _ = load(args.model or smollm2_model_dir(), dtype=args.dtype)
    if args.q_bits:
        nn.quantize(model, group_size=64, bits=args.q_bits)
        mx.eval(model.parameters())
    quantized = any(isinstance(m, nn.QuantizedLinear) for m in model.modules())
    target = TargetAdapter(model)
    cache = target.make_cache()
    mx.eval(model(mx.arange(100, 100 + args.context)[None], cache=cache))
    variants = {
        "mlx-lm forward": lambda tokens: model(tokens[None], cache=cache)[0],
        "verify forward": lambda tokens: target.forward(tokens[None], [cache]).logits[0],
    }
    if quantized:
        plain = TargetAdapter(model)  # its swaps less the few-row quantized product's
        ours = set(few_rows_quantized.FEW_ROWS_CLASSES.values())
        for several in (False, True):
            swaps = plain.verify_swaps(16 if several else 1)
            swaps[:] = [swap for swap in swaps if swap[2] not in ours]
        variants["verify, MLX's qmm"] = lambda tokens: plain.forward(tokens[None], [cache]).logits[
            0
        ]
    sizes = [int(n) for n in args.sizes.split(",")]
    times = {(v, n): [] for v in variants for n in sizes}
    for _ in range(args.rounds + 1):  # the first round warms up and is left out
        for n in sizes:
            tokens = mx.arange(500, 500 + n)
            for name, forward in variants.items():
                tic = time.perf_counter()
                mx.eval(mx.argmax(forward(tokens), axis=-1))
                times[name, n].append(time.perf_counter() - tic)
                for c in cache:
                    c.trim(n)
    print(f"BLAS: {active_blas()}")
    if quantized:
        print(f"few-row quantized product: {few_rows_quantized.status()}")
    print(f"context {args.context}, {args.rounds} rounds; ms (x the 1-position forward)")
    print(f"{'':24s}" + "".join(f"{n:>14d}" for n in sizes))
    for stat in (statistics.median, min):
        for name in variants:
            ms = [1e3 * stat(times[name, n][1:]) for n in sizes]
            cells = "".join(f"{m:8.1f} ({m / ms[0]:.2f})" for m in ms)
            print(f"{name + ', ' + stat.__name__:24s}{cells}")


if __name__ == "__main__":
    main()
