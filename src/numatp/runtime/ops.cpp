// numatp's dispatcher ops, for the sockets' compiled segments (see numatp/runtime/native.py).
//
// Inside a segment compiled by Inductor with cpp_wrapper, an op Inductor has no lowering for is called
// through the dispatcher from the generated C++ (aoti_torch_call_dispatcher): these run in the segment
// without the GIL and without a cut in the socket's program.
//   numatp::linear      a weight matmul by a measured GEMM provider (numatp's own GEMV in gemv.cpp, its
//                       kernels over quantized weights in quant.cpp);
//   numatp::linear_into the same, written into given columns of a wider tensor (a gathered LM head);
//   numatp::mkl_pack    MKL's packed copy of a weight, for the mkl_packed providers;
//   numatp::amx_pack    a bf16 weight packed into AMX tiles (amx.cpp), for the amx provider;
//   numatp::dot_pack    the same layout for the dpbf16 provider (AVX512-BF16 dot products, no tiles);
//   numatp::socket_all_reduce  the sockets' reduction (collective.cpp, built into the same library);
//   numatp::decode_attention   a decode step's attention over the cache (attention.cpp);
//   numatp::qembedding  an embedding lookup in a table stored quantized (quant.cpp's rows).

// Only the headers used (Tensor's methods, the few functions called, the dispatcher), not ATen/ATen.h's
// every operator: the library is compiled on first use, also in the emulated guest of the numa suite.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>
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
// quant.cpp: over a quantized weight's sections (numatp.runtime.gemm.quant's buffer)
void numatp_qgemv(const std::uint8_t* q, const float* s, const float* z, int bits, std::int64_t n, std::int64_t k,
                  std::int64_t group, const void* x, int x_bf16, const void* bias, void* y, std::int64_t m,
                  int int8_dot, int act8);
void numatp_qact8(const void* x, int x_bf16, std::int64_t m, std::int64_t k, void* out);
void numatp_qdequant(const std::uint8_t* q, const float* s, const float* z, int bits, std::int64_t n,
                     std::int64_t k, std::int64_t group, std::int64_t n0, std::int64_t n1, void* out, int to_bf16);
void numatp_qrows(const std::uint8_t* q, const float* s, const float* z, int bits, std::int64_t n, std::int64_t k,
                  std::int64_t group, const std::int64_t* ids, std::int64_t count, void* out, int to_bf16);
// amx.cpp: bf16 GEMM on AMX tiles, on a weight packed into them
int numatp_amx_usable();
std::int64_t numatp_amx_packed_size(std::int64_t n, std::int64_t k);
void numatp_amx_pack(const std::uint16_t* w, std::int64_t n, std::int64_t k, std::int64_t sn, std::int64_t sk,
                     std::uint16_t* out);
void numatp_amx_linear(const std::uint16_t* packed, std::int64_t n, std::int64_t k, const std::uint16_t* x,
                       std::int64_t m, const std::uint16_t* bias, std::uint16_t* y);
int numatp_dot_usable();
void numatp_dot_linear(const std::uint16_t* packed, std::int64_t n, std::int64_t k, const std::uint16_t* x,
                       std::int64_t m, const std::uint16_t* bias, std::uint16_t* y);
// attention.cpp: a decode step's single-query attention over the cache
void numatp_decode_attention(const void* q, const void* k, const void* v, const void* mask, void* out, int is_bf16,
                             const std::int64_t* sizes, const std::int64_t* strides, float scale);
}

