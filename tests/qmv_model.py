"""`kernels/cuda_quantized.py`'s few-rows quantized product in numpy, step for step.

Same loop as the CUDA source: per output column and lane, steps of 32 E elements then the
tail, one dequantization per step for every row, E accumulators per lane and row (in T at
4 bits, float32 at 8), each lane's accumulators added in order in float32, the lanes added in
a tree, one rounding to T. Values of T (bfloat16 or float16) are float64 arrays holding
exactly representable values; every operation the kernel rounds once is computed exactly in
float64 and rounded once here (`round_to`). The pieces are module functions so that tests can
swap one for a wrong version and see a check fail.
"""

from __future__ import annotations

import numpy as np

LANES = 32
# (significant bits, lowest binary exponent of a normal number as np.frexp gives it)
FORMATS = {"bfloat16": (8, -125), "float16": (11, -13)}


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` (float64) rounded to the nearest `dtype` number, ties to even (subnormals
    included; no overflow)."""
    bits, lowest = FORMATS[dtype]
    _, exponent = np.frexp(values)
    quantum = np.ldexp(1.0, np.maximum(exponent, lowest) - bits)
    return np.rint(values / quantum) * quantum


def per_lane(bits: int) -> int:
    """E: the elements a lane takes in a step (MLX's qmv: 16 at 4 bits, 8 at 8)."""
    return 16 if bits == 4 else 8


def unpack(words: np.ndarray, k: np.ndarray, bits: int) -> np.ndarray:
    """The quantized values at element indices `k` of each row of `words` (N, K bits / 32
    uint32): bits (k % (32 / bits)) * bits up of word k / (32 / bits)."""
    per_word = 32 // bits
    word = words[:, k // per_word]
    return ((word >> ((k % per_word) * bits).astype(np.uint32)) & ((1 << bits) - 1)).astype(float)


def dequantize(q: np.ndarray, scale: np.ndarray, bias: np.ndarray, dtype: str) -> np.ndarray:
    """q * scale + bias rounded once to T (the kernel's `__hfma2`)."""
    return round_to(q * scale + bias, dtype)


def add_products(x: np.ndarray, w: np.ndarray, acc: np.ndarray, dtype: str) -> np.ndarray:
    """acc + x * w: rounded once to T for accumulators in T (4 bits), in float32 otherwise."""
    if acc.dtype == np.float32:
        return acc + (x * w).astype(np.float32)  # the product is exact in float32
    return round_to(x * w + acc, dtype)


def lane_sum(acc: np.ndarray) -> np.ndarray:
    """Each lane's E accumulators added in order in float32 (last axis)."""
    total = np.zeros(acc.shape[:-1], np.float32)
    for i in range(acc.shape[-1]):
        total = total + acc[..., i].astype(np.float32)
    return total


def warp_sum(lanes: np.ndarray) -> np.ndarray:
    """The lanes (last axis, 32) added in float32 in the warp's tree: lane i with lane i + 16,
    then those sums 8 apart, 4, 2, 1 (cooperative groups' xor butterfly, lane 0's view)."""
    width = LANES
    while width > 1:
        width //= 2
        lanes = lanes[..., :width] + lanes[..., width : 2 * width]
    return lanes[..., 0]


def qmv_rows(
    x: np.ndarray,
    words: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    group_size: int,
    dtype: str,
) -> np.ndarray:
    """x (M, K) @ dequantized(words).T as the kernel computes it: (M, N) float64 values of
    `dtype`. x, scales and biases hold values of `dtype`; words are MLX's packed uint32."""
    rows, depth = x.shape
    e = per_lane(bits)
    step = LANES * e
    lane_k = np.arange(LANES)[:, None] * e + np.arange(e)  # (lanes, E): k within a step
    acc_dtype = np.float32 if bits == 8 else np.float64
    acc = np.zeros((rows, words.shape[0], LANES, e), acc_dtype)
    starts = [s * step for s in range(depth // step)]
    if depth % step:
        starts.append(depth - depth % step)  # the tail: lanes whose first k is inside K
    for start in starts:
        k = start + lane_k
        active = k[:, 0] < depth
        k = np.where(active[:, None], k, 0)
        group = k[:, 0] // group_size
        w = dequantize(
            unpack(words, k, bits), scales[:, group, None], biases[:, group, None], dtype
        )
        updated = add_products(x[:, None, k], w[None], acc, dtype)
        acc = np.where(active[:, None], updated, acc)
    return round_to(warp_sum(lane_sum(acc)).astype(np.float64), dtype)
