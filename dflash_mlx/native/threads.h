/* How many OpenMP threads a kernel call takes, chosen by what the clock says now.
 *
 * Splitting a small product over every core pays on a quiet machine, and costs more than it
 * saves where another process keeps a core busy: the product waits, at its end, for the thread
 * that shares its core with that process. So each kind of call (its shape, from the caller)
 * keeps the mean time per unit of work of each thread count it may take (1, 2, 4, ... up to
 * the most its size allows), plays the cheapest, and plays each other count again once it has
 * sat out 32 times as many calls as it measured dearer than the cheapest: exploring costs
 * about 1/32 of the calls' time whatever the gap, and a machine that changes (a busy process
 * starting or stopping) is noticed within a few hundred calls. The estimates are per calling
 * thread (MLX runs a stream's kernels on one thread), so no lock is taken.
 *
 * DFLASH_MLX_THREADS=n (n >= 1) takes min(n, the most its size allows) threads instead, every
 * call (`force_threads`, for benchmarks that compare settings in one process). The kernels' results do not depend on the count: every output is summed by one thread,
 * in the same order, whatever the split.
 */
#ifndef DFLASH_THREADS_H
#define DFLASH_THREADS_H
#include <stdlib.h>
#include <time.h>

#define ARMS 5       /* 1, 2, 4, 8, 16 threads (the last arm takes the most allowed) */
#define SLOTS 256    /* kinds of call remembered per calling thread */
#define PROBES 8     /* slots a kind may take, from its hash on */
#define PATIENCE 32  /* calls an arm sits out per unit of its cost ratio to the cheapest */
#define DECAY 0.125f /* weight of a new measurement in an arm's mean */

typedef struct {
  long key;          /* 0: free */
  float cost[ARMS];  /* mean seconds per unit of work; 0: not measured yet */
  int idle[ARMS];    /* calls since the arm was last played */
} call_kind;

typedef struct {
  call_kind *kind; /* NULL: nothing to measure (one thread allowed, or forced) */
  int arm;
  double work;
  struct timespec start;
} threads_choice;

static __thread call_kind kinds[SLOTS];
static long calls_by_threads[65]; /* calls that took n threads (64: 64 or more) */

/* How many of this library's calls took 1..n threads, into out[0..n-1] (the last, n or more);
 * each kernel exports it under a name of its own (a library loaded globally would otherwise
 * answer for the others). */
static void calls_by_threads_into(long *out, int n) {
  for (int i = 0; i < n && i < 64; i++) {
    out[i] = __atomic_load_n(&calls_by_threads[i + 1], __ATOMIC_RELAXED);
    for (int more = i + 2; i == n - 1 && more <= 64; more++)
      out[i] += __atomic_load_n(&calls_by_threads[more], __ATOMIC_RELAXED);
  }
}

static inline int counted(int threads) {
  __atomic_fetch_add(&calls_by_threads[threads < 64 ? threads : 64], 1, __ATOMIC_RELAXED);
  return threads;
}

static int forced = -1; /* threads every call takes (0: measured; -1: not read yet) */

/* DFLASH_MLX_THREADS, read once, or what `force_threads` set: 0 where neither (measured). */
static int forced_threads(void) {
  if (forced < 0) {
    const char *text = getenv("DFLASH_MLX_THREADS");
    int n = text ? atoi(text) : 0;
    forced = n > 0 ? n : 0;
  }
  return forced;
}

/* From now on every call takes min(n, the most its size allows) threads; 0: measured again.
 * Each kernel exports it under a name of its own, as calls_by_threads_into. */
static void force_threads(int n) { forced = n > 0 ? n : 0; }

static inline int arm_threads(int arm, int most) {
  return (1 << arm) < most ? 1 << arm : most;
}

static inline double seconds(const struct timespec *t) { return t->tv_sec + 1e-9 * t->tv_nsec; }

/* The threads a call of kind `key` (nonzero) takes, where its size allows at most `most`;
 * `work` is what its time is divided by (calls of one kind but different sizes compare).
 * Pass the choice to threads_done when the call has finished. */
static int threads_for(long key, int most, double work, threads_choice *choice) {
  choice->kind = NULL;
  if (most <= 1) return counted(1);
  int forced = forced_threads();
  if (forced) return counted(forced < most ? forced : most);
  unsigned long slot = ((unsigned long)key * 0x9E3779B97F4A7C15UL) >> 56; /* 256 slots */
  call_kind *kind = NULL;
  for (int p = 0; p < PROBES && !kind; p++) {
    call_kind *at = &kinds[(slot + p) % SLOTS];
    if (at->key == key || at->key == 0) kind = at;
  }
  if (!kind) kind = &kinds[slot]; /* all taken: the kind in its first slot starts over */
  if (kind->key != key) *kind = (call_kind){.key = key};
  int arms = 1;
  while (arms < ARMS && (1 << (arms - 1)) < most) arms++;
  int best = 0;
  for (int a = 1; a < arms; a++)
    if (kind->cost[a] > 0 && (kind->cost[best] == 0 || kind->cost[a] < kind->cost[best]))
      best = a;
  int arm = best;
  for (int a = 0; a < arms; a++) {
    kind->idle[a]++;
    if (a != best && arm == best &&
        (kind->cost[a] == 0 ||
         kind->idle[a] >= PATIENCE * kind->cost[a] / (kind->cost[best] + 1e-30f)))
      arm = a;
  }
  kind->idle[arm] = 0;
  choice->kind = kind;
  choice->arm = arm;
  choice->work = work > 0 ? work : 1;
  clock_gettime(CLOCK_MONOTONIC, &choice->start);
  return counted(arm_threads(arm, most));
}

/* Record the time of the call `choice` was made for. */
static void threads_done(const threads_choice *choice) {
  if (!choice->kind) return;
  struct timespec end;
  clock_gettime(CLOCK_MONOTONIC, &end);
  float cost = (float)((seconds(&end) - seconds(&choice->start)) / choice->work);
  float *mean = &choice->kind->cost[choice->arm];
  *mean = *mean == 0 ? cost : *mean + DECAY * (cost - *mean);
}
#endif
