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
 * few rows are first packed as columns (`column_dots`). Every other call goes to the BLAS it
 * was bound over (`dflash_set_fallback`), as do transposed-left, column-major and K = 0 calls.
 * Every output is summed in one order (`tile`'s), whatever the other rows: each row of a
 * product has the bits it has alone. OpenBLAS's order differs (float32 results agree to ~1e-7
 * relative). Built and loaded by blas.py, with multiply-adds fused everywhere alike.
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

static inline vec load(const float *p) {
  vec v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* The order in which an output's LANES partial sums (`parts`, of type T: floats, or vectors
 * adding lane by lane) are added up, one definition for every kernel path: by fours from
 * zero, then the four pairwise. */
#define ADD_PARTS(T, parts)                                                                   \
  ({                                                                                          \
    T four_[4];                                                                               \
    for (int m_ = 0; m_ < 4; m_++) four_[m_] = (T){0} + (parts)[m_];                         \
    for (int l_ = 4; l_ < LANES; l_ += 4)                                                     \
      for (int m_ = 0; m_ < 4; m_++) four_[m_] += (parts)[l_ + m_];                           \
    (four_[0] + four_[2]) + (four_[1] + four_[3]);                                            \
  })

static inline float sum_lanes(vec v) { return ADD_PARTS(float, v); }

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
      for (int t = k; t < K; t++) /* fused as written: a compiler may fuse `s += a * b` or not */
        s = __builtin_fmaf(small[(long)i * lds + t], big[(long)j * ldb + t], s);
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
 * rows LANES * g.. in its lanes (zeros past the last row), and each element of a row of big,
 * broadcast, multiplies its column: a 16-row verify forward's products cost ~40 % less than as
 * dot products (benchmarks/README.md).
 * Each output is summed exactly as `tile` sums it, so that every row of a product has the bits
 * it has alone, a verify forward's rows those of decoding steps (greedy output equal to
 * mlx-lm's rests on it): LANES partial sums, element k into sum k % LANES, added up as
 * `sum_lanes` adds lanes, then the tail in order. The LANES sums of BJ rows of big by G vectors
 * of rows take more registers than there are, so they run CN at a time (`column_parts`), each
 * pass reading the BJ rows again from L1. */
#define BJ 3                         /* rows of big at a time */
#define CN1 (LANES == 16 ? 8 : 4)    /* partial sums at a time, one vector of rows (G = 1) */
#define CN2 (LANES == 16 ? 4 : 2)    /* two (G = 2): BJ * G * CN accumulators, 24 or 12 */

/* part[j][g][c0..c0+CN) += those partial sums of J (<= BJ) rows of big over K8 elements, whose
 * columns this pass reads in order from `pass`; with `ahead`, the rows that far on are
 * prefetched as these are read. */
static inline __attribute__((always_inline)) void column_parts(int G, int CN, int J, int c0,
                                                               int K8, const vec *pass,
                                                               const float *const *row,
                                                               vec part[BJ][2][LANES],
                                                               long ahead) {
  vec acc[BJ][2][LANES / 2];
  for (int j = 0; j < J; j++)
    for (int g = 0; g < G; g++)
      for (int c = 0; c < CN; c++) acc[j][g][c] = part[j][g][c0 + c];
  for (int k = 0; k < K8; k += LANES, pass += CN * G) {
    if (ahead && !(k & 15))
      for (int j = 0; j < J; j++) __builtin_prefetch(row[j] + ahead + k, 0, 0);
#pragma GCC unroll 16
    for (int c = 0; c < CN; c++) {
      /* in registers: each loaded once for the BJ rows, not BJ times (not an array, which
         GCC kept a copy of on the stack) */
      vec a0 = pass[G * c], a1 = G == 2 ? pass[G * c + 1] : a0;
      __asm__("" : "+v"(a0), "+v"(a1));
#pragma GCC unroll 4
      for (int j = 0; j < J; j++) {
        float b = row[j][k + c0 + c];
        acc[j][0][c] += b * a0;
        if (G == 2) acc[j][1][c] += b * a1;
      }
    }
  }
  for (int j = 0; j < J; j++)
    for (int g = 0; g < G; g++)
      for (int c = 0; c < CN; c++) part[j][g][c0 + c] = acc[j][g][c];
}

