// CPU runtime for emulated Metal compute dispatches (see metal/README.md).
//
// Every threadgroup runs on one OS thread, each of its threads as a ucontext
// fiber. Fibers switch only at threadgroup_barrier and at simdgroup functions,
// and are resumed in a seeded shuffled order, so a run is deterministic yet a
// missing barrier shows up as stale reads. A barrier releases when every
// thread of the threadgroup reached it, a simdgroup function when every lane
// of the simdgroup did. Anything else (a thread that returned, lanes in different
// simdgroup functions) is divergence and aborts the run with a message.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace emu {

typedef unsigned int uint3_t __attribute__((ext_vector_type(3)));

// Every attribute mx.fast.metal_kernel can add to a kernel's signature.
struct Attrs {
  unsigned dispatch_quadgroups_per_threadgroup;
  unsigned dispatch_simdgroups_per_threadgroup;
  uint3_t dispatch_threads_per_threadgroup;
  uint3_t grid_origin;
  uint3_t grid_size;
  unsigned quadgroup_index_in_threadgroup;
  unsigned quadgroups_per_threadgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned thread_execution_width;
  unsigned thread_index_in_quadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned thread_index_in_threadgroup;
  uint3_t thread_position_in_grid;
  uint3_t thread_position_in_threadgroup;
  uint3_t threadgroup_position_in_grid;
  uint3_t threadgroups_per_grid;
  uint3_t threads_per_grid;
  unsigned threads_per_simdgroup;
  uint3_t threads_per_threadgroup;
};

using Entry = void (*)(void** buffers, const Attrs& attrs);

constexpr int kSimdWidth = 32;
constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kGuardBytes = 4096;

enum class State { kRunnable, kAtBarrier, kAtSimd, kDone };

struct Fiber {
  ucontext_t ctx;
  State state;
  Attrs attrs;
};

struct SimdGroup {
  int lanes = 0;
  int arrived = 0;
  const void* op = nullptr;
  alignas(16) unsigned char in[kSimdWidth][16];
  alignas(16) unsigned char out[kSimdWidth][16];
  int arg[kSimdWidth];
};

// Fiber stacks mapped, not allocated: a page is only backed once a fiber touches it,
// so a threadgroup of 1,024 threads costs the few pages each uses, not 128 MiB zeroed.
struct Stacks {
  char* base = nullptr;
  size_t bytes = 0;
  explicit Stacks(size_t n) : bytes(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("msl_emu: mmap of fiber stacks");
      std::_Exit(2);
    }
    base = static_cast<char*>(p);
  }
  ~Stacks() { munmap(base, bytes); }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
};

struct Group {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simd;
  Stacks* stacks = nullptr;
  ucontext_t scheduler;
  int barrier_arrived = 0;
  int current = 0;
  Entry entry = nullptr;
  void** buffers = nullptr;
};

inline thread_local Group* g_group = nullptr;

[[noreturn]] inline void fail(const char* what) {
  const Attrs& a = g_group->fibers[g_group->current].attrs;
  std::fprintf(
      stderr,
      "msl_emu: %s (threadgroup %u,%u,%u thread %u)\n",
      what,
      a.threadgroup_position_in_grid.x,
      a.threadgroup_position_in_grid.y,
      a.threadgroup_position_in_grid.z,
      a.thread_index_in_threadgroup);
  std::fflush(stderr);
  std::_Exit(3);
}

inline void yield(State state) {
  Group& g = *g_group;
  Fiber& f = g.fibers[g.current];
  f.state = state;
  swapcontext(&f.ctx, &g.scheduler);
}

inline void threadgroup_barrier() {
  Group& g = *g_group;
  asm volatile("" ::: "memory");
  if (++g.barrier_arrived == static_cast<int>(g.fibers.size())) {
    g.barrier_arrived = 0;
    for (Fiber& f : g.fibers) {
      if (f.state == State::kAtBarrier) {
        f.state = State::kRunnable;
      }
    }
  } else {
    yield(State::kAtBarrier);
  }
  asm volatile("" ::: "memory");
}

