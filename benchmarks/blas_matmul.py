"""Matmul throughput of MLX's CPU backend with and without the system BLAS binding.

    python benchmarks/blas_matmul.py

Runs each setting in its own process (the binding happens before mlx is
imported), interleaved, and prints GF/s for a 2048² fp32 matmul and a 16-row
verify-shaped matmul against a 1-row one.
"""

import os
import subprocess
import sys

PROBE = """
import time, dflash_mlx, mlx.core as mx
def rate(m, k, n, reps):
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n)); mx.eval(a, b); mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(reps): mx.eval(a @ b)
    return (time.perf_counter() - t) / reps
big = rate(2048, 2048, 2048, 5)
one, sixteen = rate(1, 576, 1536, 200), rate(16, 576, 1536, 200)
print(f"{dflash_mlx.active_blas()[:40]:40s}  2048^2 fp32: {2 * 2048**3 / big / 1e9:7.1f} GF/s   "
      f"16-row / 1-row matmul (576x1536): {sixteen / one:5.2f}x")
"""

for _ in range(2):
    for disabled in ("1", "0"):
        env = dict(os.environ, DFLASH_MLX_NO_BLAS=disabled)
        subprocess.run([sys.executable, "-c", PROBE], env=env, check=True)
