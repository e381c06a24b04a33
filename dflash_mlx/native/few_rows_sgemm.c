/* A cblas_sgemm for MLX's CPU backend that computes products with few rows itself.
 *
 * MLX's CPU matmuls call `cblas_sgemm`. For `x @ W.T` with a few rows of x (a decoding step
 * has 1, a verify forward 2-16, a tree forward up to 33) OpenBLAS packs a copy of all of W
 * on every call, which costs more than the product: a one-row 576x1536 product took 0.18 ms
 * through OpenBLAS 0.3.21 and 0.064 ms here, four rows 0.31 and 0.06 ms, sixteen 0.26 and
 * 0.14 ms (SmolLM2's shapes, the weights streamed from memory; benchmarks/blas_matmul.py).
 * Here every output is a dot product of a row of the small operand with a row of the large one,
 * read where they lie: W is streamed once, each of its rows used for all the few rows while it
 * is in cache, over OpenMP threads. With AVX-512 or AVX2, from 5 rows on (to 32 or 16), the
 * few rows are first packed as columns so that no dot product needs a sum across lanes
 * (`column_dots`). Every other call goes to the BLAS it was bound over (`dflash_set_fallback`),
 * as do transposed-left, column-major and K = 0 calls.
 * Built and loaded by blas.py. Sums are in a different order than OpenBLAS's (float32 results
 * agree to ~1e-7 relative).
 */
#include <stdlib.h>
#include <string.h>

#include "threads.h"
#ifdef _OPENMP
#include <omp.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define MAX_ROWS 32 /* with weights streamed, faster than OpenBLAS 0.3.21 up to here built for
                      AVX2 (up to 256 rows with AVX-512): benchmarks/README.md */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
static sgemm_fn fallback;

void dflash_set_fallback(sgemm_fn f) { fallback = f; }

/* A tile is up to 4 rows of the small operand by TILE rows of the large one: its 4 x TILE
 * accumulators and 4 + TILE loaded vectors fit the 32 vector registers of AVX-512, or the 16 of
 * AVX2 / NEON. One row (a decoding step) takes 4 rows of the large one at a time everywhere. */
#ifdef __AVX512F__
#define LANES 16
#define TILE 4
#else
#define LANES 8
#define TILE 2
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));
typedef float vec4 __attribute__((vector_size(16)));

