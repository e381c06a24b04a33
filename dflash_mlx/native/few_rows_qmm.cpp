// An MLX primitive for few-row affine-quantized products on the CPU (few_rows_qmm.c), so that
// they sit in MLX's lazy graph like any other op. Built against the installed MLX wheel's headers
// and library with nanobind in MLX's domain, so `mx.array`s pass in and out as they are
// (quantized_cpu.py builds and loads it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

extern "C" {
void dflash_qmm_calls_by_threads(long *out, int n);
void dflash_qmm_force_threads(int n);
int dflash_qmm_max_rows(void);
int dflash_qmm_rows(int M, int N, int K, int bits, int group, const float *const *rows,
                    long x_step, const uint32_t *w, const float *scales, const float *biases,
                    float *out);
}

namespace {

// The first element of every row of `x` (all axes but the last), for any strides.
std::vector<const float *> row_starts(const mx::array &x) {
  int rows = x.size() / x.shape(-1);
  std::vector<const float *> starts(rows);
  const float *base = x.data<float>();
  for (int r = 0; r < rows; r++) {
    long offset = 0;
    for (int axis = x.ndim() - 2, rest = r; axis >= 0; axis--) {
      offset += (long)(rest % x.shape(axis)) * x.strides()[axis];
      rest /= x.shape(axis);
    }
    starts[r] = base + offset;
  }
  return starts;
}

class FewRowsQuantizedMatmul : public mx::UnaryPrimitive {
 public:
  FewRowsQuantizedMatmul(mx::Stream stream, int bits, int group_size)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array> &inputs, mx::array &out) override {
    auto &x = inputs[0];
    auto &w = inputs[1];
    auto &scales = inputs[2];
    auto &biases = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (auto &a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([out = mx::array::unsafe_weak_copy(out),
                      x = mx::array::unsafe_weak_copy(x), w = mx::array::unsafe_weak_copy(w),
                      scales = mx::array::unsafe_weak_copy(scales),
                      biases = mx::array::unsafe_weak_copy(biases), bits = bits_,
                      group = group_size_]() mutable {
      auto rows = row_starts(x);
      int N = out.shape(-1), K = x.shape(-1);
      if (!dflash_qmm_rows(rows.size(), N, K, bits, group, rows.data(), x.strides().back(),
                           w.data<uint32_t>(), scales.data<float>(), biases.data<float>(),
                           out.data<float>()))
        throw std::runtime_error("[few_rows_quantized_matmul] unsupported shape or no memory");
    });
  }

  void eval_gpu(const std::vector<mx::array> &, mx::array &) override {
    throw std::runtime_error("[few_rows_quantized_matmul] runs on the CPU only");
  }

  const char *name() const override { return "FewRowsQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    auto &o = static_cast<const FewRowsQuantizedMatmul &>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_;
  }

 private:
  int bits_, group_size_;
};

// x @ dequantize(w).T for float32 x and MLX's affine layout; weights not row-contiguous are
// copied first (parameters are).
mx::array few_rows_quantized_matmul(const mx::array &x, const mx::array &w,
                                    const mx::array &scales, const mx::array &biases, int bits,
                                    int group_size) {
  auto contiguous = [](const mx::array &a) {
    return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a);
  };
  auto shape = x.shape();
  shape.back() = w.shape(0);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      shape, mx::float32, std::make_shared<FewRowsQuantizedMatmul>(stream, bits, group_size),
      {x, contiguous(w), contiguous(scales), contiguous(biases)});
}

// How many calls took 1, 2, ... threads (the last entry: 16 or more).
std::vector<long> calls_by_threads() {
  std::vector<long> calls(16);
  dflash_qmm_calls_by_threads(calls.data(), 16);
  return calls;
}

}  // namespace

NB_MODULE(_few_rows_qmm, m) {
  m.def("force_threads", &dflash_qmm_force_threads, nb::arg("n"),
        "Every call takes up to n threads from now on (0: as measured).");
  m.def("calls_by_threads", &calls_by_threads,
        "How many calls took 1, 2, ... threads (the last entry: 16 or more).");
  m.def("max_rows", &dflash_qmm_max_rows, "The most rows of x one product takes.");
  m.def("quantized_matmul", &few_rows_quantized_matmul, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("group_size"),
        "x @ dequantize(w).T for a float32 x of at most max_rows() rows, on the CPU.");
}