namespace {

constexpr int64_t kOneDnn = 0;      // mkldnn::_linear_pointwise on a plain or packed (N, K) weight
constexpr int64_t kMklPacked = 1;   // MKL's packed-B GEMM on a weight packed by numatp::mkl_pack (fp32)
constexpr int64_t kMklPackedF32 = 2;  // the same for bf16 activations, computed in fp32
constexpr int64_t kGemvNK = 3;      // numatp's GEMV on the plain (N, K) weight
constexpr int64_t kGemvKN = 4;      // the same on a plain (K, N) weight (GPT-2's Conv1D)
constexpr int64_t kQgemv = 5;       // quant.cpp's GEMV on a quantized buffer (int8 or int4), up to 16 rows
constexpr int64_t kQtile = 6;       // dequantize-per-tile GEMM on a quantized buffer, any rows
constexpr int64_t kQ8Aten = 7;      // ATen's _weight_int8pack_mm on views into an int8 buffer
constexpr int64_t kAmx = 8;         // amx.cpp's tiles on a weight packed by numatp::amx_pack (bf16)
constexpr int64_t kDot = 9;         // amx.cpp's AVX512-BF16 dot products on the same layout (numatp::dot_pack)
constexpr int64_t kQ8Dot = 10;      // quant.cpp's GEMV on an int8 buffer, bf16 x, through AVX512-BF16 dot products

// A new tensor of its own pages, bound to `node` before the first touch (mmap + mbind): a worker's
// allocator may recycle pages of another node, and a page never written (as MKL's packing leaves part of
// its buffer) never becomes resident anywhere.
at::Tensor mapped_on_node(at::IntArrayRef sizes, const at::TensorOptions& options, int node, const char* who) {
  std::int64_t numel = 1;
  for (const auto d : sizes) numel *= d;
  const std::int64_t bytes = numel * static_cast<std::int64_t>(options.dtype().itemsize());
  const long page = sysconf(_SC_PAGESIZE);
  const std::int64_t length = std::max<std::int64_t>(1, (bytes + page - 1) / page) * page;
  void* p = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, who, ": mmap of ", length, " bytes failed");
  unsigned long mask[16] = {0};
  TORCH_CHECK(node >= 0 && node < 16 * 64, who, ": node ", node, " out of range");
  mask[node / 64] = 1UL << (node % 64);
  constexpr int kMpolBind = 2;
  // As numatp.placement.numa_empty: where the environment refuses memory policy (a seccomp filter, a
  // kernel without NUMA) the buffer stays unbound; the process has warned already, when its workers and
  // weights were placed (and refused to run at all under strict placement). Any other error is a bug.
  if (syscall(SYS_mbind, p, length, kMpolBind, mask, 16 * 64 + 1, 0) != 0 && errno != EPERM &&
      errno != ENOSYS && errno != EACCES) {
    const int err = errno;
    munmap(p, length);
    TORCH_CHECK(false, who, ": mbind to node ", node, " failed (errno ", err, ")");
  }
  return at::from_blob(p, sizes, [length](void* q) { munmap(q, length); }, options);
}

// A bias of N elements as a contiguous (N) vector in x's dtype, for the kernels that take plain pointers
std::optional<at::Tensor> bias_as(const std::optional<at::Tensor>& bias, const at::Tensor& x, int64_t n,
                                  const char* who) {
  if (!bias.has_value()) return std::nullopt;
  TORCH_CHECK(bias->numel() == n, who, ": the bias has ", bias->numel(), " elements, the output ", n, " columns");
  return bias->to(x.scalar_type()).reshape({n}).contiguous();
}

at::Tensor onednn(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
}

// MKL's packed-B GEMM, from the MKL that torch's libtorch_cpu carries and exports where torch is built
// with MKL (LP64: 32-bit ints). Weak: on a torch without MKL the library still loads, the pointers are
// null, and the mkl_packed providers fail to prepare (so they measure 0 and are never chosen).
extern "C" {
std::size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc) __attribute__((weak));
}
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112, kCblasPacked = 151,
              kCblasBMatrix = 162;

// A packed weight is a 1-D float32 tensor: a 64-byte header (the rows M it was packed for, N, K, as
// int64) then MKL's buffer, so the buffer keeps the tensor's 64-byte alignment. M is MKL's hint for the
// packing; the packed weight serves any number of rows (a later variant's other sequence length). It is
// a plain strided tensor: numatp places it on its socket's node and reads its pages like any weight's.
constexpr int64_t kPackHeader = 16;   // floats

void require_mkl() {
  TORCH_CHECK(cblas_sgemm_compute != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_pack_get_size != nullptr,
              "numatp: this torch build does not export MKL's packed GEMM (cblas_sgemm_pack/compute in "
              "libtorch_cpu), so the mkl_packed providers cannot run; leave them out of GemmOptions.providers");
}

