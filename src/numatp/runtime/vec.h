// numatp's vectors of fp32 for its kernels (gemv.cpp, quant.cpp, attention.cpp): bf16 as stored, loads of
// fp32 or bf16 widened to fp32 lanes, the few arithmetic operations the kernels use, and an OpenMP split of a
// loop over the caller's team. The width is this CPU's (the library is built with -march=native): AVX-512,
// else AVX2 with FMA, else one lane. No torch headers, so the kernels compile in about a second.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace numatp_vec {

// bfloat16 as stored: the high half of an fp32
inline float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t u = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline std::uint16_t float_to_bf16(float f) {   // to nearest, ties to even; NaN stays a (quiet) NaN
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return f != f ? std::uint16_t(0x7FC0) : std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct bf16 {
  std::uint16_t bits;
  bf16() = default;
  explicit bf16(float f) : bits(float_to_bf16(f)) {}
};
static_assert(sizeof(bf16) == 2);

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return bf16_to_float(v.bits); }

// Software prefetch into L1: the line at p, or the lines of the bytes from p on
inline void ahead(const void* p) { __builtin_prefetch(p, 0, 3); }
// The same for a line read once and not again soon (a decode step's weight, streamed in one pass):
// non-temporal, so that the stream pushes less of what the step reads again out of the caches (where
// measured faster: amx.cpp's dot_group).
inline void ahead_once(const void* p) { __builtin_prefetch(p, 0, 0); }
inline void ahead(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) ahead(static_cast<const char*>(p) + i);
}

#if defined(__AVX2__)
// the sum of 8 fp32 lanes: vsum where the vectors are AVX2's, and the 256-bit integer-product loops of
// quant.cpp whatever the width
inline float sum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// ---- vectors of fp32, loaded from fp32 or bf16 ----
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vset(float v) { return _mm512_set1_ps(v); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline vf vload(const bf16* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf y, vf n) { return _mm512_scalef_ps(y, n); }   // y * 2^n, n integral
inline vf vkeep_ge(vf x, vf low, vf v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vset(float v) { return _mm256_set1_ps(v); }
inline float vsum(vf a) { return sum8(a); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <typename T>
inline vf vload(const T* p, int n) {  // a tail: through a zeroed buffer
  alignas(32) T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return vload(static_cast<const T*>(tmp));
}
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf y, vf n) {   // y * 2^n, n integral in [-126, 127]: 2^n made in the exponent bits
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                                  _mm256_set1_epi32(127)), 23)));
}
inline vf vkeep_ge(vf x, vf low, vf v) { return _mm256_and_ps(_mm256_cmp_ps(x, low, _CMP_GE_OQ), v); }
#else
constexpr int kLanes = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vset(float v) { return v; }
inline float vsum(vf a) { return a; }
template <typename T>
inline vf vload(const T* p) { return to_float(*p); }
template <typename T>
inline vf vload(const T* p, int) { return to_float(*p); }
inline void vstore(float* p, vf a) { *p = a; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vexp(vf x) { return x < -87.3f ? 0.f : std::exp(x); }
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// e^x as Cephes' expf computes it (a degree-6 polynomial of r = x - n ln 2, times 2^n): within a few ulp
// of expf; 0 below -87.3 (where expf's result is subnormal, 1e-38 at most) and for -inf
inline vf vexp(vf x) {
  const vf low = vset(-87.3f);
  const vf xs = vmax(vmin(x, vset(88.37f)), low);
  const vf n = vround(vmul(xs, vset(1.44269504088896341f)));
  // ln 2 in two parts (Cody-Waite), so that r keeps its low bits
  const vf r = vfma(n, vset(2.12194440e-4f), vfma(n, vset(-0.693359375f), xs));
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  return vkeep_ge(x, low, vscale2(vadd(vfma(vmul(p, r), r, r), vset(1.f)), n));
}
#endif

// f(begin, end) on each thread of the caller's OpenMP team, over contiguous parts of [0, count).
// OpenMP itself, not ATen's parallel_for: the first at::parallel_for a library makes on a thread resets that
// thread's thread count to the process-wide value torch last set on any thread (at::init_num_threads),
// which undid a socket worker's own count (measured: a 2-thread socket ran its whole decode step, MKL
// included, on 1 thread after the caller had set 1 for its token loop, 0.6x).
template <typename F>
void parallel(int64_t count, int64_t grain, F&& f) {
#ifdef _OPENMP
  const int64_t threads = std::min<int64_t>(omp_get_max_threads(), (count + grain - 1) / grain);
  if (threads > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), all = omp_get_num_threads();
      const int64_t begin = count * t / all, end = count * (t + 1) / all;
      if (begin < end) f(begin, end);
    }
    return;
  }
#endif
  f(0, count);
}

inline int64_t team_size() {
#ifdef _OPENMP
  return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
  return 1;
#endif
}

}  // namespace numatp_vec
