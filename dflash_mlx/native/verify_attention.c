/* Attention of a verify forward (a few query positions over a long KV cache) on the CPU.
 *
 * MLX's CPU softmax takes its exps one element at a time: over 16 positions and 4k keys they
 * were most of a SmolLM2 verify forward. Here, per (batch, KV head), the query rows of the
 * whole group (its G heads x L positions) are packed as the lanes of vectors, as
 * few_rows_qmm.c packs rows: a key's element, broadcast, multiplies a vector of rows, so the
 * scores, their running maximum, the exps (a Cephes polynomial, cpu_math.py's) and their sums
 * all run over vectors of rows with no horizontal sums or transposes, and every key and value
 * is read once for all of its group's rows. Keys go a tile at a time (flash attention's
 * running maximum and rescaling); over many keys a KV head's keys are split into tasks, taken
 * by as many threads as pay (threads.h), and the partial sums merged. Keys and values are read
 * through their strides (a view of a preallocated KV cache is not copied). Built and called by
 * verify_attention.cpp, an MLX primitive (cpu_attention.py).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "threads.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
#define LANES 16
#define REGISTERS 32
#elif defined(__AVX__)
#define LANES 8
#define REGISTERS 16
#else
#define LANES 4
#define REGISTERS 16
#endif
#define TILE 64        /* keys scored at a time */
#define MAX_CHUNK 4    /* row vectors one micro-kernel call takes */
#define MIN_SPLIT 512  /* fewest keys a thread takes of one KV head */
#define START -1e30f   /* running maximum before any key: finite, so exp(START - m) is 0 */
typedef float vec __attribute__((vector_size(LANES * 4)));
typedef int ivec __attribute__((vector_size(LANES * 4)));

static inline vec splat(float x) { return (vec){} + x; }
static inline vec blend(ivec m, vec a, vec b) { return (vec)((m & (ivec)a) | (~m & (ivec)b)); }
static inline vec vmax(vec a, vec b) { return blend(a > b, a, b); }

/* e^x for x <= 0 as cpu_math._exp_parts: 0 below float32's smallest normal number. */
static inline vec exp_nonpositive(vec x) {
  x = blend(x < 0, x, splat(0.f));
  ivec normal = x >= -87.33654f;
  x = vmax(x, splat(-87.33654f));
  vec n = (x * 1.4426950408889634f + 12582912.f) - 12582912.f;
  vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  return (vec)((ivec)(p * (vec)bits) & normal);
}

/* How many of `a` one call takes along with RC row vectors: half the registers accumulate. */
#define BLOCK(RC) ((REGISTERS / 2) / (RC) > 1 ? (REGISTERS / 2) / (RC) : 1)

/* c[a * RV + v] (+)= sum over t < T of x[a * sa + t * st] * y[t * RV + v], for a < NA and
 * v < RC: a key's scores (a: key, t: dimension) or the values' weighted sums (a: dimension,
 * t: key). NA x RC accumulators stay in registers; NA and RC are constants where inlined. */
static inline __attribute__((always_inline)) void outer(int NA, int RC, int T, int RV,
                                                        const float *x, long sa, long st,
                                                        const vec *y, vec *c, int accumulate) {
  vec acc[BLOCK(1)][MAX_CHUNK], yv[MAX_CHUNK];
  for (int a = 0; a < NA; a++)
    for (int v = 0; v < RC; v++) acc[a][v] = accumulate ? c[a * RV + v] : splat(0.f);
  for (int t = 0; t < T; t++) {
    for (int v = 0; v < RC; v++) yv[v] = y[(long)t * RV + v];
    for (int a = 0; a < NA; a++) {
      float xa = x[a * sa + t * st];
      for (int v = 0; v < RC; v++) acc[a][v] += xa * yv[v];
    }
  }
  for (int a = 0; a < NA; a++)
    for (int v = 0; v < RC; v++) c[a * RV + v] = acc[a][v];
}

/* `outer` over all A of a, RC (1..MAX_CHUNK) row vectors at a time, in register blocks. */
static void outer_all(int A, int RC, int T, int RV, const float *x, long sa, long st,
                      const vec *y, vec *c, int accumulate) {
#define CALLS(R)                                                                            \
  case R: {                                                                                 \
    int a = 0;                                                                              \
    for (; a + BLOCK(R) <= A; a += BLOCK(R))                                                \
      outer(BLOCK(R), R, T, RV, x + a * sa, sa, st, y, c + (long)a * RV, accumulate);       \
    for (; a < A; a++) outer(1, R, T, RV, x + a * sa, sa, st, y, c + (long)a * RV, accumulate); \
    break;                                                                                  \
  }
  switch (RC) {
    CALLS(1)
    CALLS(2)
    CALLS(3)
    CALLS(4)
  }
#undef CALLS
}

