// The subset of the Metal Shading Language that metal/*.metal uses, as C++
// for clang (see metal/README.md for what is and is not covered).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "emu_runtime.h"

typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;
typedef bfloat bfloat16_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

#define DFLASH_EMU_VECTORS(T)                                 \
  typedef T T##2 __attribute__((ext_vector_type(2)));         \
  typedef T T##3 __attribute__((ext_vector_type(3)));         \
  typedef T T##4 __attribute__((ext_vector_type(4)));
DFLASH_EMU_VECTORS(float)
DFLASH_EMU_VECTORS(half)
DFLASH_EMU_VECTORS(int)
DFLASH_EMU_VECTORS(uint)
DFLASH_EMU_VECTORS(short)
DFLASH_EMU_VECTORS(ushort)
DFLASH_EMU_VECTORS(char)
DFLASH_EMU_VECTORS(uchar)
#undef DFLASH_EMU_VECTORS

namespace metal {

using std::numeric_limits;

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

// Scalar math is evaluated in float (double for double) and rounded back to T.
#define DFLASH_EMU_UNARY(name, fn)                                   \
  template <typename T>                                              \
  inline T name(T x) {                                               \
    return T(fn(static_cast<float>(x)));                             \
  }                                                                  \
  inline double name(double x) {                                     \
    return fn(x);                                                    \
  }
DFLASH_EMU_UNARY(exp, std::exp)
DFLASH_EMU_UNARY(exp2, std::exp2)
DFLASH_EMU_UNARY(log, std::log)
DFLASH_EMU_UNARY(log2, std::log2)
DFLASH_EMU_UNARY(sqrt, std::sqrt)
DFLASH_EMU_UNARY(abs, std::fabs)
DFLASH_EMU_UNARY(fabs, std::fabs)
DFLASH_EMU_UNARY(tanh, std::tanh)
DFLASH_EMU_UNARY(cos, std::cos)
DFLASH_EMU_UNARY(sin, std::sin)
#undef DFLASH_EMU_UNARY

template <typename T>
inline T rsqrt(T x) {
  return T(1.0f / std::sqrt(static_cast<float>(x)));
}
template <typename T>
inline T max(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
inline T min(T a, T b) {
  return a < b ? a : b;
}
template <typename T>
inline T fmax(T a, T b) {
  return T(std::fmax(static_cast<float>(a), static_cast<float>(b)));
}
template <typename T>
inline T fmin(T a, T b) {
  return T(std::fmin(static_cast<float>(a), static_cast<float>(b)));
}
template <typename T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}

namespace fast {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
}  // namespace fast
namespace precise {
using metal::cos;
using metal::exp;
using metal::exp2;
using metal::log;
using metal::rsqrt;
using metal::sin;
using metal::sqrt;
}  // namespace precise

inline void threadgroup_barrier(mem_flags) {
  emu::threadgroup_barrier();
}

// Simdgroup functions: every lane of the simdgroup must call them together.
// Reductions combine lanes in lane order.
template <typename T>
inline T simd_sum(T x) {
  return emu::simd_exchange(x, 0, [](const T* v, int n, int, int) {
    T r = v[0];
    for (int i = 1; i < n; ++i) r += v[i];
    return r;
  });
}
template <typename T>
inline T simd_max(T x) {
  return emu::simd_exchange(x, 0, [](const T* v, int n, int, int) {
    T r = v[0];
    for (int i = 1; i < n; ++i) r = max(r, v[i]);
    return r;
  });
}
template <typename T>
inline T simd_min(T x) {
  return emu::simd_exchange(x, 0, [](const T* v, int n, int, int) {
    T r = v[0];
    for (int i = 1; i < n; ++i) r = min(r, v[i]);
    return r;
  });
}
template <typename T>
inline T simd_shuffle(T x, ushort lane) {
  return emu::simd_exchange(x, lane, [](const T* v, int n, int, int src) {
    if (src >= n) emu::fail("simd_shuffle from a lane outside the simdgroup");
    return v[src];
  });
}
template <typename T>
inline T simd_broadcast(T x, ushort lane) {
  return simd_shuffle(x, lane);
}
template <typename T>
inline T simd_shuffle_xor(T x, ushort mask) {
  return emu::simd_exchange(x, mask, [](const T* v, int n, int self, int m) {
    if ((self ^ m) >= n) emu::fail("simd_shuffle_xor from a lane outside the simdgroup");
    return v[self ^ m];
  });
}
inline void simdgroup_barrier(mem_flags) {
  emu::simd_exchange(0, 0, [](const int*, int, int, int) { return 0; });
}

}  // namespace metal

// Address spaces: device/constant/thread memory is ordinary memory; a
// `threadgroup` array declared in the kernel body becomes one array per OS
// thread, shared by the fibers of the threadgroup running on it. So
// `threadgroup` may only declare arrays, not qualify pointers.
#define device
#define constant
#define thread
#define threadgroup static thread_local
#define METAL_FUNC inline
