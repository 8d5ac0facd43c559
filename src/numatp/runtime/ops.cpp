// numatp's dispatcher ops, for the sockets' compiled segments (see numatp/runtime/native.py).
//
// Inside a segment compiled by Inductor with cpp_wrapper, an op Inductor has no lowering for is called
// through the dispatcher from the generated C++ (aoti_torch_call_dispatcher): these run in the segment
// without the GIL and without a cut in the socket's program.
//   numatp::linear      a weight matmul by a measured GEMM provider (numatp's own GEMV in gemv.cpp);
//   numatp::socket_all_reduce  the sockets' reduction (collective.cpp, built into the same library).

// Only the headers used (Tensor's methods, the few functions called, the dispatcher), not ATen/ATen.h's
// every operator: the library is compiled on first use, also in the emulated guest of the numa suite.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdint>
#include <ctime>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

// ---- numatp::linear: a weight matmul by a measured GEMM provider ----
//
// The operand is what numatp.runtime.gemm's provider prepared: a plain (N, K) weight or oneDNN's packed
// (opaque) one for oneDNN, MKL's packed buffer for the MKL providers. Provider codes match
// numatp.runtime.gemm.NATIVE.

// gemv.cpp: y (M, N) = x (M, K) @ W (+ bias) on contiguous buffers, W (N, K) or (K, N) (kn = 1)
extern "C" {
void numatp_gemv_rows_f32(const float* x, const float* w, const float* bias, float* y, std::int64_t m,
                          std::int64_t k, std::int64_t n, int kn);
void numatp_gemv_rows_bf16(const std::uint16_t* x, const std::uint16_t* w, const std::uint16_t* bias,
                           std::uint16_t* y, std::int64_t m, std::int64_t k, std::int64_t n, int kn);
}

namespace {

constexpr int64_t kOneDnn = 0;      // mkldnn::_linear_pointwise on a plain or packed (N, K) weight
constexpr int64_t kMklPacked = 1;   // mkl::_mkl_linear on MKL's packed fp32 weight
constexpr int64_t kMklPackedF32 = 2;  // the same for bf16 activations, computed in fp32
constexpr int64_t kGemvNK = 3;      // numatp's GEMV on the plain (N, K) weight
constexpr int64_t kGemvKN = 4;      // the same on a plain (K, N) weight (GPT-2's Conv1D)

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

constexpr int64_t kGemvMaxRows = 16;   // numatp.runtime.gemm.GEMV_MAX_ROWS: a decode step's rows

// numatp's GEMV: a few rows against the weight as the model stores it, (N, K) or (K, N) (kn)
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, bool kn) {
  TORCH_CHECK(w.dim() == 2, "numatp gemv: the weight must be 2-D, got ", w.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t n = kn ? w.size(1) : w.size(0);
  TORCH_CHECK((kn ? w.size(0) : w.size(1)) == k, "numatp gemv: x is (", m, ", ", k, ") but the ",
              kn ? "(K, N)" : "(N, K)", " weight is ", w.sizes());
  TORCH_CHECK(m <= kGemvMaxRows, "numatp gemv: runs up to ", kGemvMaxRows, " rows (a decode step), got ", m,
              "; use a GEMM provider for more");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "numatp gemv: float32 or bfloat16, x and weight alike; got ", x.scalar_type(), " and ",
              w.scalar_type());
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "numatp gemv: the bias has ", bias->numel(), " elements, the output ", n,
                " columns");
    b = bias->to(x.scalar_type()).contiguous();
  }
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = w.contiguous();   // as stored: a copy only for a weight that is a strided view
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    if (x.scalar_type() == at::kFloat) {
      numatp_gemv_rows_f32(xc.const_data_ptr<float>(), wc.const_data_ptr<float>(),
                           b ? b->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), m, k, n, kn);
    } else {
      auto bits = [](const at::Tensor& t) { return static_cast<const std::uint16_t*>(t.const_data_ptr()); };
      numatp_gemv_rows_bf16(bits(xc), bits(wc), b ? bits(*b) : nullptr,
                            static_cast<std::uint16_t*>(y.mutable_data_ptr()), m, k, n, kn);
    }
  }
  return y;
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
    case kGemvNK:
    case kGemvKN:
      return gemv(x, w, bias, provider == kGemvKN);
    default:
      TORCH_CHECK(false, "numatp::linear: unknown provider code ", provider);
  }
}

}  // namespace


// ---- numatp::socket_all_reduce: the sockets' reduction as a dispatcher op, for compiled code ----
//
// A socket's worker enters its socket (numatp_socket_enter: the group's collective, its rank, the
// timeout, the fused-sum threshold and, on a real topology, the node its results must live on) before
// it runs its program and leaves after (numatp_socket_leave). In between, numatp::socket_all_reduce called
// from a compiled segment's C++ wrapper runs the collective with that context, without the GIL and
// without returning to Python. The result is a new tensor: on the socket's node where the group binds
// memory (mmap + mbind before the first touch, since a worker's allocator may recycle another node's
// pages), else from torch's allocator, and a one-element token. `after` is the previous all-reduce's
// token, read by nothing: it makes the order of the reductions a data dependency, the same on every
// socket, whatever order the compiler schedules independent work in, without keeping a result alive for
// it. A failed reduction records the collective's code (1: a peer failed or the call was interrupted,
// 2: timed out, with the sockets that never arrived) for
// numatp_socket_leave, and throws.

