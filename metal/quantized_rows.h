// Shared header for the few-row quantized product (passed as `header=` to
// mx.fast.metal_kernel; the body lives in quantized_rows.metal).
//
// Every floating-point expression here is written in the form, types and order
// of MLX's one-row affine kernels (`qmv_fast` / `qmv` in MLX's
// kernels/quantized.h), so one output row comes out bit for bit as MLX's
// one-row product computes it. Only the integer side (how packed weights are
// fetched and unpacked) is free, and it yields the same integers.
#include <metal_stdlib>
using namespace metal;

// 4-bit activations are stored pre-scaled by 16^-j (j = position in a group of
// four), so a nibble masked in place (not shifted down) times its activation
// is the product: x * (q << 4j) * 16^-j == x * q exactly.
static constant constexpr const float QROWS_NIBBLE_SCALE[4] = {
    1.0f,
    1.0f / 16.0f,
    1.0f / 256.0f,
    1.0f / 4096.0f};

// Loads one lane's VPT activations of one row into `xs` (as floats, 4-bit
// pre-scaled) and returns their sum: in T four at a time for 4 bits (the
// four-term expression is MLX's, evaluated in T), one at a time in float for 8.
template <typename T, int BITS, int VPT>
inline float qrows_load_x(const device T* x, thread float* xs) {
  float sum = 0.0f;
  if (BITS == 4) {
    for (int i = 0; i < VPT; i += 4) {
      sum += x[i] + x[i + 1] + x[i + 2] + x[i + 3];
    }
    for (int i = 0; i < VPT; i++) {
      xs[i] = float(x[i]) * QROWS_NIBBLE_SCALE[i % 4];
    }
  } else {
    for (int i = 0; i < VPT; i++) {
      sum += x[i];
      xs[i] = float(x[i]);
    }
  }
  return sum;
}

// One lane's share of one output: the dot of its VPT activations with the
// quantized weights packed in `words` (PACKS uint32s), then scale and bias:
// scale * sum(x * q) + sum(x) * bias.
template <int BITS, int PACKS>
inline float qrows_dot(
    const thread uint* words,
    const thread float* xs,
    float scale,
    float bias,
    float sum) {
  float accum = 0.0f;
  if (BITS == 4) {
    // Four nibbles per 16-bit half word, low half first (little-endian).
    for (int h = 0; h < 2 * PACKS; h++) {
      const uint q = (words[h / 2] >> (16 * (h % 2))) & 0xffffu;
      const thread float* v = xs + 4 * h;
      accum += v[0] * (q & 0x000fu) + v[1] * (q & 0x00f0u) +
          v[2] * (q & 0x0f00u) + v[3] * (q & 0xf000u);
    }
  } else {
    for (int i = 0; i < 4 * PACKS; i++) {
      accum += xs[i] * ((words[i / 4] >> (8 * (i % 4))) & 0xffu);
    }
  }
  return scale * accum + sum * bias;
}
