// Shared header for the DFlash block-attention kernel (passed as `header=` to
// mx.fast.metal_kernel; the body lives in block_attention.metal).
#include <metal_stdlib>
using namespace metal;

// Scores start from this finite floor instead of -inf so that the online
// softmax stays well defined under Metal's fast-math modes too.
static constant constexpr const float DFLASH_NEG_LARGE = -1.0e30f;
static constant constexpr const float DFLASH_LOG2E = 1.4426950408889634f;

// Element offset of x[i0][i1][i2][i3] in a 4-D input read in place through
// the `<name>_strides` buffer MLX binds when ensure_row_contiguous=false.
inline int64_t dflash_offset(
    const constant int64_t* strides,
    int i0,
    int i1,
    int i2,
    int i3) {
  return i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3];
}