extern "C" int numatp_all_reduce(void* comm, int rank, const void* src, void* dst, std::int64_t numel, int dtype,
                                 std::int64_t fused_bytes, double timeout_s, std::uint64_t* missing,
                                 double* waited);

namespace {

struct Socket {
  void* comm = nullptr;
  int rank = -1;
  double timeout = 0;
  std::int64_t fused_bytes = 0;
  int node = -1;               // >= 0: results are bound to this node
  int failed = 0;              // the collective's code of the first failure
  std::uint64_t missing = 0;
  double seconds = 0;          // in all-reduces, waiting for peers included
  double waited = 0;           // of which waiting for the last peer to arrive
  std::int64_t count = 0;      // all-reduces completed
  bool rehearsal = false;      // a warm-up run on one thread: a result is a copy of the partial
};

thread_local Socket socket_;

double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

at::Tensor on_node(const at::Tensor& like, int node) {
  const std::int64_t bytes = like.numel() * like.element_size();
  const long page = sysconf(_SC_PAGESIZE);
  const std::int64_t length = std::max<std::int64_t>(1, (bytes + page - 1) / page) * page;
  void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "numatp::socket_all_reduce: mmap of ", length, " bytes failed");
  unsigned long mask[16] = {0};
  TORCH_CHECK(node < 16 * 64, "numatp::socket_all_reduce: node ", node, " out of range");
  mask[node / 64] = 1UL << (node % 64);
  constexpr int kMpolBind = 2;
  // As numatp.placement.numa_empty: where the environment refuses memory policy (a seccomp filter, a
  // kernel without NUMA) the buffer stays unbound; the process has warned already, when its workers and
  // weights were placed (and refused to run at all under strict placement). Any other error is a bug.
  if (syscall(SYS_mbind, p, length, kMpolBind, mask, 16 * 64 + 1, 0) != 0 && errno != EPERM &&
      errno != ENOSYS && errno != EACCES) {
    const int err = errno;
    munmap(p, length);
    TORCH_CHECK(false, "numatp::socket_all_reduce: mbind to node ", node, " failed (errno ", err, ")");
  }
  return at::from_blob(p, like.sizes(), [length](void* q) { munmap(q, length); }, like.options());
}

std::tuple<at::Tensor, at::Tensor> all_reduce(const at::Tensor& x, const std::optional<at::Tensor>& after) {
  (void)after;
  Socket& s = socket_;
  if (s.rehearsal) return {x.clone(at::MemoryFormat::Contiguous), at::empty({1}, x.options())};
  TORCH_CHECK(s.comm != nullptr, "numatp::socket_all_reduce runs only inside a socket worker of numatp's executor");
  const int dtype = x.scalar_type() == at::kFloat ? 0 : x.scalar_type() == at::kBFloat16 ? 1 : -1;
  TORCH_CHECK(dtype >= 0, "numatp::socket_all_reduce sums float32 and bfloat16, got ", x.scalar_type());
  at::Tensor src = x.contiguous();
  at::Tensor out = s.node >= 0 ? on_node(src, s.node) : at::empty_like(src, at::MemoryFormat::Contiguous);
  std::uint64_t missing = 0;
  const double t0 = now();
  const int rc = numatp_all_reduce(s.comm, s.rank, src.data_ptr(), out.data_ptr(), src.numel(), dtype,
                                   s.fused_bytes, s.timeout, &missing, &s.waited);
  s.seconds += now() - t0;
  if (rc != 0) {
    if (!s.failed) {
      s.failed = rc;
      s.missing = missing;
    }
    TORCH_CHECK(false, "numatp::socket_all_reduce: socket ", s.rank,
                rc == 1 ? ": a peer socket failed" : ": timed out");
  }
  ++s.count;
  return {out, at::empty({1}, x.options())};
}

}  // namespace

extern "C" {

void numatp_socket_enter(void* comm, int rank, double timeout_s, std::int64_t fused_bytes, int node) {
  socket_ = Socket{comm, rank, timeout_s, fused_bytes, node};
}

// A warm-up run of a socket's program on the calling thread, alone: until numatp_socket_leave, each
// all-reduce returns a copy of its partial (the shapes are right, the values are not used).
void numatp_socket_rehearse() {
  socket_ = Socket{};
  socket_.rehearsal = true;
}

// What the socket did since it entered; returns the first failure's code (0: none).
int numatp_socket_leave(double* seconds, double* waited, std::int64_t* count, std::uint64_t* missing) {
  *seconds = socket_.seconds;
  *waited = socket_.waited;
  *count = socket_.count;
  *missing = socket_.missing;
  const int failed = socket_.failed;
  socket_ = Socket{};
  return failed;
}

}  // extern "C"

TORCH_LIBRARY_FRAGMENT(numatp, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int provider, int n, int k) -> Tensor");
  m.def("socket_all_reduce(Tensor x, Tensor? after) -> (Tensor, Tensor)");
}

// every backend: a packed oneDNN weight is an MkldnnCPU tensor beside a CPU activation
TORCH_LIBRARY_IMPL(numatp, CompositeExplicitAutograd, m) {
  m.impl("linear", &linear);
  m.impl("socket_all_reduce", &all_reduce);
}
