"""Native code and the choice of it: the system BLAS and our few-row matmul, vectorised
CPU math and verify attention, the few-row quantized product as an MLX extension, their
C/C++ sources and the cache of their builds, the Metal and CUDA kernels (kernels/), and
`backends`, the one place that decides which code a forward takes. Kept apart so what
depends on the machine (compilers, BLAS, GPU kernels) sits in one folder beside its
sources; `blas` runs before mlx is first imported, so this folder's `__init__` imports
nothing.
"""
