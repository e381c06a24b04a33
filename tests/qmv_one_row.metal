// Test reference: a one-row affine quantized product in the order of MLX's
// one-row Metal kernels (`qmv_fast` for PACKS = 2, `qmv` for PACKS = 1 in MLX's
// kernels/quantized.h), written for this project's tests from that description:
//
// - threadgroup (x row, 8 output columns): 2 simdgroups of 32 lanes, 4 columns each;
// - K in blocks of 32 * VPT, VPT = PACKS * 32 / BITS values per lane; lane l
//   covers positions [l * VPT, (l + 1) * VPT) of every block; qmv's last block
//   may be partial (lanes past K add nothing);
// - per block a lane loads its VPT activations into floats and sums them
//   (4 bits: four at a time, in T, and stored divided by 1, 16, 256, 4096),
//   then for each column: accum over the weights read as uint16 (4 bits, four
//   nibbles masked in place) or bytes (8 bits), result += scale * accum + sum * bias;
// - simd_sum of each column's result over the 32 lanes, lane 0 stores it.
//
// Grid: (32 * M, 2 * ceil(N / 8), 1), threadgroup (32, 2, 1).

constexpr int per_word = 32 / BITS;
constexpr int vpt = per_word * PACKS;
constexpr int block = 32 * vpt;
constexpr int results = 4;

const int in_size = x_shape[1];
const int out_size = w_shape[0];
const int row = threadgroup_position_in_grid.x;
const int lid = thread_index_in_simdgroup;
const int out_col = threadgroup_position_in_grid.y * 8 + simdgroup_index_in_threadgroup * results;
const int row_bytes = in_size * BITS / 8;
const int row_groups = in_size / GS;

const device uint8_t* wp = (const device uint8_t*)w + out_col * row_bytes + lid * vpt * BITS / 8;
const device T* sp = scales + out_col * row_groups + (lid * vpt) / GS;
const device T* bp = biases + out_col * row_groups + (lid * vpt) / GS;
const device T* xp = x + row * in_size + lid * vpt;

float x_thread[vpt];
float result[results] = {0, 0, 0, 0};

for (int k = 0; k < in_size; k += block) {
  if (k + lid * vpt < in_size) {
    float sum = 0;
    if (BITS == 4) {
      for (int i = 0; i < vpt; i += 4) {
        sum += xp[i] + xp[i + 1] + xp[i + 2] + xp[i + 3];
        x_thread[i] = xp[i];
        x_thread[i + 1] = xp[i + 1] / 16.0f;
        x_thread[i + 2] = xp[i + 2] / 256.0f;
        x_thread[i + 3] = xp[i + 3] / 4096.0f;
      }
    } else {
      for (int i = 0; i < vpt; i++) {
        sum += xp[i];
        x_thread[i] = xp[i];
      }
    }
    for (int c = 0; c < results && out_col + c < out_size; c++) {
      const device uint8_t* wc = wp + c * row_bytes;
      float s = sp[c * row_groups];
      float b = bp[c * row_groups];
      float accum = 0;
      if (BITS == 4) {
        const device uint16_t* wh = (const device uint16_t*)wc;
        for (int i = 0; i < vpt / 4; i++) {
          accum += (x_thread[4 * i] * (wh[i] & 0x000f) + x_thread[4 * i + 1] * (wh[i] & 0x00f0) +
                    x_thread[4 * i + 2] * (wh[i] & 0x0f00) + x_thread[4 * i + 3] * (wh[i] & 0xf000));
        }
      } else {
        for (int i = 0; i < vpt; i++) {
          accum += x_thread[i] * wc[i];
        }
      }
      result[c] += s * accum + sum * b;
    }
  }
  wp += block * BITS / 8;
  sp += block / GS;
  bp += block / GS;
  xp += block;
}

for (int c = 0; c < results; c++) {
  float total = simd_sum(result[c]);
  if (lid == 0 && out_col + c < out_size) {
    out[row * out_size + out_col + c] = static_cast<T>(total);
  }
}