// node >= 0: the buffer's pages are bound to that node (a real topology's socket), else torch's allocator
at::Tensor mkl_pack(const at::Tensor& w, int64_t m, int64_t node) {
  require_mkl();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat,
              "numatp::mkl_pack: the weight must be a 2-D (N, K) float32 tensor, got ", w.scalar_type(), " ",
              w.sizes());
  TORCH_CHECK(m > 0 && m <= INT32_MAX, "numatp::mkl_pack: rows must be in 1..2^31-1, got ", m);
  const at::Tensor wc = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const std::size_t bytes = cblas_sgemm_pack_get_size(kCblasBMatrix, m, n, k);
  const int64_t numel = kPackHeader + static_cast<int64_t>((bytes + 3) / 4);
  at::Tensor out = node >= 0 ? mapped_on_node({numel}, w.options(), static_cast<int>(node), "numatp::mkl_pack")
                             : at::empty({numel}, w.options());
  auto* head = reinterpret_cast<int64_t*>(out.mutable_data_ptr<float>());
  head[0] = m;
  head[1] = n;
  head[2] = k;
  // B = W^T: the (N, K) row-major weight read transposed, leading dimension K
  cblas_sgemm_pack(kCblasRowMajor, kCblasBMatrix, kCblasTrans, m, n, k, 1.0f, wc.const_data_ptr<float>(), k,
                   out.mutable_data_ptr<float>() + kPackHeader);
  return out;
}

// y = x @ W^T (+ bias) into y, an (M, N) float32 matrix whose rows may be further apart than N (the
// columns of a wider tensor): MKL writes there itself, no copy
void mkl_into(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
              int64_t k, at::Tensor& y) {
  require_mkl();
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.numel() > kPackHeader,
              "numatp mkl_packed: the weight must be numatp::mkl_pack's buffer, got ", packed.scalar_type(), " ",
              packed.sizes());
  const auto* head = reinterpret_cast<const int64_t*>(packed.const_data_ptr<float>());
  const int64_t m = x.size(0);
  TORCH_CHECK(head[1] == n && head[2] == k, "numatp mkl_packed: the weight was packed as (N, K) = (", head[1],
              ", ", head[2], "), the call asks for (", n, ", ", k, ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "numatp mkl_packed: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == m && y.size(1) == n &&
                  (y.stride(1) == 1 || n == 1) && (y.stride(0) >= n || m == 1),
              "numatp mkl_packed: the output must be an (", m, ", ", n, ") float32 matrix of unit column stride, "
              "got ", y.scalar_type(), " ", y.sizes(), " strides ", y.strides());
  if (m == 0 || n == 0) return;
  const at::Tensor xc = x.contiguous();
  float beta = 0.0f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "numatp mkl_packed: the bias has ", bias->numel(), " elements, the output ",
                n, " columns");
    y.copy_(bias->to(at::kFloat).reshape({1, n}).expand({m, n}));
    beta = 1.0f;
  }
  // the row stride of a single row is any number: MKL only needs it to be at least N
  const int64_t ldc = m == 1 ? std::max<int64_t>(n, y.stride(0)) : y.stride(0);
  cblas_sgemm_compute(kCblasRowMajor, kCblasNoTrans, kCblasPacked, m, n, k, xc.const_data_ptr<float>(), k,
                      packed.const_data_ptr<float>() + kPackHeader, k, beta, y.mutable_data_ptr<float>(), ldc);
}

at::Tensor mkl(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
               int64_t k) {
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  mkl_into(x, packed, bias, n, k, y);
  return y;
}

// ---- the amx and dpbf16 providers: bf16 weights packed into AMX tiles' layout (amx.cpp) ----
//
// A packed weight is a 1-D bfloat16 tensor: a 64-byte header (N and K as int64, then zeros) and the tiles.
// The amx provider multiplies it on the tiles; dpbf16 with AVX512-BF16 dot products (a tile row is the
// operand VDPBF16PS takes), on CPUs without AMX.
constexpr int64_t kAmxHeader = 32;   // bf16 values

void require_amx(const char* who) {
  TORCH_CHECK(numatp_amx_usable() == 1, who, ": this CPU, compiler or kernel gives no AMX-BF16 tiles (Intel "
              "Xeon 4th generation and later, Linux 5.16+), so the amx provider cannot run; leave it out of "
              "GemmOptions.providers");
}

