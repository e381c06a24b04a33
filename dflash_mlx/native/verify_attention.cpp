// An MLX primitive for the verify forward's attention on the CPU (verify_attention.c), so that
// it sits in MLX's lazy graph like any other op. Built against the installed MLX wheel's headers
// and library with nanobind in MLX's domain, so `mx.array`s pass in and out as they are
// (cpu_attention.py builds and loads it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

extern "C" {
void dflash_attention_calls_by_threads(long *out, int n);
void dflash_attention_force_threads(int n);
int dflash_verify_attention(int B, int H, int Hkv, int L, int S, int D, int Dv, float scale,
                            const float *q, const long *qs, const float *k, const long *ks,
                            const float *v, const long *vs, const unsigned char *mask,
                            const long *ms, int causal, float *out);
}

namespace {

std::vector<long> strides(const mx::array &a) { return {a.strides().begin(), a.strides().end()}; }

class VerifyAttention : public mx::UnaryPrimitive {
 public:
  VerifyAttention(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (auto &a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    std::vector<mx::array> in;
    for (auto &a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
    encoder.dispatch([out = mx::array::unsafe_weak_copy(out), in = std::move(in), scale = scale_,
                      causal = causal_]() mutable {
      auto &q = in[0], &k = in[1], &v = in[2];
      auto qs = strides(q), ks = strides(k), vs = strides(v);
      std::vector<long> ms = in.size() > 3 ? strides(in[3]) : std::vector<long>(4, 0);
      const unsigned char *mask = in.size() > 3 ? in[3].data<unsigned char>() : nullptr;
      if (!dflash_verify_attention(q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2),
                                   q.shape(3), v.shape(3), scale, q.data<float>(), qs.data(),
                                   k.data<float>(), ks.data(), v.data<float>(), vs.data(), mask,
                                   ms.data(), causal, out.data<float>()))
        throw std::runtime_error("[verify_attention] unsupported shape or no memory");
    });
  }

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error("[verify_attention] runs on the CPU only");
  }

  const char *name() const override { return "VerifyAttention"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    auto &o = static_cast<const VerifyAttention &>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

 private:
  float scale_;
  bool causal_;
};

// softmax(scale * q k^T, masked) v for float32 q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv,
// S, Dv): `mask` a boolean array broadcastable to (B, H, L, S) (True: seen), or none with
// `causal` (query i sees the keys up to S - L + i) or not (every key). Views are read through
// their strides, a broadcast mask included: nothing is copied.
mx::array verify_attention(const mx::array &q, const mx::array &k, const mx::array &v,
                           float scale, std::optional<mx::array> mask, bool causal) {
  bool fits = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && k.shape(0) == q.shape(0) &&
              v.shape(0) == q.shape(0) && v.shape(1) == k.shape(1) && k.shape(1) > 0 &&
              q.shape(1) % k.shape(1) == 0 && v.shape(2) == k.shape(2) &&
              k.shape(3) == q.shape(3) && (!mask || mask->dtype() == mx::bool_);
  for (auto &a : {q, k, v}) fits = fits && a.dtype() == mx::float32;
  if (!fits)
    throw std::invalid_argument("[verify_attention] needs float32 (B, H, L, D) queries, "
                                "(B, H_kv, S, D) keys and values and a boolean mask");
  auto shape = q.shape();
  shape.back() = v.shape(-1);
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs = {q, k, v};
  if (mask)
    inputs.push_back(mx::broadcast_to(*mask, {q.shape(0), q.shape(1), q.shape(2), k.shape(2)}));
  return mx::array(shape, mx::float32,
                   std::make_shared<VerifyAttention>(stream, scale, causal && !mask), inputs);
}

// How many calls took 1, 2, ... threads (the last entry: 16 or more).
std::vector<long> calls_by_threads() {
  std::vector<long> calls(16);
  dflash_attention_calls_by_threads(calls.data(), 16);
  return calls;
}

}  // namespace

NB_MODULE(_verify_attention, m) {
  m.def("force_threads", &dflash_attention_force_threads, nb::arg("n"),
        "Every call takes up to n threads from now on (0: as measured).");
  m.def("calls_by_threads", &calls_by_threads,
        "How many calls took 1, 2, ... threads (the last entry: 16 or more).");
  m.def("verify_attention", &verify_attention, nb::arg("queries"), nb::arg("keys"),
        nb::arg("values"), nb::arg("scale"), nb::arg("mask").none(), nb::arg("causal"),
        "Scaled dot-product attention of float32 queries over a KV cache, on the CPU.");
}
