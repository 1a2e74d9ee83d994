// mlxpipe's CPU operation for mlx: a product by a quantized matrix, computed by gemv.c's kernels from the
// quantized bytes (its only copy), seen by mlx's graph like any operation (lazy, async_eval, compile).
// Built on first use by mlxpipe.cpu.kernels against the installed mlx wheel's headers and libmlx.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

// gemv.c's mlxpipe_qproduct: c = a W^T for a registered W (its handle); 0 when scratch memory ran out.
using product_fn = int (*)(const void *handle, int m, const float *a, float *c, int flags);

class KernelProduct : public mx::Primitive {
 public:
  KernelProduct(mx::Stream stream, uintptr_t fn, uintptr_t handle, int flags)
      : mx::Primitive(stream), fn_(fn), handle_(handle), flags_(flags) {}

  void eval_cpu(const std::vector<mx::array> &inputs, std::vector<mx::array> &outputs) override {
    const mx::array &x = inputs[0];
    mx::array &out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto &encoder = mx::cpu::get_command_encoder(stream());
    for (const auto &input : inputs) encoder.set_input_array(input);  // the weights live until it has run
    encoder.set_output_array(out);
    int rows = x.shape(-1) ? static_cast<int>(x.size() / x.shape(-1)) : 0;
    encoder.dispatch([fn = fn_, handle = handle_, flags = flags_, rows, a = x.data<float>(),
                      c = out.data<float>()]() {
      if (!reinterpret_cast<product_fn>(fn)(reinterpret_cast<const void *>(handle), rows, a, c, flags))
        throw std::runtime_error("mlxpipe: out of memory in a quantized product");
    });
  }

  void eval_gpu(const std::vector<mx::array> &, std::vector<mx::array> &) override {
    throw std::runtime_error("mlxpipe's quantized product runs on a CPU only");
  }

  const char *name() const override { return "MlxpipeQuantizedProduct"; }

  bool is_equivalent(const mx::Primitive &other) const override {
    const auto &o = static_cast<const KernelProduct &>(other);
    return fn_ == o.fn_ && handle_ == o.handle_ && flags_ == o.flags_;
  }

 private:
  uintptr_t fn_, handle_;
  int flags_;
};

// x (..., k) times W^T (W: n x k) -> (..., width), float32; `keep`: the arrays the kernel reads (W's packed
// values, scales, biases), inputs of the operation only so that mlx keeps them while it is pending.
mx::array product(const mx::array &x, uintptr_t fn, uintptr_t handle, int width, int flags,
                  const std::vector<mx::array> &keep) {
  auto stream = mx::default_stream(mx::Device::cpu);
  auto rows = mx::contiguous(mx::astype(x, mx::float32, stream), false, stream);
  auto shape = rows.shape();
  shape.back() = width;
  std::vector<mx::array> inputs{rows};
  inputs.insert(inputs.end(), keep.begin(), keep.end());
  return mx::array(shape, mx::float32, std::make_shared<KernelProduct>(stream, fn, handle, flags), inputs);
}

}  // namespace

NB_MODULE(_mlxpipe_kernels, m) {
  m.def("product", &product, nb::arg("x"), nb::arg("fn"), nb::arg("handle"), nb::arg("width"),
        nb::arg("flags"), nb::arg("keep"));
}