static inline vec load(const float *p) {
  vec v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline float sum_lanes(vec v) {
  vec4 s = {0, 0, 0, 0}, part;
  for (int i = 0; i < LANES; i += 4) {
    memcpy(&part, (const char *)&v + 4 * i, sizeof part);
    s += part;
  }
  return (s[0] + s[2]) + (s[1] + s[3]);
}

/* out[i * si + j * sj] = alpha * (small[i] . big[j]) (+ beta * out) for i < R, j < J (<= 4).
 * Inlined with constant R and J, the accumulators stay in registers. `next` is the following
 * tile of `big`, prefetched while this one is read. */
static inline __attribute__((always_inline)) void tile(int R, int J, int K, const float *small,
                                                       int lds, const float *big, int ldb,
                                                       float alpha, float beta, float *out,
                                                       long si, long sj, const float *next) {
  vec acc[4][4] = {{{0}}};
  int k = 0;
  for (; k + LANES <= K; k += LANES) {
    vec b[4], a[4];
    if (next)
      for (int j = 0; j < J; j++) __builtin_prefetch(next + (long)j * ldb + k, 0, 0);
    for (int j = 0; j < J; j++) b[j] = load(big + (long)j * ldb + k);
    for (int i = 0; i < R; i++) a[i] = load(small + (long)i * lds + k);
    if (R > 1) /* keep every loaded vector in a register: folded into the multiply-adds as
                  memory operands, each would be loaded R or J times (35 % of peak, not 55 %) */
      for (int v = 0; v < 4; v++) {
        if (v < J) __asm__("" : "+v"(b[v]));
        if (v < R) __asm__("" : "+v"(a[v]));
      }
    for (int i = 0; i < R; i++)
      for (int j = 0; j < J; j++) acc[i][j] += a[i] * b[j];
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < J; j++) {
      float s = sum_lanes(acc[i][j]);
      for (int t = k; t < K; t++) s += small[(long)i * lds + t] * big[(long)j * ldb + t];
      float *o = out + i * si + j * sj;
      *o = beta == 0.0f ? alpha * s : alpha * s + beta * *o; /* beta 0: out is not read */
    }
}

/* The most threads a product takes: one per 256 KB of the large operand (B rows of K), up to
 * OpenMP's count; how many it takes is measured (threads.h). */
static int most_threads(int B, int K) {
  long threads = (long)B * K / 65536;
#ifdef _OPENMP
  if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
#endif
  return (int)threads;
}

/* A product's kind for threads.h: its kernel (dots or columns), rows of the small operand
 * (1, 2, 3-4, 5-8, ...), K and B to its two leading bits (a weight's rows, or a growing KV
 * cache's keys, which change kind only now and then). */
static long product_kind(int columns, int S, int B, int K) {
  int shift = 30 - __builtin_clz(B) > 0 ? 30 - __builtin_clz(B) : 0;
  return ((long)(B >> shift) << 50) | ((long)shift << 44) | ((long)K << 8) |
         ((32 - __builtin_clz(S)) << 1) | columns;
}

#if LANES == 16 || defined(__AVX2__) /* where it was measured: not NEON */
#define COLUMNS
/* From 5 rows of the small operand on (a verify forward's, a tree's), up to 2 * LANES: no sums
 * across lanes. The few rows are packed as columns, `packed[G * k + g]` holding element k of
 * rows LANES * g.. in its lanes (zeros past the last row), and each element of BJ rows of big,
 * broadcast, multiplies its column: one multiply-add per element of big, at ~80 % of peak
 * where the dot products above reach ~55 %. Two sets of accumulators keep 2 * BJ
 * multiply-adds in flight: with one vector of rows (G = 1) even and odd k, with two, one each
 * (2 * BJ + 2 vectors: 8 rows of big with AVX-512's 32 registers, 4 with AVX2's 16). A
 * 16-row verify forward's products got ~40 % cheaper (benchmarks/README.md). */
#define BJ (LANES == 16 ? 8 : 4)

static inline __attribute__((always_inline)) void columns(int G, int J, int K, const vec *packed,
                                                          const float *big, int ldb,
                                                          vec acc[2][BJ], const float *next) {
  const float *row[BJ];
  for (int j = 0; j < BJ; j++) {
    acc[0][j] = acc[1][j] = (vec){0};
    row[j] = big + (long)(j < J ? j : 0) * ldb;
  }
  int step = G == 1 ? 2 : 1, k = 0;
  for (; k + step <= K; k += step) {
    vec a = packed[G * k], b = packed[G * k + 1];
    if (next && (k & 15) < step)
      for (int j = 0; j < J; j++) __builtin_prefetch(next + (long)j * ldb + k, 0, 0);
    for (int j = 0; j < J; j++) acc[0][j] += row[j][k] * a;
    for (int j = 0; j < J; j++) acc[1][j] += row[j][k + step - 1] * b;
  }
  for (; k < K; k++) /* the last of an odd K, G = 1 */
    for (int j = 0; j < J; j++) acc[0][j] += row[j][k] * packed[k];
}

/* Every row of `small` (5 <= S <= 2 * LANES) dotted with every row of `big` (B rows), K long;
 * false where the packed copy could not be allocated. */
static int column_dots(int S, int B, int K, const float *small, int lds, const float *big,
                       int ldb, float alpha, float beta, float *out, long si, long sj) {
  int G = S > LANES ? 2 : 1;
  vec *packed = aligned_alloc(64, (size_t)K * G * sizeof(vec));
  if (!packed) return 0;
  memset(packed, 0, (size_t)K * G * sizeof(vec));
  float *lanes = (float *)packed;
  for (int i = 0; i < S; i++)
    for (int k = 0; k < K; k++)
      lanes[((long)G * k + i / LANES) * LANES + i % LANES] = small[(long)i * lds + k];
  threads_choice choice;
  int tiles = (B + BJ - 1) / BJ;
  int threads = threads_for(product_kind(1, S, B, K), most_threads(B, K), (double)B * K, &choice);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int t = 0; t < tiles; t++) {
    int j0 = BJ * t, J = B - j0 < BJ ? B - j0 : BJ;
    const float *b = big + (long)j0 * ldb, *next = t + 1 < tiles ? b + (long)BJ * ldb : 0;
    vec acc[2][BJ];
    if (J == BJ && G == 1)
      columns(1, BJ, K, packed, b, ldb, acc, next);
    else if (J == BJ)
      columns(2, BJ, K, packed, b, ldb, acc, next);
    else
      columns(G, J, K, packed, b, ldb, acc, 0);
    for (int j = 0; j < J; j++)
      for (int i = 0; i < S; i++) {
        float s = G == 1 ? acc[0][j][i] + acc[1][j][i] : acc[i / LANES][j][i % LANES];
        float *o = out + i * si + (j0 + j) * sj;
        *o = beta == 0.0f ? alpha * s : alpha * s + beta * *o;
      }
  }
  threads_done(&choice);
  free(packed);
  return 1;
}
#endif

