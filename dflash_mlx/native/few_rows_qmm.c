/* Few-row products with MLX's affine-quantized weights on the CPU, bit for bit MLX's own.
 *
 * MLX's CPU `quantized_matmul` (mlx/backend/cpu/quantized.cpp, `_qmm_t`; on x86 its SIMD
 * variant is compiled out, `simd::max_size<float>` being 1) computes every row of x on its own:
 * for each output n it walks all of row n of the packed weights, dequantizing each element as
 * `scale * q + bias` and adding `x[k] * that` to one float sum, k = 0, 1, ... in order, with a
 * separate multiply and add (the wheel is built without FMA). A 16-row product costs 16
 * one-row products: a SmolLM2 verify forward over 16 positions ~14x one position.
 *
 * Here each weight row is dequantized once (a chunk of K at a time, exactly as MLX does it)
 * and used for up to 2 * LANES rows of x at once: the rows are packed as the lanes of a vector
 * (`packed[k]` holds element k of every row), so each dequantized element, broadcast,
 * multiplies one vector and is added to that row set's accumulator: every lane adds its own
 * row's terms in MLX's order, with MLX's rounding (built with -ffp-contract=off: no FMA).
 * BJ weight rows are walked together to keep BJ independent sums in flight.
 * Built and called by few_rows_qmm.cpp, an MLX primitive (quantized_cpu.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "threads.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define BJ 8     /* weight rows walked together */
#define CHUNK 256 /* elements of K dequantized at a time: a multiple of every group size */
typedef float vec __attribute__((vector_size(LANES * 4)));

int dflash_qmm_max_rows(void) { return 2 * LANES; }

/* Elements k0..k1 of weight row `n`, dequantized as MLX does: scale * q + bias. */
static inline void dequantize(float *out, const uint8_t *row, const float *scales,
                              const float *biases, int bits, int group, int k0, int k1) {
  for (int g0 = k0; g0 < k1; g0 += group) {
    float s = scales[g0 / group], b = biases[g0 / group];
    if (bits == 4)
      for (int k = g0; k < g0 + group; k += 2) {
        uint8_t q = row[k / 2];
        out[k - k0] = s * (float)(q & 15) + b;
        out[k - k0 + 1] = s * (float)(q >> 4) + b;
      }
    else
      for (int k = g0; k < g0 + group; k++) out[k - k0] = s * (float)row[k] + b;
  }
}

/* acc[g][j] += packed[k][g] * w[j][k] for k in [0, n): G row sets, J weight rows. */
static inline __attribute__((always_inline)) void accumulate(int G, int J, int n,
                                                             const vec *packed,
                                                             const float (*w)[CHUNK],
                                                             vec acc[2][BJ]) {
  for (int k = 0; k < n; k++)
    for (int g = 0; g < G; g++) {
      vec x = packed[(long)k * G + g];
      for (int j = 0; j < J; j++) acc[g][j] += x * w[j][k];
    }
}

/* The most threads a product takes: one per 4M weight elements (an LM head's product), up to
 * OpenMP's count; how many it takes is measured (threads.h). A layer's products take well
 * under a millisecond on one thread (a 16-position SmolLM2 forward on a shared, loaded machine
 * took 3-6x longer with a thread per 64K elements, as few_rows_sgemm.c has, before the count
 * was measured). */
static int most_threads(int N, int K) {
  long threads = (long)N * K / (1L << 22);
#ifdef _OPENMP
  if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
#endif
  return threads < 1 ? 1 : (int)threads;
}

/* out[m * N + n] = sum over k of x_m[k * x_step] * (scale * q[n][k] + bias), for M <= 2 * LANES
 * rows starting at `rows[m]`; w holds N rows of K * bits / 8 bytes, scales and biases N rows
 * of K / group. Returns 0 where it does not apply (rows, bits, group, K) or memory runs out. */
int dflash_qmm_rows(int M, int N, int K, int bits, int group, const float *const *rows,
                    long x_step, const uint32_t *w, const float *scales, const float *biases,
                    float *out) {
  if (M < 1 || M > 2 * LANES || (bits != 4 && bits != 8) || K % group != 0 ||
      CHUNK % group != 0 || (group != 32 && group != 64 && group != 128))
    return 0;
  int G = M > LANES ? 2 : 1;
  vec *packed = aligned_alloc(64, (size_t)K * G * sizeof(vec));
  if (!packed) return 0;
  memset(packed, 0, (size_t)K * G * sizeof(vec));
  float *lanes = (float *)packed;
  for (int m = 0; m < M; m++)
    for (int k = 0; k < K; k++)
      lanes[((long)k * G + m / LANES) * LANES + m % LANES] = rows[m][(long)k * x_step];
  long row_bytes = (long)K * bits / 8, groups = K / group;
  threads_choice choice; /* a kind per product shape and row count */
  long kind = ((long)N << 36) | ((long)K << 8) | (M << 2) | (bits >> 2);
  int tiles = (N + BJ - 1) / BJ;
  int threads = threads_for(kind, most_threads(N, K), (double)N * K, &choice);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int t = 0; t < tiles; t++) {
    int n0 = t * BJ, J = N - n0 < BJ ? N - n0 : BJ;
    float wd[BJ][CHUNK] __attribute__((aligned(64)));
    vec acc[2][BJ];
    memset(acc, 0, sizeof acc);
    for (int k0 = 0; k0 < K; k0 += CHUNK) {
      int k1 = K - k0 < CHUNK ? K : k0 + CHUNK;
      for (int j = 0; j < J; j++) {
        long n = n0 + j;
        dequantize(wd[j], (const uint8_t *)w + n * row_bytes, scales + n * groups,
                   biases + n * groups, bits, group, k0, k1);
      }
      const vec *p = packed + (long)k0 * G;
      if (G == 1 && J == BJ)
        accumulate(1, BJ, k1 - k0, p, (const float(*)[CHUNK])wd, acc);
      else if (J == BJ)
        accumulate(2, BJ, k1 - k0, p, (const float(*)[CHUNK])wd, acc);
      else
        accumulate(G, J, k1 - k0, p, (const float(*)[CHUNK])wd, acc);
    }
    for (int j = 0; j < J; j++)
      for (int m = 0; m < M; m++) out[(long)m * N + n0 + j] = acc[m / LANES][j][m % LANES];
  }
  threads_done(&choice);
  free(packed);
  return 1;
}

void dflash_qmm_calls_by_threads(long *out, int n) { calls_by_threads_into(out, n); }
void dflash_qmm_force_threads(int n) { force_threads(n); }