typedef struct {
  int B, H, Hkv, L, S, D, Dv;
  float scale;
  const float *q, *k, *v;
  const long *qs, *ks, *vs; /* element strides of each array's 4 axes */
  const unsigned char *mask; /* boolean (B, H, L, S) through ms, or NULL */
  const long *ms;
  int causal;
} problem;

/* Whether the query at position i (its mask row `mrow`) sees key j. */
static inline int seen(const problem *p, const unsigned char *mrow, int i, int j) {
  if (p->causal) return j <= p->S - p->L + i;
  return !mrow || mrow[(long)j * p->ms[3]];
}

/* Keys [s0, s1) of KV head `kvh` of batch `b` for the group's rows (qt: its queries, RV row
 * vectors x D, dimension-major, scaled): the running maximum m, sum l (RV each) and the
 * unnormalised weighted sums acc (Dv x RV). */
static int partial(const problem *p, int b, int kvh, int s0, int s1, const vec *qt, int RV,
                   vec *m, vec *l, vec *acc) {
  int G = p->H / p->Hkv, R = G * p->L;
  vec *scores = aligned_alloc(64, sizeof(vec) * TILE * RV);
  const unsigned char **mrows = malloc(sizeof(*mrows) * (R > 0 ? R : 1));
  if (!scores || !mrows) {
    free(scores);
    free(mrows);
    return 0;
  }
  for (int r = 0; r < R; r++)
    mrows[r] = p->mask ? p->mask + b * p->ms[0] + (kvh * G + r / p->L) * p->ms[1] +
                             (long)(r % p->L) * p->ms[2]
                       : NULL;
  const float *k = p->k + b * p->ks[0] + kvh * p->ks[1];
  const float *v = p->v + b * p->vs[0] + kvh * p->vs[1];
  for (int u = 0; u < RV; u++) m[u] = splat(START), l[u] = splat(0.f);
  memset(acc, 0, sizeof(vec) * p->Dv * RV);
  int chunks = (RV + MAX_CHUNK - 1) / MAX_CHUNK, rc = (RV + chunks - 1) / chunks;
  for (int j0 = s0; j0 < s1; j0 += TILE) {
    int T = s1 - j0 < TILE ? s1 - j0 : TILE;
    for (int u = 0; u < RV; u += rc) {
      int n = RV - u < rc ? RV - u : rc;
      outer_all(T, n, p->D, RV, k + j0 * p->ks[2], p->ks[2], p->ks[3], qt + u, scores + u, 0);
    }
    if (p->mask || (p->causal && j0 + T - 1 > p->S - p->L))
      for (int t = 0; t < T; t++) {
        float *row = (float *)(scores + (long)t * RV);
        for (int r = 0; r < R; r++)
          if (!seen(p, mrows[r], r % p->L, j0 + t)) row[r] = -INFINITY;
      }
    for (int u = 0; u < RV; u++) {
      vec top = m[u];
      for (int t = 0; t < T; t++) top = vmax(top, scores[t * RV + u]);
      vec rescale = exp_nonpositive(m[u] - top), sum = splat(0.f);
      for (int t = 0; t < T; t++) {
        vec *score = scores + t * RV + u;
        sum += *score = exp_nonpositive(*score - top);
      }
      m[u] = top;
      l[u] = l[u] * rescale + sum;
      for (int d = 0; d < p->Dv; d++) acc[d * RV + u] *= rescale;
    }
    for (int u = 0; u < RV; u += rc) {
      int n = RV - u < rc ? RV - u : rc;
      outer_all(p->Dv, n, T, RV, v + j0 * p->vs[2], p->vs[3], p->vs[2], scores + u, acc + u, 1);
    }
  }
  free(scores);
  free(mrows);
  return 1;
}

/* A task per 4M multiply-adds of scores, whatever the threads: a short context's attention is
 * one task per KV head (it is over in well under a millisecond). The split, and so the sums'
 * order, depends on the problem alone, not on how many threads take the tasks. */
static int task_count(const problem *p) {
  long tasks = (long)p->B * p->H * p->L * p->S * p->D / (1L << 22);
  return tasks < 1 ? 1 : tasks > 64 ? 64 : (int)tasks;
}

/* The most threads it takes: one per 8M multiply-adds, up to OpenMP's count; how many it takes
 * is measured (threads.h). */
static int most_threads(const problem *p) {
  long threads = (long)p->B * p->H * p->L * p->S * p->D / (1L << 23);
#ifdef _OPENMP
  if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
#endif
  return threads < 1 ? 1 : (int)threads;
}

