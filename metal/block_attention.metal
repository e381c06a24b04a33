// Body of the DFlash block-attention kernel for mx.fast.metal_kernel.
//
// out[b, h, l] = softmax(scale * q[b, h, l] . K^T) V, where K/V are the S
// cached context rows (kc/vc) followed by the L block rows (kb/vb) of kv head
// h / G. Both sources are read in place through their strides; nothing is
// concatenated. One threadgroup of NT threads owns RB query rows of one
// (batch, kv head); a row is a (g, l) pair of the G query heads sharing that
// kv head, so every K/V tile staged in threadgroup memory serves all of them.
// Keys stream in tiles of TK with an online softmax in fp32.
//
// Template: T (element type), D (head dim), TK (keys per tile, <= 32),
// RB (rows per threadgroup, multiple of NT / 32), NT (threads, multiple of 32).
// Grid: (NT * ceil(G * L / RB), Hkv, B), threadgroup (NT, 1, 1).

constexpr int NSG = NT / 32;
constexpr int ROWS_PER_SG = RB / NSG;
constexpr int OUT_PER_THREAD = RB * D / NT;

const int n_q_heads = q_shape[1];
const int L = q_shape[2];
const int G = n_q_heads / kb_shape[1];
const int S = n_ctx[0];
const int n_keys = S + L;
const int n_rows = G * L;

const int b = threadgroup_position_in_grid.z;
const int hkv = threadgroup_position_in_grid.y;
const int row0 = threadgroup_position_in_grid.x * RB;
const int tid = thread_index_in_threadgroup;
const int sg = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;

threadgroup float q_tile[RB * D];
threadgroup float k_tile[TK * D];
threadgroup float v_tile[TK * D];
threadgroup float p_tile[RB * TK];
threadgroup float row_alpha[RB];
threadgroup float row_sum[RB];

// Stage the queries, pre-scaled so that exp2 yields the softmax numerators.
const float q_scale = scale[0] * DFLASH_LOG2E;
for (int i = tid; i < RB * D; i += NT) {
  const int r = row0 + i / D;
  float x = 0.0f;
  if (r < n_rows) {
    const int h = hkv * G + r / L;
    x = float(q[dflash_offset(q_strides, b, h, r % L, i % D)]) * q_scale;
  }
  q_tile[i] = x;
}

float row_max[ROWS_PER_SG];
float row_l[ROWS_PER_SG];
for (int t = 0; t < ROWS_PER_SG; ++t) {
  row_max[t] = DFLASH_NEG_LARGE;
  row_l[t] = 0.0f;
}
float acc[OUT_PER_THREAD];
for (int k = 0; k < OUT_PER_THREAD; ++k) {
  acc[k] = 0.0f;
}

for (int key0 = 0; key0 < n_keys; key0 += TK) {
  // K/V tile: context rows first, then the block's own rows; zero padding.
  for (int i = tid; i < TK * D; i += NT) {
    const int j = key0 + i / D;
    const int d = i % D;
    float kx = 0.0f;
    float vx = 0.0f;
    if (j < S) {
      kx = float(kc[dflash_offset(kc_strides, b, hkv, j, d)]);
      vx = float(vc[dflash_offset(vc_strides, b, hkv, j, d)]);
    } else if (j < n_keys) {
      kx = float(kb[dflash_offset(kb_strides, b, hkv, j - S, d)]);
      vx = float(vb[dflash_offset(vb_strides, b, hkv, j - S, d)]);
    }
    k_tile[i] = kx;
    v_tile[i] = vx;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int i = tid; i < RB * TK; i += NT) {
    const int r = i / TK;
    const int j = i % TK;
    float s = DFLASH_NEG_LARGE;
    if (key0 + j < n_keys) {
      s = 0.0f;
      for (int d = 0; d < D; ++d) {
        s += q_tile[r * D + d] * k_tile[j * D + d];
      }
    }
    p_tile[i] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Online softmax: simdgroup sg owns rows sg, sg + NSG, ...; lane j holds key j.
  for (int t = 0; t < ROWS_PER_SG; ++t) {
    const int r = sg + t * NSG;
    const bool has_key = lane < TK && key0 + lane < n_keys;
    const float s = has_key ? p_tile[r * TK + lane] : DFLASH_NEG_LARGE;
    const float new_max = max(row_max[t], simd_max(s));
    const float p = has_key ? exp2(s - new_max) : 0.0f;
    const float alpha = exp2(row_max[t] - new_max);
    row_l[t] = row_l[t] * alpha + simd_sum(p);
    row_max[t] = new_max;
    if (lane < TK) {
      p_tile[r * TK + lane] = p;
    }
    if (lane == 0) {
      row_alpha[r] = alpha;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int k = 0; k < OUT_PER_THREAD; ++k) {
    const int i = tid + k * NT;
    const int r = i / D;
    const int d = i % D;
    float o = acc[k] * row_alpha[r];
    for (int j = 0; j < TK; ++j) {
      o += p_tile[r * TK + j] * v_tile[j * D + d];
    }
    acc[k] = o;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int t = 0; t < ROWS_PER_SG; ++t) {
  if (lane == 0) {
    row_sum[sg + t * NSG] = row_l[t];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int k = 0; k < OUT_PER_THREAD; ++k) {
  const int i = tid + k * NT;
  const int r = row0 + i / D;
  if (r < n_rows) {
    const int h = hkv * G + r / L;
    const int64_t o = ((int64_t(b) * n_q_heads + h) * L + r % L) * D + i % D;
    out[o] = static_cast<T>(acc[k] / row_sum[i / D]);
  }
}