void require_dot(const char* who, const char* provider = "dpbf16") {
  TORCH_CHECK(numatp_dot_usable() == 1, who, ": this CPU has no AVX512-BF16 (Intel Cooper Lake, Sapphire Rapids "
              "and later, AMD Zen 4 and later), so the ", provider, " provider cannot run; leave it out of "
              "GemmOptions.providers");
}

// W (N, K) bf16, any strides (a (K, N) weight's transposed view is read as it lies); node >= 0: the buffer's
// pages are bound to that node (a real topology's socket), else torch's allocator
at::Tensor tile_pack(const at::Tensor& w, int64_t node, const char* who) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              who, ": the weight must be a 2-D (N, K) bfloat16 tensor, got ", w.scalar_type(), " ", w.sizes());
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t numel = kAmxHeader + numatp_amx_packed_size(n, k);
  at::Tensor out = node >= 0 ? mapped_on_node({numel}, w.options(), static_cast<int>(node), who)
                             : at::empty({numel}, w.options());
  auto* bits = static_cast<std::uint16_t*>(out.mutable_data_ptr());
  std::memset(bits, 0, kAmxHeader * 2);
  auto* head = reinterpret_cast<int64_t*>(bits);
  head[0] = n;
  head[1] = k;
  numatp_amx_pack(static_cast<const std::uint16_t*>(w.const_data_ptr()), n, k, w.stride(0), w.stride(1),
                  bits + kAmxHeader);
  return out;
}

at::Tensor amx_pack(const at::Tensor& w, int64_t node) {
  require_amx("numatp::amx_pack");
  return tile_pack(w, node, "numatp::amx_pack");
}

at::Tensor dot_pack(const at::Tensor& w, int64_t node) {
  require_dot("numatp::dot_pack");
  return tile_pack(w, node, "numatp::dot_pack");
}

using TileLinear = void (*)(const std::uint16_t*, std::int64_t, std::int64_t, const std::uint16_t*, std::int64_t,
                            const std::uint16_t*, std::uint16_t*);

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n, int64_t k, const char* who, TileLinear kernel) {
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() >= kAmxHeader,
              who, ": the weight must be a buffer of numatp::amx_pack or numatp::dot_pack, got ", packed.scalar_type(),
              " ", packed.sizes());
  const auto* bits = static_cast<const std::uint16_t*>(packed.const_data_ptr());
  const auto* head = reinterpret_cast<const int64_t*>(bits);
  TORCH_CHECK(head[0] == n && head[1] == k && packed.numel() == kAmxHeader + numatp_amx_packed_size(n, k), who,
              ": the weight was packed as (N, K) = (", head[0], ", ", head[1], "), the call asks for (", n, ", ", k,
              ")");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, who, ": x must be bfloat16, got ", x.scalar_type());
  const int64_t m = x.size(0);
  const auto b = bias_as(bias, x, n, who);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0) {
    kernel(bits + kAmxHeader, n, k, static_cast<const std::uint16_t*>(xc.const_data_ptr()), m,
           b ? static_cast<const std::uint16_t*>(b->const_data_ptr()) : nullptr,
           static_cast<std::uint16_t*>(y.mutable_data_ptr()));
  }
  return y;
}

at::Tensor amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
               int64_t k) {
  require_amx("numatp amx");
  return tile_linear(x, packed, bias, n, k, "numatp amx", &numatp_amx_linear);
}