/* out (B, H, L, Dv), contiguous = softmax(scale * q k^T, masked) v, for float32 q (B, H, L, D),
 * k (B, Hkv, S, D) and v (B, Hkv, S, Dv), through their strides; `mask` a boolean array
 * (B, H, L, S) through its strides (0 on broadcast axes), or NULL with `causal` 1 (query i
 * sees keys up to S - L + i) or 0 (all keys). A row that sees no key gets 0. Returns 0 where
 * H is not a multiple of Hkv or memory runs out. */
int dflash_verify_attention(int B, int H, int Hkv, int L, int S, int D, int Dv, float scale,
                            const float *q, const long *qs, const float *k, const long *ks,
                            const float *v, const long *vs, const unsigned char *mask,
                            const long *ms, int causal, float *out) {
  if (Hkv < 1 || H % Hkv != 0) return 0;
  if ((long)B * H * L * Dv == 0) return 1;
  problem p = {B, H, Hkv, L, S, D, Dv, scale, q, k, v, qs, ks, vs, mask, ms, causal && !mask};
  int G = H / Hkv, R = G * L, RV = (R + LANES - 1) / LANES, heads = B * Hkv;
  int splits = (task_count(&p) + heads - 1) / heads;
  if (splits > S / MIN_SPLIT) splits = S / MIN_SPLIT > 1 ? S / MIN_SPLIT : 1;
  int span = (S + splits - 1) / splits, tasks = heads * splits;
  long per_task = (long)RV * (2 + Dv);
  vec *qt = aligned_alloc(64, sizeof(vec) * heads * D * RV);
  vec *parts = aligned_alloc(64, sizeof(vec) * tasks * per_task);
  if (!qt || !parts) {
    free(qt);
    free(parts);
    return 0;
  }
  memset(qt, 0, sizeof(vec) * heads * D * RV);
  for (int h = 0; h < heads; h++) {
    int b = h / Hkv, kvh = h % Hkv;
    float *lanes = (float *)(qt + (long)h * D * RV);
    for (int r = 0; r < R; r++) {
      const float *row = q + b * qs[0] + (kvh * G + r / L) * qs[1] + (long)(r % L) * qs[2];
      for (int d = 0; d < D; d++)
        lanes[((long)d * RV + r / LANES) * LANES + r % LANES] = scale * row[d * qs[3]];
    }
  }
  int failed = 0;
  threads_choice choice; /* a kind per (query rows, heads, dimension, keys to a power of 2) */
  long kind = ((long)R << 40) | ((long)heads << 24) | (D << 8) | (32 - __builtin_clz(S));
  int threads = threads_for(kind, most_threads(&p), (double)tasks * span, &choice);
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1) \
    reduction(| : failed)
  for (int t = 0; t < tasks; t++) {
    int h = t / splits, s0 = t % splits * span, s1 = s0 + span < S ? s0 + span : S;
    vec *part = parts + t * per_task;
    if (s0 < s1 && !partial(&p, h / Hkv, h % Hkv, s0, s1, qt + (long)h * D * RV, RV, part,
                            part + RV, part + 2 * RV))
      failed = 1;
    else if (s0 >= s1) {
      memset(part, 0, sizeof(vec) * per_task);
      for (int u = 0; u < RV; u++) part[u] = splat(START);
    }
  }
  threads_done(&choice);
  for (int h = 0; h < heads && !failed; h++) {
    const vec *first = parts + (long)h * splits * per_task;
    float *head_out = out + ((long)h / Hkv * H + (long)(h % Hkv) * G) * L * Dv;
    for (int u = 0; u < RV; u++) {
      vec top = splat(START), total = splat(0.f), weights[splits];
      for (int s = 0; s < splits; s++) top = vmax(top, first[s * per_task + u]);
      for (int s = 0; s < splits; s++) {
        weights[s] = exp_nonpositive(first[s * per_task + u] - top);
        total += weights[s] * first[s * per_task + RV + u];
      }
      vec inverse = blend(total > 0, 1.f / total, splat(0.f));
      int lanes = R - u * LANES < LANES ? R - u * LANES : LANES;
      for (int d = 0; d < Dv; d++) {
        vec sum = splat(0.f);
        for (int s = 0; s < splits; s++)
          sum += weights[s] * first[s * per_task + (2 + d) * RV + u];
        sum *= inverse;
        for (int lane = 0; lane < lanes; lane++)
          head_out[(long)(u * LANES + lane) * Dv + d] = sum[lane];
      }
    }
  }
  free(qt);
  free(parts);
  return !failed;
}

void dflash_attention_calls_by_threads(long *out, int n) { calls_by_threads_into(out, n); }
void dflash_attention_force_threads(int n) { force_threads(n); }
