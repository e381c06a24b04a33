"""Time ways to compute the drafter's block attention, side by side.

python -m dflash_mlx.native.kernels.bench prints the best per-call time over
interleaved rounds (robust to other load on the machine) and the ratio to
sdpa-on-concatenation for the MLX-ops variants (and the Metal kernel on a Mac);
the numbers measured for the project are in metal/README.md.
"""

import time

import mlx.core as mx

from . import active_backend, metal
from .reference import reference_attention

B, HQ, HKV, D, L = 1, 9, 3, 64, 16


def sdpa_on_concat(q, kc, vc, kb, vb, scale):
    k = mx.concatenate([kc, kb], axis=2)
    v = mx.concatenate([vc, vb], axis=2)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def softmax_on_concat_scores(q, kc, vc, kb, vb, scale):
    """Concatenate the (G*L, S) scores instead of the (S, D) keys and values."""
    s_ctx = kc.shape[2]
    qg = (q * scale).reshape(B, HKV, -1, D)
    scores = mx.concatenate([qg @ kc.swapaxes(-1, -2), qg @ kb.swapaxes(-1, -2)], axis=-1)
    p = mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype)
    return (p[..., :s_ctx] @ vc + p[..., s_ctx:] @ vb).reshape(q.shape)


VARIANTS = {
    "sdpa_on_concat": sdpa_on_concat,
    "shared_max (reference)": reference_attention,
    "softmax_on_concat_scores": softmax_on_concat_scores,
}


def main(rounds: int = 15, calls: int = 20) -> None:
    if active_backend() == "metal":
        VARIANTS["metal kernel"] = metal.metal_attention
    for s in (64, 512, 2048):
        keys = mx.random.split(mx.random.key(s), 5)
        cache_k = mx.random.normal((B, HKV, 4096, D), key=keys[0])
        cache_v = mx.random.normal((B, HKV, 4096, D), key=keys[1])
        q = mx.random.normal((B, HQ, L, D), key=keys[2])
        kb = mx.random.normal((B, HKV, L, D), key=keys[3])
        vb = mx.random.normal((B, HKV, L, D), key=keys[4])
        mx.eval(cache_k, cache_v, q, kb, vb)
        args = (q, cache_k[:, :, :s], cache_v[:, :, :s], kb, vb, D**-0.5)
        want = sdpa_on_concat(*args)
        times = {name: [] for name in VARIANTS}
        for _ in range(rounds):  # interleaved, so load changes hit every variant alike
            for name, fn in VARIANTS.items():
                mx.eval(fn(*args))
                start = time.perf_counter()
                for _ in range(calls):
                    mx.eval(fn(*args))
                times[name].append((time.perf_counter() - start) / calls)
        base = min(times["sdpa_on_concat"])
        for name, fn in VARIANTS.items():
            t = min(times[name])
            err = mx.abs(fn(*args) - want).max().item()
            print(f"S={s:5d}  {name:26s} {t * 1e6:9.1f} us  x{t / base:5.2f}  max|diff| {err:.1e}")


if __name__ == "__main__":
    main()
