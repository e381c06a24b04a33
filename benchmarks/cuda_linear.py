"""The few-rows kernels against MLX's products on an NVIDIA GPU, per product and per cycle.

    python benchmarks/cuda_linear.py --shape qwen3-8b --dtype bfloat16
    python benchmarks/cuda_linear.py --shape qwen3-4b --dtype bfloat16 --rounds 6
    python benchmarks/cuda_linear.py --shape qwen3-8b -q 4    # the quantized kernel, 4-bit

MLX multiplies one row with its own GEMV and 2 or more with cuBLAS, whose plan it sets up
on the host at every call. `kernels/cuda.py`'s few-rows kernel takes 2..16 rows in verify
and draft forwards; with `-q`, the target is quantized (groups of 64) and its layers take
`kernels/cuda_quantized.py`'s kernel instead, against MLX's quantized product (its one-row
GEMV below 8 rows, a tensor-core kernel from 8). Two parts, random weights in a published
shape (cycle_cost.py's `--shape`):

- per product, for each linear layer of a block and the LM head: microseconds per call,
  built and run (one copy per layer, distinct weights, evaluated together, as in a forward),
  and of those the host's to build the call, MLX's product against the kernel, at 1..16 rows;
  with `-q`, also how many rows of each product equal MLX's product of that row alone, bit
  for bit (what keeps greedy output identical to one-token decoding), the kernel's and MLX's;
- per cycle, with the kernel and without it alternately in every round (so that the
  shared machine's drift hits both): mlx-lm's step, a cycle at block 16 with a random
  drafter (never accepted), the drafter's forward, the verify forward and the target
  forward over 16 positions with its graph building. Medians over `--rounds`.

Needs MLX's CUDA backend (`mlx-cuda`) and a GPU; elsewhere it says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from unittest import mock

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx

# isort: on

import mlx.nn as nn
from cycle_cost import DTYPES, SHAPES, CycleCost, load_target, make_draft

from dflash_mlx import TargetAdapter
from dflash_mlx.native.kernels import cuda as cuda_kernels
from dflash_mlx.native.kernels import cuda_quantized

ROWS = (1, 2, 4, 8, 16)


def without_kernel():
    """MLX's products everywhere the kernel would take them: no layer changes class."""
    return mock.patch.object(cuda_kernels, "few_rows_class", lambda module: None)


def products(layer: nn.Module) -> tuple:
    """(MLX's product, the kernel's) of x with `layer`'s transposed weight."""
    if isinstance(layer, nn.QuantizedLinear):
        weights = layer.weight, layer.scales, layer.biases
        bits, group_size = layer.bits, layer.group_size
        return (
            lambda x: mx.quantized_matmul(
                x, *weights, transpose=True, group_size=group_size, bits=bits
            ),
            lambda x: cuda_quantized.quantized_matmul(x, *weights, bits, group_size),
        )
    return (lambda x: x @ layer.weight.T), partial(
        cuda_kernels.few_rows_matmul, weight=layer.weight
    )


def one_row_equal(product, x: mx.array, mlx) -> int:
    """How many rows of `product(x)` equal MLX's product of that row alone, bit for bit."""
    out = product(x)
    return sum(
        mx.array_equal(out[:, r], mlx(x[:, r : r + 1])[:, 0]).item() for r in range(x.shape[1])
    )