// Exchange one value per lane across the caller's simdgroup: once all its lanes
// arrived, lane i receives combine(values, lanes, i, arg_i).
template <typename T, typename Combine>
T simd_exchange(T value, int arg, Combine combine) {
  static_assert(sizeof(T) <= 16, "simdgroup value too large");
  Group& g = *g_group;
  const unsigned tid = g.fibers[g.current].attrs.thread_index_in_threadgroup;
  SimdGroup& s = g.simd[tid / kSimdWidth];
  const int lane = tid % kSimdWidth;
  const void* op = reinterpret_cast<const void*>(&simd_exchange<T, Combine>);
  if (s.arrived == 0) {
    s.op = op;
  } else if (s.op != op) {
    fail("lanes of one simdgroup called different simdgroup functions");
  }
  std::memcpy(s.in[lane], &value, sizeof(T));
  s.arg[lane] = arg;
  if (++s.arrived == s.lanes) {
    s.arrived = 0;
    T values[kSimdWidth];
    for (int i = 0; i < s.lanes; ++i) {
      std::memcpy(&values[i], s.in[i], sizeof(T));
    }
    for (int i = 0; i < s.lanes; ++i) {
      T r = combine(values, s.lanes, i, s.arg[i]);
      std::memcpy(s.out[i], &r, sizeof(T));
    }
    const int first = tid - lane;
    for (int i = 0; i < s.lanes; ++i) {
      if (g.fibers[first + i].state == State::kAtSimd) {
        g.fibers[first + i].state = State::kRunnable;
      }
    }
  } else {
    yield(State::kAtSimd);
  }
  T r;
  std::memcpy(&r, s.out[lane], sizeof(T));
  return r;
}

inline void fiber_main() {
  Group& g = *g_group;
  g.entry(g.buffers, g.fibers[g.current].attrs);
  g.fibers[g.current].state = State::kDone;
}

inline unsigned ceil_div(unsigned a, unsigned b) {
  return (a + b - 1) / b;
}

// A grid that is not a multiple of the threadgroup gets smaller threadgroups at its
// edges, as Metal's dispatchThreads makes them.
inline void run_threadgroup(Group& g, uint3_t tg_pos, uint3_t grid, uint3_t full) {
  const uint3_t edge = grid - tg_pos * full;
  const uint3_t tg = {std::min(full.x, edge.x), std::min(full.y, edge.y), std::min(full.z, edge.z)};
  const unsigned n = tg.x * tg.y * tg.z;
  const uint3_t groups = {ceil_div(grid.x, full.x), ceil_div(grid.y, full.y), ceil_div(grid.z, full.z)};
  g.simd.resize(ceil_div(n, kSimdWidth));
  for (unsigned i = 0; i < g.simd.size(); ++i) {
    g.simd[i].lanes = std::min<unsigned>(kSimdWidth, n - i * kSimdWidth);
  }
  for (unsigned tid = 0; tid < n; ++tid) {
    Fiber& f = g.fibers[tid];
    Attrs& a = f.attrs;
    const uint3_t local = {tid % tg.x, (tid / tg.x) % tg.y, tid / (tg.x * tg.y)};
    a.dispatch_quadgroups_per_threadgroup = ceil_div(n, 4);
    a.dispatch_simdgroups_per_threadgroup = ceil_div(n, kSimdWidth);
    a.dispatch_threads_per_threadgroup = full;
    a.grid_origin = uint3_t{0, 0, 0};
    a.grid_size = grid;
    a.quadgroup_index_in_threadgroup = tid / 4;
    a.quadgroups_per_threadgroup = ceil_div(n, 4);
    a.simdgroup_index_in_threadgroup = tid / kSimdWidth;
    a.simdgroups_per_threadgroup = ceil_div(n, kSimdWidth);
    a.thread_execution_width = kSimdWidth;
    a.thread_index_in_quadgroup = tid % 4;
    a.thread_index_in_simdgroup = tid % kSimdWidth;
    a.thread_index_in_threadgroup = tid;
    a.thread_position_in_grid = tg_pos * full + local;
    a.thread_position_in_threadgroup = local;
    a.threadgroup_position_in_grid = tg_pos;
    a.threadgroups_per_grid = groups;
    a.threads_per_grid = grid;
    a.threads_per_simdgroup = kSimdWidth;
    a.threads_per_threadgroup = tg;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g.stacks->base + tid * kStackBytes;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &g.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = State::kRunnable;
  }
  for (SimdGroup& s : g.simd) {
    s.arrived = 0;
  }
  g.barrier_arrived = 0;
  // Resume runnable threads in a fresh pseudo-random order every pass (seeded by
  // the threadgroup, so runs repeat): a missing barrier then shows as stale reads.
  std::vector<unsigned> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::mt19937 rng(tg_pos.x + 7919u * (tg_pos.y + 7919u * tg_pos.z));
  unsigned done = 0;
  while (done < n) {
    bool ran = false;
    std::shuffle(order.begin(), order.end(), rng);
    for (unsigned tid : order) {
      if (g.fibers[tid].state == State::kRunnable) {
        g.current = tid;
        swapcontext(&g.scheduler, &g.fibers[tid].ctx);
        ran = true;
        done += g.fibers[tid].state == State::kDone;
      }
    }
    if (!ran) {
      fail("deadlock: threads wait at different barriers or returned before one");
    }
  }
}

