"""Which ops make a forward over n > 1 new positions cost more than one over 1, op by op.

    python benchmarks/verify_ops.py --shape qwen3-8b --dtype bfloat16          # a GPU
    python benchmarks/verify_ops.py --shape qwen3-8b --dtype bfloat16 -q 4
    python benchmarks/verify_ops.py --shape smollm2-135m                       # this CPU

For random weights in a published shape (cycle_cost.py's `--shape`), each op of one
decoder layer is timed as the model's forward runs it: one copy per layer
(`num_hidden_layers` independent calls, distinct inputs, the layer's own weights),
evaluated together, so launches and their overheads pile up as they do in a
forward. Reported per call in microseconds at each n, and per forward (x layers):

- each linear layer of a block (q, k, v, o, gate, up, down) and the LM head;
- RMSNorm and RoPE over the block's (n, hidden) and (heads, n, head_dim) inputs;
- the KV-cache update plus attention over `--context` cached positions, as mlx-lm's
  attention calls it (`mask="causal"` for n > 1), and the same with the project's
  verify-attention kernel on MLX's CUDA backend (its output is checked against MLX's);
- the whole forward over n new positions, split into graph building (host, no
  evaluation), handing it to the device (`mx.async_eval` until it returns) and the
  rest until the result is ready.

Medians over `--rounds` interleaved rounds (each round times every op once at every n).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

# isort: off
import dflash_mlx  # noqa: F401  (binds the system BLAS before mlx is imported)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

# isort: on

from cycle_cost import DTYPES, SHAPES, random_target

from dflash_mlx.native.kernels import cuda as cuda_kernels


def timed(fn: Callable[[], list[mx.array]], reps: int) -> float:
    """Median seconds over `reps` of building `fn()`'s graph and evaluating it."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Ops:
    """Every op of one decoder layer, once per layer, at n new positions."""

    def __init__(self, model: nn.Module, context: int):
        self.model = model
        self.layers = model.layers
        self.attn = [layer.self_attn for layer in self.layers]
        self.mlp = [layer.mlp for layer in self.layers]
        first = self.attn[0]
        self.q_heads, self.kv_heads = first.n_heads, first.n_kv_heads
        self.head_dim = first.q_proj.weight.shape[0] // self.q_heads
        self.hidden = model.args.hidden_size
        self.dtype = model.layers[0].input_layernorm.weight.dtype
        self.caches = [KVCache() for _ in self.layers]
        keys = mx.random.normal((1, self.kv_heads, context, self.head_dim)).astype(self.dtype)
        for c in self.caches:
            c.update_and_fetch(keys, keys)
        mx.eval([c.keys for c in self.caches])

    def inputs(self, n: int, width: int) -> list[mx.array]:
        xs = [mx.random.normal((1, n, width)).astype(self.dtype) for _ in self.layers]
        mx.eval(xs)
        return xs

    def cases(self, n: int) -> dict[str, Callable[[], list[mx.array]]]:
        x = self.inputs(n, self.hidden)
        wide = self.inputs(n, self.mlp[0].down_proj.weight.shape[-1] * self._pack())
        heads = [
            mx.random.normal((1, self.q_heads, n, self.head_dim)).astype(self.dtype)
            for _ in self.layers
        ]
        kv = [
            mx.random.normal((1, self.kv_heads, n, self.head_dim)).astype(self.dtype)
            for _ in self.layers
        ]
        mx.eval(heads, kv)
        offset = self.caches[0].offset
        cases = {
            name: (lambda name=name: [getattr(a, name)(xi) for a, xi in zip(self.attn, x)])
            for name in ("q_proj", "k_proj", "v_proj")
        }
        cases["o_proj"] = lambda: [a.o_proj(xi) for a, xi in zip(self.attn, x)]
        for name in ("gate_proj", "up_proj"):
            cases[name] = lambda name=name: [getattr(m, name)(xi) for m, xi in zip(self.mlp, x)]
        cases["down_proj"] = lambda: [m.down_proj(wi) for m, wi in zip(self.mlp, wide)]
        cases["rms_norm"] = lambda: [layer.input_layernorm(xi) for layer, xi in zip(self.layers, x)]
        cases["rope"] = lambda: [a.rope(hi, offset=offset) for a, hi in zip(self.attn, heads)]
        cases["cache+sdpa"] = lambda: self.attention(heads, kv, "mlx")
        if cuda_kernels.is_available():
            cases["cache+kernel"] = lambda: self.attention(heads, kv, "kernel")
        head = self.model.lm_head if "lm_head" in self.model else None
        if head is not None:
            cases["lm_head (once)"] = lambda: [head(x[0])]
        return cases

    def _pack(self) -> int:
        """Input columns per stored column of the down projection (quantized: packed)."""
        down = self.mlp[0].down_proj
        return 32 // down.bits if isinstance(down, nn.QuantizedLinear) else 1

    def attention(self, queries: list[mx.array], kv: list[mx.array], how: str) -> list[mx.array]:
        n = queries[0].shape[2]
        outs = []
        for a, c, qi, ki in zip(self.attn, self.caches, queries, kv):
            keys, values = c.update_and_fetch(ki, ki)
            if how == "kernel":
                visible = cuda_kernels.causal(n)
                outs.append(cuda_kernels.verify_attention(qi, keys, values, visible, a.scale))
            else:
                mask = "causal" if n > 1 else None
                outs.append(scaled_dot_product_attention(qi, keys, values, c, a.scale, mask))
        mx.eval(outs)
        for c in self.caches:
            c.trim(n)
        return outs

    def check_kernel(self, n: int) -> float:
        """Largest |kernel - MLX's SDPA| over one layer's attention, relative to max |SDPA|."""
        q = mx.random.normal((1, self.q_heads, n, self.head_dim)).astype(self.dtype)
        k = mx.random.normal((1, self.kv_heads, n, self.head_dim)).astype(self.dtype)
        ref = self.attention([q], [k], "mlx")[0].astype(mx.float32)
        got = self.attention([q], [k], "kernel")[0].astype(mx.float32)
        return (mx.abs(got - ref).max() / mx.abs(ref).max()).item()

    def forward_split(self, n: int) -> dict[str, float]:
        """Build / hand over / finish times of a whole forward over n new positions."""
        cache = [KVCache() for _ in self.layers]
        prompt = mx.random.randint(0, 1000, (1, 64))
        mx.eval(self.model(prompt, cache=cache))
        tokens = mx.random.randint(0, 1000, (1, n))
        mx.eval(tokens)
        start = time.perf_counter()
        out = self.model(tokens, cache=cache)
        built = time.perf_counter()
        mx.async_eval(out)
        handed = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        return {"build": built - start, "hand over": handed - built, "finish": done - handed}


