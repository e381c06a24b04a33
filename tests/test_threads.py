"""The kernels' threads (`native/threads.h`): results are the same bits whatever the number of
threads a call takes, and the count is the one forced, or the cheapest measured."""

import json
import os
import subprocess
import sys

import pytest

from tests.test_few_rows import needs_kernel

# Products of the few-row kernel (dots for 1-4 rows, packed columns from 5, both ways round),
# quantized products large enough to split (an LM head's size) and attention over enough keys
# to split them into tasks, in a fresh process: DFLASH_MLX_THREADS is read once per process.
PRODUCTS = """
import hashlib, json
import dflash_mlx
import mlx.core as mx, numpy as np
from dflash_mlx.native import blas, cpu_attention, few_rows_quantized

rng = np.random.default_rng(0)
digest, results = hashlib.sha256(), []
w = mx.array(rng.standard_normal((1536, 576)).astype(np.float32))
for rows in (1, 3, 4, 7, 16, 24):
    x = mx.array(rng.standard_normal((rows, 576)).astype(np.float32))
    results += [x @ w.T, w @ x.T]
qmm = few_rows_quantized.extension()
wq, scales, biases = mx.quantize(mx.array(rng.standard_normal((8192, 1024)).astype(np.float32)))
for rows in (2, 16):
    x = mx.array(rng.standard_normal((rows, 1024)).astype(np.float32))
    results.append(qmm.quantized_matmul(x, wq, scales, biases, 4, 64))
attention = cpu_attention.extension()
q = mx.array(rng.standard_normal((1, 8, 16, 64)).astype(np.float32))
k, v = (mx.array(rng.standard_normal((1, 2, 4096, 64)).astype(np.float32)) for _ in range(2))
results.append(attention.verify_attention(q, k, v, 0.125, None, True))
for r in results:
    digest.update(np.array(r).tobytes())
print(json.dumps({"digest": digest.hexdigest(), "sgemm": blas.calls_by_threads(),
                  "qmm": qmm.calls_by_threads(), "attention": attention.calls_by_threads()}))
"""


def run_products(threads: str | None) -> dict:
    """PRODUCTS in a process where OpenMP may take 4 threads and DFLASH_MLX_THREADS is
    `threads` (None: unset, the counts measured)."""
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_MLX_THREADS"}
    env["OMP_NUM_THREADS"] = "4"
    if threads is not None:
        env["DFLASH_MLX_THREADS"] = threads
    done = subprocess.run(
        [sys.executable, "-c", PRODUCTS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU only")
def test_every_thread_count_gives_the_same_bits():
    """Forced to 1, 2, 3 or 4 threads, or measured: the same digest of every result; the
    forced runs' calls took that many threads where their size allows it (the products of
    1536 x 576 floats allow up to 13, the attention over 4096 keys 4, the quantized head 2),
    and the measured run tried one thread and two."""
    one = run_products("1")
    assert all(sum(one[kernel][1:]) == 0 for kernel in ("sgemm", "qmm", "attention")), one
    for threads in ("2", "3", "4", None):
        other = run_products(threads)
        assert other["digest"] == one["digest"], (threads, other)
        if threads is None:  # each count is measured: a kind's first two calls try 2 and 1
            assert other["sgemm"][0] > 0 and other["sgemm"][1] > 0, other
        else:
            n = int(threads)
            assert other["sgemm"][n - 1] > 0 and other["attention"][n - 1] > 0, other
            assert other["qmm"][min(n, 2) - 1] > 0, other


@needs_kernel
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores")
def test_a_count_forced_in_the_process_holds_until_released():
    """`blas.force_threads(n)` (a benchmark's side-by-side settings): products take n threads
    from then on, and the measured counts again after `force_threads(0)`."""
    import mlx.core as mx

    from dflash_mlx.native import blas

    w, x = mx.ones((1536, 576)), mx.ones((4, 576))

    def took(n: int) -> list[int]:
        blas.force_threads(n)
        before = blas.calls_by_threads()
        for _ in range(40):
            mx.eval(x @ w.T)
        return [after - b for after, b in zip(blas.calls_by_threads(), before)]

    try:
        assert took(1)[:2] == [40, 0] and took(2)[:2] == [0, 40]
        assert sum(took(0)) == 40
    finally:
        blas.force_threads(0)