at::Tensor dot(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t n,
               int64_t k) {
  require_dot("numatp dpbf16");
  return tile_linear(x, packed, bias, n, k, "numatp dpbf16", &numatp_dot_linear);
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
  const auto b = bias_as(bias, x, n, "numatp gemv");
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

// ---- a decode step's attention: one query per sequence against the cache (attention.cpp) ----

// q (B, H, 1, D), k and v (B, Hk, S, D) with Hk dividing H, mask (B or 1, H or 1, 1, S) added to the scores
// or none; fp32 or bf16, all alike. Returns (B, H, 1, D), contiguous.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1,
              "numatp decode_attention: q (B, H, 1, D), k and v (B, Hk, S, D); got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == D && Hk > 0 && H % Hk == 0,
              "numatp decode_attention: k and v must be (", B, ", Hk, S, ", D, ") with Hk dividing ", H,
              "; got ", k.sizes(), " and ", v.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "numatp decode_attention: float32 or bfloat16, q, k and v alike; got ", dtype, ", ", k.scalar_type(),
              ", ", v.scalar_type());
  auto last = [](const at::Tensor& t) { return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = last(q), kc = last(k), vc = last(v);
  at::Tensor mc;
  int64_t m_b = 0, m_h = 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.dim() == 4 && (m.size(0) == 1 || m.size(0) == B) && (m.size(1) == 1 || m.size(1) == H) &&
                    m.size(2) == 1 && m.size(3) == S && m.scalar_type() == dtype,
                "numatp decode_attention: the mask must be (", B, " or 1, ", H, " or 1, 1, ", S, ") of ", dtype,
                "; got ", m.sizes(), " of ", m.scalar_type());
    mc = last(m);
    m_b = m.size(0) == 1 ? 0 : mc.stride(0);
    m_h = m.size(1) == 1 ? 0 : mc.stride(1);
  }
  at::Tensor out = at::empty({B, H, 1, D}, q.options());
  if (out.numel() == 0) return out;
  const std::int64_t sizes[5] = {B, H, Hk, S, D};
  const std::int64_t strides[10] = {qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                                    vc.stride(0), vc.stride(1), vc.stride(2), m_b, m_h};
  numatp_decode_attention(qc.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(),
                          mask.has_value() ? mc.const_data_ptr() : nullptr, out.mutable_data_ptr(),
                          dtype == at::kBFloat16, sizes, strides, static_cast<float>(scale));
  return out;
}

// ---- quantized weights: numatp.runtime.gemm.quant's buffer ----
//
// One flat uint8 tensor: a 128-byte header of int64 (magic, version, bits, N, K, group, has zeros, the
// offsets of q, scales and zeros, q's bytes, the total), then the sections (see quant.py).

constexpr int64_t kQuantMagic = 0x5150544E;   // "NTPQ"
constexpr int64_t kQuantVersion = 1;
constexpr int64_t kQuantHeader = 128;

struct QuantBuf {
  int64_t bits, n, k, group, zeros, q_off, s_off, z_off, q_bytes, total;
  int64_t act;   // 8: the activations are quantized too (int8:a8, int4:gG:a8), 0: weight-only
  const std::uint8_t* base;
  const std::uint8_t* q() const { return base + q_off; }
  const float* s() const { return reinterpret_cast<const float*>(base + s_off); }
  const float* z() const { return zeros ? reinterpret_cast<const float*>(base + z_off) : nullptr; }
  int64_t groups() const { return k / group; }
};

