// Body of the few-row affine quantized product for mx.fast.metal_kernel.
//
// out[r, n] = sum_k x[r, k] * (scales[n, k / GS] * q[n, k] + biases[n, k / GS])
// for ROWS rows of x (M, K) and the quantized weight w (N, K * BITS / 32) in
// MLX's affine layout. Each threadgroup is two simdgroups of 32 lanes, each
// simdgroup owns 4 output columns; a lane reads its packed weights, scales and
// biases once per block of K and applies them to all ROWS rows. Per row, the
// lane covers the same K positions and accumulates in the same order as MLX's
// one-row kernel, and the lanes are combined by one simd_sum, so every row of
// the result equals MLX's one-row product of that row.
//
// Template: T (activations and output), BITS (4 or 8), GS (group size 32, 64
// or 128), PACKS (uint32 words per lane per block: 2 is MLX's qmv_fast order,
// 1 its qmv order, whose last block may be partial), ROWS (1..16).
// Grid: (32, 2 * ceil(N / 4 / 2), 1) threads, threadgroup (32, 2, 1).

constexpr int SIMD = 32;
constexpr int COLS = 4;                     // output columns per simdgroup
constexpr int PER_WORD = 32 / BITS;         // values per uint32
constexpr int VPT = PER_WORD * PACKS;       // values per lane per block
constexpr int BLOCK = SIMD * VPT;           // K positions per block

const int K = x_shape[1];
const int N = w_shape[0];
const int words_per_col = K / PER_WORD;
const int groups_per_col = K / GS;
const int lane = thread_index_in_simdgroup;
const int col0 =
    (threadgroup_position_in_grid.y * 2 + simdgroup_index_in_threadgroup) * COLS;

float acc[ROWS][COLS];
for (int r = 0; r < ROWS; r++) {
  for (int c = 0; c < COLS; c++) {
    acc[r][c] = 0.0f;
  }
}

for (int k0 = 0; k0 < K; k0 += BLOCK) {
  const int k = k0 + lane * VPT;
  if (k < K) {  // only MLX qmv's last, partial block leaves lanes idle
    uint words[COLS][PACKS];
    float scale[COLS];
    float bias[COLS];
    for (int c = 0; c < COLS; c++) {
      const int col = min(col0 + c, N - 1);  // columns past N are computed, not stored
      for (int p = 0; p < PACKS; p++) {
        words[c][p] = w[col * words_per_col + k / PER_WORD + p];
      }
      scale[c] = scales[col * groups_per_col + k / GS];
      bias[c] = biases[col * groups_per_col + k / GS];
    }
    for (int r = 0; r < ROWS; r++) {
      float xs[VPT];
      const float sum = qrows_load_x<T, BITS, VPT>(x + r * K + k, xs);
      for (int c = 0; c < COLS; c++) {
        acc[r][c] += qrows_dot<BITS, PACKS>(words[c], xs, scale[c], bias[c], sum);
      }
    }
  }
}

for (int r = 0; r < ROWS; r++) {
  for (int c = 0; c < COLS; c++) {
    const float total = simd_sum(acc[r][c]);
    if (lane == 0 && col0 + c < N) {
      out[r * N + col0 + c] = static_cast<T>(total);
    }
  }
}