// Runs the whole grid: threadgroups are dealt round-robin to `workers` threads.
inline void dispatch(Entry entry, void** buffers, uint3_t grid, uint3_t tg, unsigned workers) {
  const unsigned n = tg.x * tg.y * tg.z;
  const uint3_t groups = {ceil_div(grid.x, tg.x), ceil_div(grid.y, tg.y), ceil_div(grid.z, tg.z)};
  const unsigned n_groups = groups.x * groups.y * groups.z;
  auto work = [&](unsigned worker) {
    Group g;
    g.fibers.resize(n);
    Stacks stacks(n * kStackBytes);
    g.stacks = &stacks;
    g.entry = entry;
    g.buffers = buffers;
    g_group = &g;
    for (unsigned i = worker; i < n_groups; i += workers) {
      const uint3_t pos = {i % groups.x, (i / groups.x) % groups.y, i / (groups.x * groups.y)};
      run_threadgroup(g, pos, grid, tg);
    }
    g_group = nullptr;
  };
  std::vector<std::thread> threads;
  for (unsigned w = 1; w < workers; ++w) {
    threads.emplace_back(work, w);
  }
  work(0);
  for (std::thread& t : threads) {
    t.join();
  }
}

// argv: input file, output file, grid x y z, threadgroup x y z, workers.
// The input file holds, per buffer, three uint64 (bytes, byte offset of the
// bound pointer, is-output) then the bytes; buffers get 0xFF guard bands and
// outputs start as 0xFF (NaN for float types), so stray reads and missing
// writes show up. The output file receives the output buffers in order.
inline int main(int argc, char** argv, Entry entry) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: %s in out gx gy gz tx ty tz workers\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) {
    std::perror(argv[1]);
    return 2;
  }
  struct Buffer {
    std::vector<unsigned char> bytes;
    uint64_t size, offset, is_output;
  };
  std::vector<Buffer> buffers;
  uint64_t header[3];
  while (std::fread(header, sizeof(header), 1, in) == 1) {
    Buffer b{std::vector<unsigned char>(header[0] + 2 * kGuardBytes, 0xFF), header[0], header[1], header[2]};
    if (std::fread(b.bytes.data() + kGuardBytes, 1, b.size, in) != b.size) {
      std::fprintf(stderr, "msl_emu: truncated input file\n");
      return 2;
    }
    buffers.push_back(std::move(b));
  }
  std::fclose(in);
  std::vector<void*> pointers;
  for (Buffer& b : buffers) {
    pointers.push_back(b.bytes.data() + kGuardBytes + b.offset);
  }
  const uint3_t grid = {unsigned(std::atoi(argv[3])), unsigned(std::atoi(argv[4])), unsigned(std::atoi(argv[5]))};
  const uint3_t tg = {unsigned(std::atoi(argv[6])), unsigned(std::atoi(argv[7])), unsigned(std::atoi(argv[8]))};
  dispatch(entry, pointers.data(), grid, tg, unsigned(std::atoi(argv[9])));
  FILE* out = std::fopen(argv[2], "wb");
  for (Buffer& b : buffers) {
    if (!b.is_output) {
      continue;
    }
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (b.bytes[i] != 0xFF || b.bytes[kGuardBytes + b.size + i] != 0xFF) {
        std::fprintf(stderr, "msl_emu: write outside an output buffer\n");
        return 3;
      }
    }
    std::fwrite(b.bytes.data() + kGuardBytes, 1, b.size, out);
  }
  std::fclose(out);
  return 0;
}

}  // namespace emu