// n < 0: any N (the header's)
QuantBuf quant_buf(const at::Tensor& w, int64_t n, int64_t k, const char* who) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 1 && w.is_contiguous() && w.numel() >= kQuantHeader,
              who, ": the weight must be a quantized buffer (a contiguous 1-D uint8 tensor made by "
              "numatp.runtime.gemm.quant), got ", w.scalar_type(), " ", w.sizes(), "; plain float weights take "
              "the plain providers");
  QuantBuf b{};
  b.base = w.const_data_ptr<std::uint8_t>();
  int64_t h[13];
  std::memcpy(h, b.base, sizeof h);
  TORCH_CHECK(h[0] == kQuantMagic && h[1] == kQuantVersion, who, ": the weight is not a numatp quantized buffer "
              "(magic ", h[0], ", version ", h[1], "; expected ", kQuantMagic, ", ", kQuantVersion,
              "): quantize it with numatp.runtime.gemm.quant.quantize");
  b.bits = h[2], b.n = h[3], b.k = h[4], b.group = h[5], b.zeros = h[6];
  b.q_off = h[7], b.s_off = h[8], b.z_off = h[9], b.q_bytes = h[10], b.total = h[11], b.act = h[12];
  TORCH_CHECK((n < 0 || b.n == n) && b.k == k, who, ": the quantized weight is (N, K) = (", b.n, ", ", b.k,
              "), the call asks for ", n < 0 ? std::string("K = ") + std::to_string(k)
                                              : "(" + std::to_string(n) + ", " + std::to_string(k) + ")");
  TORCH_CHECK(b.bits == 8 || b.bits == 4, who, ": quantized weights are int8 or int4, the header says ", b.bits,
              " bits");
  // int4's kernels are built for groups of 32, 64 and 128 (numatp.runtime.gemm.quant.GROUPS)
  TORCH_CHECK(b.group > 0 && b.k % b.group == 0 &&
                  (b.bits == 8 ? b.group == b.k : b.group == 32 || b.group == 64 || b.group == 128),
              who, ": a ", b.bits, "-bit weight of K = ", b.k, " cannot have groups of ", b.group,
              b.bits == 4 ? " (int4 takes groups of 32, 64 or 128 dividing K)" : " (int8 takes one scale a channel)");
  TORCH_CHECK(b.act == 0 || (b.act == 8 && !b.zeros && b.k % 32 == 0), who,
              ": int8 activations (int8:a8, int4:gG:a8) go with weights without zeros and K a multiple of 32; the "
              "header says activations ", b.act, ", ", b.bits, "-bit weights", b.zeros ? " with zeros" : "", ", K = ",
              b.k);
  const int64_t q_bytes = b.bits == 8 ? b.n * b.k : b.n * b.k / 2, s_bytes = b.n * b.groups() * 4;
  TORCH_CHECK(b.total == w.numel() && b.q_bytes == q_bytes && b.q_off >= kQuantHeader &&
                  b.q_off + q_bytes <= b.total && b.s_off % 4 == 0 && b.s_off + s_bytes <= b.total &&
                  (!b.zeros || (b.z_off % 4 == 0 && b.z_off + s_bytes <= b.total)),
              who, ": the quantized buffer's header does not match its ", w.numel(), " bytes (total ", b.total,
              ", q at ", b.q_off, "+", b.q_bytes, ", scales at ", b.s_off, ", zeros at ", b.z_off, ")");
  return b;
}

void check_x(const at::Tensor& x, const char* who) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, who,
              ": activations are float32 or bfloat16 over a quantized weight, got ", x.scalar_type());
}

// x as an :a8 weight's kernels read it: each row's blocks of 32 quantized to int8 and back (qx * d),
// in x's dtype. The prompt's providers (qtile, q8_aten) multiply this, so that a prompt and a decode step
// quantize their activations alike (qgemv sums the integers themselves, in fp32: for bf16 x the prompt's
// also rounds qx * d to bf16).
at::Tensor act8(const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  if (xc.numel() > 0)
    numatp_qact8(xc.const_data_ptr(), xc.scalar_type() == at::kBFloat16, xc.size(0), xc.size(1),
                 out.mutable_data_ptr());
  return out;
}

// embedding(W, ids) of a (rows, k) table stored quantized: the rows dequantized in fp32 (as
// numatp.runtime.gemm.quant.dequantize), then in dtype. In C++ so that a compiled segment calls it without
// the GIL: as a Python op, each socket's lookup of a decode step took the GIL in turn (5% of an int4 step's
// samples on each socket's thread, gpt2-medium at 2 sockets).
at::Tensor qembedding(const at::Tensor& buf, const at::Tensor& ids, int64_t k, at::ScalarType dtype) {
  const char* who = "numatp::qembedding";
  const QuantBuf b = quant_buf(buf, -1, k, who);
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, who,
              ": ids are int64 or int32, got ", ids.scalar_type());
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t count = flat.numel();
  const int64_t* at_ = flat.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(at_[i] >= 0 && at_[i] < b.n, who, ": id ", at_[i], " is outside the table's ", b.n, " rows");
  const bool direct = dtype == at::kFloat || dtype == at::kBFloat16;
  at::Tensor out = at::empty({count, k}, buf.options().dtype(direct ? dtype : at::kFloat));
  if (count > 0 && k > 0)
    numatp_qrows(b.q(), b.s(), b.z(), static_cast<int>(b.bits), b.n, k, b.group, at_, count, out.mutable_data_ptr(),
                 dtype == at::kBFloat16);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  out = out.view(shape);
  return direct ? out : out.to(dtype);
}

