// numatp::linear: a weight matmul by a measured GEMM provider, as a dispatcher op with a C++ kernel.
//
// Inside a segment compiled by Inductor with cpp_wrapper, an op Inductor has no lowering for is called
// through the dispatcher from the generated C++ (aoti_torch_call_dispatcher), so the provider runs in
// the segment without the GIL and without a cut in the socket's program. The operand is what
// numatp.runtime.gemm's provider prepared: a plain (N, K) weight or oneDNN's packed (opaque) one for
// oneDNN, MKL's packed buffer for the MKL providers. Provider codes match numatp.runtime.gemm.NATIVE.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

constexpr int64_t kOneDnn = 0;      // mkldnn::_linear_pointwise on a plain or packed (N, K) weight
constexpr int64_t kMklPacked = 1;   // mkl::_mkl_linear on MKL's packed fp32 weight
constexpr int64_t kMklPackedF32 = 2;  // the same for bf16 activations, computed in fp32

at::Tensor onednn(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

at::Tensor mkl(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
               int64_t k) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  // _mkl_linear reads the plain weight only for its shape (the rows were fixed when packing, and the
  // GEMM pass packs for the rows it is called with): a stride-0 stand-in keeps no second copy
  at::Tensor stand_in = at::empty({1}, x.options()).expand({n, k});
  return op.call(x, packed, stand_in, bias, x.size(0));
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t provider,
                  int64_t n, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "numatp::linear: x must be (M, ", k, "), got ", x.sizes());
  switch (provider) {
    case kOneDnn:
      return onednn(x, w, bias);
    case kMklPacked:
      return mkl(x, w, bias, n, k);
    case kMklPackedF32: {
      std::optional<at::Tensor> b32;
      if (bias.has_value()) b32 = bias->to(at::kFloat);
      return mkl(x.to(at::kFloat), w, b32, n, k).to(x.scalar_type());
    }
    default:
      TORCH_CHECK(false, "numatp::linear: unknown provider code ", provider);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(numatp, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int provider, int n, int k) -> Tensor");
}

// every backend: a packed oneDNN weight is an MkldnnCPU tensor beside a CPU activation
TORCH_LIBRARY_IMPL(numatp, CompositeExplicitAutograd, m) { m.impl("linear", &linear); }