/* sums[j][g]: J (<= BJ) rows of big dotted with the G vectors of packed rows. */
static inline __attribute__((always_inline)) void column_tile(int G, int J, int K,
                                                              const vec *packed,
                                                              const float *const *row,
                                                              vec sums[BJ][2], long ahead) {
  vec part[BJ][2][LANES];
  for (int j = 0; j < J; j++)
    for (int g = 0; g < G; g++)
      for (int l = 0; l < LANES; l++) part[j][g][l] = (vec){0};
  int K8 = K - K % LANES, CN = G == 1 ? CN1 : CN2;
  for (int c0 = 0; c0 < LANES; c0 += CN) {
    const vec *pass = packed + (long)c0 * (K8 / LANES) * G;
    if (J == BJ && G == 1)
      column_parts(1, CN1, BJ, c0, K8, pass, row, part, c0 ? 0 : ahead);
    else if (J == BJ)
      column_parts(2, CN2, BJ, c0, K8, pass, row, part, c0 ? 0 : ahead);
    else
      column_parts(G, CN, J, c0, K8, pass, row, part, 0);
  }
  for (int j = 0; j < J; j++)
    for (int g = 0; g < G; g++) {
      vec s = ADD_PARTS(vec, part[j][g]);
      for (int k = K8; k < K; k++) /* the tail as `tile` takes it */
        for (int l = 0; l < LANES; l++) s[l] = __builtin_fmaf(row[j][k], packed[G * k + g][l], s[l]);
      sums[j][g] = s;
    }
}

/* Element k of the S rows of `small` into the G vectors at `lane` (zeros past row S); where
 * the next ones go. */
static float *pack_column(int S, int G, int k, const float *small, int lds, float *lane) {
  for (int i = 0; i < G * LANES; i++) *lane++ = i < S ? small[(long)i * lds + k] : 0.0f;
  return lane;
}

/* Every row of `small` (5 <= S <= 2 * LANES) dotted with every row of `big` (B rows), K long;
 * false where the packed copy could not be allocated. */
static int column_dots(int S, int B, int K, const float *small, int lds, const float *big,
                       int ldb, float alpha, float beta, float *out, long si, long sj) {
  int G = S > LANES ? 2 : 1;
  vec *packed = aligned_alloc(64, (size_t)K * G * sizeof(vec));
  if (!packed) return 0;
  /* in the order the passes read them: pass by pass (sums c0..c0+CN), chunk by chunk of LANES
   * elements, then the tail; zeros past the last row */
  int K8 = K - K % LANES, CN = G == 1 ? CN1 : CN2;
  float *lane = (float *)packed;
  for (int c0 = 0; c0 < LANES; c0 += CN)
    for (int k0 = 0; k0 < K8; k0 += LANES)
      for (int k = k0 + c0; k < k0 + c0 + CN; k++)
        lane = pack_column(S, G, k, small, lds, lane);
  for (int k = K8; k < K; k++) lane = pack_column(S, G, k, small, lds, lane);
  threads_choice choice;
  int tiles = (B + BJ - 1) / BJ;
  int threads = threads_for(product_kind(1, S, B, K), most_threads(B, K), (double)B * K, &choice);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int t = 0; t < tiles; t++) {
    int j0 = BJ * t, J = B - j0 < BJ ? B - j0 : BJ;
    const float *row[BJ];
    for (int j = 0; j < BJ; j++) row[j] = big + (long)(j0 + (j < J ? j : 0)) * ldb;
    vec sums[BJ][2];
    column_tile(G, J, K, packed, row, sums, t + 1 < tiles ? (long)BJ * ldb : 0);
    for (int j = 0; j < J; j++)
      for (int i = 0; i < S; i++) {
        float *o = out + i * si + (j0 + j) * sj;
        float s = sums[j][i / LANES][i % LANES];
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
    if (M <= MAX_ROWS && N >= M) {
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