// quant.cpp's GEMV: up to 16 rows, the weight streamed once. int8_dot (q8dot): int8 weights without zeros
// and bf16 x, the weight widened to bf16 once for every row of a pass and summed by _mm512_dpbf16_ps (fp32
// FMAs otherwise, qgemv's int8 path)
at::Tensor qgemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n,
                 int64_t k, bool int8_dot = false) {
  const char* who = int8_dot ? "numatp q8dot" : "numatp qgemv";
  const QuantBuf b = quant_buf(w, n, k, who);
  check_x(x, who);
  const int64_t m = x.size(0);
  TORCH_CHECK(m <= kGemvMaxRows, who, ": runs up to ", kGemvMaxRows, " rows (a decode step), got ", m,
              "; use qtile or q8_aten for more");
  if (int8_dot) {
    require_dot(who, "q8dot");
    TORCH_CHECK(b.bits == 8 && !b.zeros, who, ": reads int8 weights without zero points, got a ", b.bits,
                "-bit weight", b.zeros ? " with zero points" : "", "; use qgemv");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, who, ": takes bf16 activations, got ", x.scalar_type(),
                "; use qgemv");
  }
  const auto bb = bias_as(bias, x, n, who);
  // q8dot on an int8:a8 weight: x quantized and multiplied back in bf16 (as the prompt's providers), then
  // its bf16 products; qgemv sums the integers of x's blocks itself. q8dot shares the widened weight among
  // the rows of a pass: with 8 rows (a server's decode step) 269 us where qgemv's integer passes of 4 took
  // 453 (1024 x 4096, two Zen 4 threads, from memory)
  const at::Tensor xc = int8_dot && b.act ? act8(x) : x.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0 && n > 0)
    numatp_qgemv(b.q(), b.s(), b.z(), static_cast<int>(b.bits), n, k, b.group, xc.const_data_ptr(),
                 x.scalar_type() == at::kBFloat16, bb ? bb->const_data_ptr() : nullptr, y.mutable_data_ptr(), m,
                 int8_dot ? 1 : 0, b.act && !int8_dot ? 1 : 0);
  return y;
}

// Dequantize-per-tile GEMM: blocks of output channels dequantized into a buffer of this thread's (in x's
// dtype: the weight rounded to bf16 where x is bf16, exact for fp32), each multiplied by a GEMM into the
// output's columns: oneDNN's for bf16 (measured on an AVX-512/AMX Xeon, 2 threads, 512 x 1024 x 4096: 350
// GFLOP/s where ATen's mm ran 165), ATen's (MKL) for fp32, written in place. Blocks as large as kTileBytes
// allows: one block for most layers, so that the GEMM runs on as many columns as it can.
constexpr int64_t kTileBytes = 8 << 20;

at::Tensor qtile(at::Tensor x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n,
                 int64_t k) {
  const char* who = "numatp qtile";
  const QuantBuf b = quant_buf(w, n, k, who);
  check_x(x, who);
  if (b.act) x = act8(x);   // an :a8 format: the activations as its kernels read them
  const auto bb = bias_as(bias, x, n, who);
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t item = bf16 ? 2 : 4;
  const int64_t nb = std::min<int64_t>(n, std::max<int64_t>(64, kTileBytes / (k * item) / 64 * 64));
  thread_local at::Tensor tile;
  if (!tile.defined() || tile.scalar_type() != x.scalar_type() || tile.numel() < nb * k)
    tile = at::empty({nb * k}, x.options());
  for (int64_t n0 = 0; n0 < n; n0 += nb) {
    const int64_t cols = std::min(nb, n - n0);
    at::Tensor wt = tile.narrow(0, 0, cols * k).view({cols, k});
    numatp_qdequant(b.q(), b.s(), b.z(), static_cast<int>(b.bits), n, k, b.group, n0, n0 + cols,
                    wt.mutable_data_ptr(), bf16);
    if (bf16) {   // oneDNN's bf16 GEMM (AMX where the CPU has it): ATen's mm ran at half its rate
      std::optional<at::Tensor> bs;
      if (bb) bs = bb->narrow(0, n0, cols);
      at::Tensor part = onednn(x, wt, bs);
      if (cols == n) return part;
      y.narrow(1, n0, cols).copy_(part);
    } else {
      at::Tensor out = cols == n ? y : y.narrow(1, n0, cols);
      if (bb) {
        at::addmm_out(out, bb->narrow(0, n0, cols), x, wt.t());
      } else {
        at::mm_out(out, x, wt.t());
      }
    }
  }
  return y;
}