def measure(args: argparse.Namespace) -> dict:
    model = random_target(args.shape)
    model.set_dtype(DTYPES[args.dtype])
    if args.q_bits:
        nn.quantize(model, group_size=64, bits=args.q_bits)
    mx.eval(model.parameters())
    ops = Ops(model, args.context)
    sizes = [int(s) for s in args.positions.split(",")]
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for _ in range(args.rounds + 1):  # the first round warms up (JIT, plans) and is dropped
        for n in sizes:
            for name, fn in ops.cases(n).items():
                calls = 1 if "once" in name else len(ops.layers)
                samples[(name, n)].append(timed(fn, args.reps) / calls)
            for part, seconds in ops.forward_split(n).items():
                samples[(f"forward: {part}", n)].append(seconds)
    kernel_error = {n: ops.check_kernel(n) for n in sizes} if cuda_kernels.is_available() else {}
    med = {key: statistics.median(v[1:]) for key, v in samples.items()}
    return {
        "config": {**vars(args), "device": str(mx.default_device()), "layers": len(ops.layers)},
        "us": {f"{name}@{n}": 1e6 * s for (name, n), s in med.items()},
        "kernel_max_rel_error": kernel_error,
    }


def report(results: dict) -> None:
    c = results["config"]
    quant = f", {c['q_bits']}-bit" if c["q_bits"] else ""
    print(
        f"\n{c['shape']} ({c['dtype']}{quant}) on {c['device']}; context {c['context']}, "
        f"{c['layers']} layers; microseconds per call (forward rows: per forward)"
    )
    sizes = [int(s) for s in c["positions"].split(",")]
    names = list(dict.fromkeys(key.rpartition("@")[0] for key in results["us"]))
    print(f"{'op':>22s}" + "".join(f"{'n=' + str(n):>10s}" for n in sizes) + f"{'x layers':>12s}")
    for name in names:
        row = [results["us"].get(f"{name}@{n}", float("nan")) for n in sizes]
        per_forward = (
            ""
            if "forward" in name or "once" in name
            else (f"{(row[-1] - row[0]) * c['layers'] / 1e3:+10.2f}ms")
        )
        print(f"{name:>22s}" + "".join(f"{v:10.1f}" for v in row) + f"{per_forward:>12s}")
    for n, err in results["kernel_max_rel_error"].items():
        print(f"verify kernel vs MLX's SDPA at n={n}: max relative error {err:.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("-q", "--q-bits", type=int, choices=(4, 8))
    parser.add_argument("--context", type=int, default=64, help="cached positions before the n")
    parser.add_argument("--positions", default="1,2,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    results = measure(args)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