/* Every row of `small` (S <= MAX_ROWS rows) dotted with every row of `big` (B rows), K long. */
static void dots(int S, int B, int K, const float *small, int lds, const float *big, int ldb,
                 float alpha, float beta, float *out, long si, long sj) {
#ifdef COLUMNS
  if (S >= 5 && S <= 2 * LANES &&
      column_dots(S, B, K, small, lds, big, ldb, alpha, beta, out, si, sj))
    return;
#endif
  threads_choice choice;
  int width = S == 1 ? 4 : TILE, tiles = (B + width - 1) / width;
  int threads = threads_for(product_kind(0, S, B, K), most_threads(B, K),
                            (double)B * K * (S + 3) / 4, &choice);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int t = 0; t < tiles; t++) {
    int j = width * t, J = B - j < width ? B - j : width;
    for (int i = 0; i < S; i += 4) {
      int R = S - i < 4 ? S - i : 4;
      const float *a = small + (long)i * lds, *b = big + (long)j * ldb;
      const float *next = i == 0 && t + 1 < tiles ? b + (long)width * ldb : 0;
      float *o = out + i * si + j * sj;
      if (J == TILE && R == 4)
        tile(4, TILE, K, a, lds, b, ldb, alpha, beta, o, si, sj, next);
      else if (J == TILE && R == 3)
        tile(3, TILE, K, a, lds, b, ldb, alpha, beta, o, si, sj, next);
      else if (J == TILE && R == 2)
        tile(2, TILE, K, a, lds, b, ldb, alpha, beta, o, si, sj, next);
      else if (J == 4 && R == 1) /* one row: a decoding step */
        tile(1, 4, K, a, lds, b, ldb, alpha, beta, o, si, sj, next);
      else if (J == TILE && R == 1) /* the last of 5, 9 or 13 rows where TILE is 2 */
        tile(1, TILE, K, a, lds, b, ldb, alpha, beta, o, si, sj, next);
      else
        tile(R, J, K, a, lds, b, ldb, alpha, beta, o, si, sj, 0);
    }
  }
  threads_done(&choice);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc) {
  /* C = A B^T, row-major: C[i][j] = A[i] . B[j] */
  if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && K > 0) {
    if (M <= MAX_ROWS && N > M) {
      dots(M, N, K, A, lda, B, ldb, alpha, beta, C, ldc, 1);
      return;
    }
    if (N <= MAX_ROWS && M > N) {
      dots(N, M, K, B, ldb, A, lda, alpha, beta, C, 1, ldc);
      return;
    }
  }
  fallback(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void dflash_sgemm_calls_by_threads(long *out, int n) { calls_by_threads_into(out, n); }
void dflash_sgemm_force_threads(int n) { force_threads(n); }