// ATen's int8 weight-only GEMM on views into the buffer: the scales converted to x's dtype (rounded to
// bf16 where x is bf16), the bias added to its output (a second rounding for bf16)
at::Tensor q8_aten(at::Tensor x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n,
                   int64_t k) {
  const char* who = "numatp q8_aten";
  const QuantBuf b = quant_buf(w, n, k, who);
  check_x(x, who);
  if (b.act) x = act8(x);
  TORCH_CHECK(b.bits == 8 && !b.zeros, who, ": ATen's _weight_int8pack_mm reads int8 weights with one scale per "
              "output channel, not a ", b.bits, "-bit weight", b.zeros ? " with zeros" : "",
              "; use qgemv or qtile");
  // measured (torch 2.13): its bfloat16 kernel reads past a row whose K is not a multiple of 16 (NaNs,
  // then a crash)
  TORCH_CHECK(x.scalar_type() == at::kFloat || k % 16 == 0, who, ": ATen's bfloat16 _weight_int8pack_mm needs K "
              "a multiple of 16, got K = ", k, "; use qgemv or qtile");
  const at::Tensor q = w.narrow(0, b.q_off, b.q_bytes).view(at::kChar).view({n, k});
  const at::Tensor s = w.narrow(0, b.s_off, n * 4).view(at::kFloat).to(x.scalar_type());
  at::Tensor y = at::_weight_int8pack_mm(x.contiguous(), q, s);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, who, ": the bias has ", bias->numel(), " elements, the output ", n, " columns");
    y.add_(bias->reshape({n}).to(x.scalar_type()));
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
    case kQgemv:
      return qgemv(x, w, bias, n, k);
    case kQ8Dot:
      return qgemv(x, w, bias, n, k, true);
    case kQtile:
      return qtile(x, w, bias, n, k);
    case kQ8Aten:
      return q8_aten(x, w, bias, n, k);
    case kAmx:
      return amx(x, w, bias, n, k);
    case kDot:
      return dot(x, w, bias, n, k);
    default:
      TORCH_CHECK(false, "numatp::linear: unknown provider code ", provider);
  }
}

// The provider's product written into out, the (M, N) columns of a wider tensor: in place where the
// provider's kernel takes the output's row stride (MKL's packed GEMM), else by a copy of its output.
void linear_into(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t provider,
                 int64_t n, int64_t k, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "numatp::linear_into: x must be (M, ", k, "), got ", x.sizes());
  if (provider == kMklPacked) {
    mkl_into(x, w, bias, n, k, out);
  } else {
    out.copy_(linear(x, w, bias, provider, n, k));
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
  return mapped_on_node(like.sizes(), like.options(), node, "numatp::socket_all_reduce");
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
  m.def("linear_into(Tensor x, Tensor w, Tensor? bias, int provider, int n, int k, Tensor(a!) out) -> ()");
  m.def("mkl_pack(Tensor w, int m, int node=-1) -> Tensor");
  m.def("amx_pack(Tensor w, int node=-1) -> Tensor");
  // no tensor to dispatch on: one kernel for every backend
  m.def("amx_usable() -> bool", [] { return numatp_amx_usable() == 1; });
  m.def("dot_pack(Tensor w, int node=-1) -> Tensor");
  m.def("dot_usable() -> bool", [] { return numatp_dot_usable() == 1; });
  m.def("socket_all_reduce(Tensor x, Tensor? after) -> (Tensor, Tensor)");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("qembedding(Tensor buf, Tensor ids, int k, ScalarType dtype) -> Tensor");
}

// every backend: a packed oneDNN weight is an MkldnnCPU tensor beside a CPU activation
TORCH_LIBRARY_IMPL(numatp, CompositeExplicitAutograd, m) {
  m.impl("linear", &linear);
  m.impl("linear_into", &linear_into);
  m.impl("mkl_pack", &mkl_pack);
  m.impl("amx_pack", &amx_pack);
  m.impl("dot_pack", &dot_pack);
  m.impl("socket_all_reduce", &all_reduce);
  m.impl("decode_attention", &decode_attention);
  m.impl("qembedding", &qembedding);
}