def per_product(model, reps: int) -> None:
    layers = model.layers
    linears = {
        "q_proj": [layer.self_attn.q_proj for layer in layers],
        "k_proj": [layer.self_attn.k_proj for layer in layers],
        "o_proj": [layer.self_attn.o_proj for layer in layers],
        "gate_proj": [layer.mlp.gate_proj for layer in layers],
        "down_proj": [layer.mlp.down_proj for layer in layers],
    }
    if "lm_head" in model:
        linears["lm_head (once)"] = [model.lm_head]
    quantized = isinstance(layers[0].mlp.down_proj, nn.QuantizedLinear)
    print("\nper product: us per call, built and run (of which building it), MLX / kernel")
    print(f"{'linear':>16s}" + "".join(f"{'rows ' + str(r):>24s}" for r in ROWS))
    identical = defaultdict(lambda: [0, 0, 0])  # rows equal to one-row products: MLX, kernel, all
    for name, modules in linears.items():
        line = []
        fns = [products(m) for m in modules]
        for rows in ROWS:
            depth = modules[0].scales.shape[1] * modules[0].group_size if quantized else None
            depth = depth or modules[0].weight.shape[1]
            dtype = modules[0].scales.dtype if quantized else modules[0].weight.dtype
            xs = [mx.random.normal((1, rows, depth)).astype(dtype) for _ in modules]
            mx.eval(xs)
            cells = []
            for which in (0, 1):
                builds, totals = [], []
                for _ in range(reps + 1):
                    start = time.perf_counter()
                    outs = [fn[which](x) for x, fn in zip(xs, fns)]
                    built = time.perf_counter()
                    mx.eval(outs)
                    builds.append(built - start)
                    totals.append(time.perf_counter() - start)
                calls = len(modules)
                cells.append(
                    (
                        1e6 * statistics.median(totals[1:]) / calls,
                        1e6 * statistics.median(builds[1:]) / calls,
                    )
                )
            (g0, h0), (g1, h1) = cells
            line.append(f"{g0:6.1f}({h0:3.0f}) /{g1:6.1f}({h1:3.0f})")
            if quantized and rows > 1:
                mlx, kernel = fns[0]
                counts = identical[(name, rows)]
                counts[0] += one_row_equal(mlx, xs[0], mlx)
                counts[1] += one_row_equal(kernel, xs[0], mlx)
                counts[2] += rows
        print(f"{name:>16s}" + "".join(f"{cell:>24s}" for cell in line))
    if quantized:
        print("\nrows equal bit for bit to MLX's product of that row alone, MLX's / the kernel's")
        print(f"{'linear':>16s}" + "".join(f"{'rows ' + str(r):>14s}" for r in ROWS[1:]))
        for name in linears:
            cells = [identical[(name, rows)] for rows in ROWS[1:]]
            print(f"{name:>16s}" + "".join(f"{f'{a}/{c} {b}/{c}':>14s}" for a, b, c in cells))


def per_cycle(bench: CycleCost, rounds: int, max_tokens: int) -> None:
    samples = defaultdict(list)
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        for label, patch in (("kernel", nullcontext()), ("MLX", without_kernel())):
            with patch:
                bench.target = TargetAdapter(bench.model)  # swaps decided under the patch
                bench.draft_head = bench.target.draft_head(None)
                samples[(label, "mlx-lm step")].append(bench.mlx_lm_step(max_tokens))
                samples[(label, "cycle at block 16")].append(bench.cycle(max_tokens)[0])
                samples[(label, "draft forward")].append(bench.draft_forward())
                samples[(label, "verify forward")].append(bench.verify_at_a_new_length())
                build, full = bench.forward(bench.block)
                samples[(label, "forward(16): build")].append(build)
                samples[(label, "forward(16): all")].append(full)
    med = {key: statistics.median(v[1:]) for key, v in samples.items()}
    names = list(dict.fromkeys(name for _, name in med))
    print(f"\nper cycle, ms (x the same run's mlx-lm step), medians of {rounds} interleaved rounds")
    print(f"{'':>22s}{'kernel':>18s}{'MLX':>18s}")
    for name in names:
        cells = []
        for label in ("kernel", "MLX"):
            ms = med[(label, name)]
            cells.append(f"{ms:8.2f} ({ms / med[(label, 'mlx-lm step')]:4.2f})")
        print(f"{name:>22s}" + "".join(f"{c:>18s}" for c in cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="repeats of each product")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-q", "--q-bits", type=int, choices=(4, 8), help="quantize the target")
    parser.add_argument("--skip-products", action="store_true")
    args = parser.parse_args(argv)
    if not cuda_kernels.is_available():
        sys.exit(
            "cuda_linear.py: needs MLX's CUDA backend (pip install -e '.[cuda]') and an NVIDIA GPU"
        )
    cc_args = argparse.Namespace(
        model=None,
        shape=args.shape,
        dtype=args.dtype,
        q_bits=args.q_bits,
        draft=None,
        draft_layers=None,
        block_size=16,
        prompt_tokens=64,
        positions=[1],
        tree_budgets=[],
    )
    model, tokenizer = load_target(cc_args)
    quantized = f", {args.q_bits}-bit" if args.q_bits else ""
    print(f"{args.shape} ({args.dtype}{quantized}) on {mx.default_device()}")
    if not args.skip_products:
        per_product(model, args.reps)
    bench = CycleCost(model, tokenizer, make_draft(cc_args, model), cc_args)
    per_cycle(bench, args.rounds, args.max_tokens)


if __name__ == "__main__":
    main()
