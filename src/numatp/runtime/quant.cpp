// numatp's kernels over quantized weights (numatp.runtime.gemm.quant's buffer: int8 per output channel,
// int4 in groups along K, optional float zeros per group).
//
//   numatp_qgemv     y (M, N) = x (M, K) @ W^T (+ b) for a decode step's few rows, reading the weight as
//                    stored: a decode step is bound by the bytes it streams, and int8 streams half of
//                    bf16's, int4 about a quarter. Parallel over output channels on the calling thread's
//                    OpenMP team (as gemv.cpp; ops.cpp calls it for up to 16 rows).
//   numatp_qdequant  channels [n0, n1) of W dequantized into an (n1 - n0, K) float32 or bfloat16 buffer
//                    (the dequantize-per-tile GEMM of ops.cpp, which then calls ATen's GEMM on it).
//   numatp_qrows     the channels given by ids, dequantized likewise: numatp::qembedding, the lookup of an
//                    embedding table stored quantized (a tied LM head's, read by its lookup).
//   numatp_qact8     x quantized in blocks of 32 and multiplied back, as an :a8 weight's kernels read it
//                    (its prompt providers multiply that; numatp_qgemv sums the integers itself).
//
// Sums are in fp32: for each output channel and group, t = sum_k x[k] * qv[k] with qv the stored integer
// (int8: q, int4: q - 8), exact in bf16 and fp32; the group's sum is scaled once (acc += t * s[g]), the
// zeros enter as z[g] * sum_{k in g} x[k] (the row's group sums of x, computed once per call); the bias
// is added in fp32 and the result rounded once to x's dtype (to nearest, ties to even). Paths by the
// CPU (the library is built with -march=native):
//
//   AVX512-BF16, int4 and bf16 x: _mm512_dpbf16_ps on bf16 x as it is and the weight's nibbles as the
//        bf16 of 128 + q (exact: the nibble OR 0x4300, one vpternlogd, no table), 64 bytes (128 values)
//        at a time; each chunk's lanes start from -136 x the sum of the x values they read (computed once
//        per call), so that they sum x (q - 8). The cancellation costs about 5 of fp32's 24 bits of the
//        sums (terms up to 136 |x| where the result's are up to 8 |x|): far below the bf16 output's 8,
//        and measured 12-15% faster than looking up bf16 (q - 8) by vpermw (1 thread, 1024 x 1024 in L2).
//        x is reordered once per call to match the bytes' order (reorder_x4);
//   AVX-512F / AVX2+FMA / scalar: fp32 FMAs on the integers widened to fp32 (int4 through a 16-entry
//        vpermps table on AVX-512), x in fp32 (bf16 x widened once per call, exact; fp32 x never
//        rounded). qgemv's int8 takes this path for bf16 x too: widening int8 to bf16 for dpbf16 goes
//        through fp32 anyway (vpmovsxbd, vcvtdq2ps, then vcvtne2ps2bf16), and measured on an AVX-512/AMX
//        Xeon (1 thread, 1024 x 1024 int8 in L2), the fp32 FMAs ran 1.4x (1 row) to 1.6x (4 rows) faster.
//        int8 as two nibbles through dpbf16 (int4's bf16 128 + n, with x and 16 x; one Zen 4 core, one
//        row) read 15-16 GB/s from memory against this path's 12-13, but 18 against 26 from L2, and with
//        both cores streaming 20-27 GB/s in all, as this path (alternated, two runs): it stays;
//   AVX512-BF16, int8 and bf16 x, asked for (the q8dot provider, int8_dot): that widening to bf16, once
//        per 32 values for all of a pass's rows (passes of up to 8), then one dpbf16 of 32 products per
//        row where the fp32 path runs two FMAs of 16 (i8_bf16). Where several rows share the widened
//        values it wins: one Zen 4 core, bf16 x, alternated in one process, from memory, 4096 x 1024:
//        0.64x of qgemv's rate at 1 row, 1.02x at 2, 1.42x at 4, 2.21x at 8, 2.35x at 16; the 75968 x 896
//        LM head shard of qwen2.5-0.5b 0.60x, 0.95x, 1.59x, 2.41x, 2.61x. Both are providers, measured per
//        shape: the table takes each where it is faster.
//
// No torch headers: plain pointers in and out (ops.cpp reads the buffer's header and checks the tensors).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace quant_kernels {

using namespace numatp_vec;   // fp32 vectors, bf16 conversions, ahead() and parallel(), as gemv.cpp

using u16 = std::uint16_t;

// The weight: the buffer's sections and sizes (ops.cpp reads them from the header).
struct QW {
  const std::uint8_t* q;   // int8: (N, K) int8; int4: (N, K / 2) bytes, blocks of 32 (value i low, i + 16 high)
  const float* s;          // (N, groups)
  const float* z;          // (N, groups) or null
  int bits;
  std::int64_t n, k, group, groups;
};

// Software prefetch (as gemv.cpp: the hardware prefetcher alone keeps too few lines in flight for one
// core), kAheadBytes ahead of each load in the order this channel slot reads: along its row, then on into
// its row of the blocks of NR channels after (NR rows down each), not into the next row, which another channel
// of the block is reading already (an int4 row of K = 1024 is 512 bytes: a fixed distance along the
// memory prefetched little but lines already loaded, and the stream ran at 5-6 GB/s instead of 9-10).
//
// A decode step's single row (MR = 1) reads a block's channels one after another, each in chains of sums
// of its own (the caller's channels follow each other in memory): the weight is one stream, fetched 2 KiB
// ahead, not NR streams side by side. One Zen 4 core, 48 weights of 4096 x 1024 in turn (from memory),
// bf16 x, the two kernels alternated, GB/s: int8 8.5-10.1 with NR streams, 17.0-17.2 as one; int4:g64
// 10.3-11.8 and 15.1-17.2 (fp32 x 6.5 and 8.1); qwen2.5-0.5b's 2432 x 896: int8 8.5-9.2 and 15.7-16.0,
// int4 11.0-11.8 and 14.8-15.3. A distance of 1 KiB ran int4 at 13.1-13.4 GB/s, of 3-8 KiB int8 at
// 13.7-15.6. Two to four rows keep NR streams: there the arithmetic bounds the rate, and reading their
// channels one after another measured no better (3 rows: int8 8.0 and 8.2 GB/s, int4 9.1 and 7.5; 4 rows:
// int8 8.2 and 6.8).
constexpr std::int64_t kAheadBytes = 2048;
inline const void* along(const void* row_start, std::int64_t at, std::int64_t row, std::int64_t next) {
  const char* p = static_cast<const char*>(row_start);
  const std::int64_t to = at + kAheadBytes;
  return p + (to / row) * next + to % row;
}

// ---- the fp32 path: int8 and int4 widened to vec.h's vectors of fp32 ----
#if defined(__AVX512F__)
// kLanes int8 as fp32
inline vf load_i8(const std::int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// a block of 32 int4 values (16 bytes) as fp32 (q - 8), in order
inline void load_i4(const std::uint8_t* p, vf* out) {
  const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  out[0] = _mm512_permutexvar_ps(d, table);                          // vpermps reads the index's low 4 bits
  out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline vf load_i8(const std::int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void load_i4(const std::uint8_t* p, vf* out) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
  const __m256i eight = _mm256_set1_epi32(8);
  auto cvt = [&](__m128i v) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(v), eight)); };
  out[0] = cvt(lo);
  out[1] = cvt(_mm_srli_si128(lo, 8));
  out[2] = cvt(hi);
  out[3] = cvt(_mm_srli_si128(hi, 8));
}
#else
inline vf load_i8(const std::int8_t* p) { return float(*p); }
inline void load_i4(const std::uint8_t* p, vf* out) {
  for (int i = 0; i < 16; ++i) {
    out[i] = float(int(p[i] & 0x0F) - 8);
    out[16 + i] = float(int(p[i] >> 4) - 8);
  }
}
#endif

// int8, fp32 x, one row: channel n's s[n] * sum_k x[k] q[n, k] in four chains of sums; the caller's
// channels follow each other in memory, so reading them in turn is one stream, fetched ahead across rows
inline float i8_f32_row(const QW& w, const float* x, std::int64_t n) {
  const std::int64_t k = w.k;
  const std::int8_t* q = reinterpret_cast<const std::int8_t*>(w.q) + n * k;
  vf a[4] = {vzero(), vzero(), vzero(), vzero()};
  std::int64_t i = 0;
  for (; i + 4 * kLanes <= k; i += 4 * kLanes) {
    if (i % 64 == 0) ahead(q + i + kAheadBytes);   // on into the next channels' rows
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) a[u] = vfma(vload(x + i + u * kLanes), load_i8(q + i + u * kLanes), a[u]);
  }
  for (; i + kLanes <= k; i += kLanes) a[0] = vfma(vload(x + i), load_i8(q + i), a[0]);
  float t = vsum(vadd(vadd(a[0], a[1]), vadd(a[2], a[3])));
  for (; i < k; ++i) t += x[i] * float(q[i]);
  return t * w.s[n];
}

// int8, fp32 x: res[r][j] = s[n] * sum_k x[r, k] q[n, k] for channels n0 .. n0 + NR
template <int MR, int NR>
void i8_f32(const QW& w, const float* x, std::int64_t n0, float (*res)[NR]) {
  if constexpr (MR == 1) {
    for (int j = 0; j < NR; ++j) res[0][j] = i8_f32_row(w, x, n0 + j);
    return;
  }
  const std::int64_t k = w.k;
  vf acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
  const std::int8_t* q = reinterpret_cast<const std::int8_t*>(w.q) + n0 * k;
  std::int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    vf wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      if (i % 64 == 0) ahead(along(q + j * k, i, k, NR * k));
      wv[j] = load_i8(q + j * k + i);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const vf xv = vload(x + r * k + i);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      float t = vsum(acc[r][j]);
      for (std::int64_t c = i; c < k; ++c) t += x[r * k + c] * float(q[j * k + c]);
      res[r][j] = t * w.s[n0 + j];
    }
}

// int4, fp32 x: res[r][j] = sum_g s[n, g] * sum_{k in g} x[r, k] (q[n, k] - 8) (the zeros are added later).
// G (the group) and the channel j are constants, so that a group's widened values and every sum stay in
// registers: with both at run time the group's values and the accumulators lived on the stack (one core of a
// Xeon, the AVX2 build, int4:g64 from L2: 6.8 GB/s, 9.0 as it is)
template <int MR, int NR, int G>
void i4_f32_g(const QW& w, const float* x, std::int64_t n0, float (*res)[NR]) {
  const std::int64_t k = w.k, row = k / 2;
  constexpr int kBlockVecs = 32 / kLanes, kVecs = G / kLanes;
  vf acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
  const std::uint8_t* q = w.q + n0 * row;
  auto step = [&](std::int64_t gi, auto j_c) {
    constexpr int j = decltype(j_c)::value;
    const std::int64_t k0 = gi * G;
    const std::uint8_t* p = q + j * row + k0 / 2;
    vf wv[kVecs];   // one group of one channel
#pragma GCC unroll 4
    for (int b = 0; b < G / 32; ++b) {
      if (b % 4 == 0) ahead(MR == 1 ? p + 16 * b + kAheadBytes : along(q + j * row, k0 / 2 + 16 * b, row, NR * row));
      load_i4(p + 16 * b, wv + b * kBlockVecs);
    }
    const vf sv = vset(w.s[(n0 + j) * w.groups + gi]);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + r * k + k0;
      vf t0 = vzero(), t1 = vzero();   // two chains of sums
#pragma GCC unroll 16
      for (int v = 0; v + 1 < kVecs; v += 2) {
        t0 = vfma(vload(xr + v * kLanes), wv[v], t0);
        t1 = vfma(vload(xr + (v + 1) * kLanes), wv[v + 1], t1);
      }
      acc[r][j] = vfma(vadd(t0, t1), sv, acc[r][j]);
    }
  };
  const std::int64_t groups = w.groups;
  [&]<int... J>(std::integer_sequence<int, J...>) {
    if constexpr (MR == 1) {   // one row: channel after channel, one stream (see kAheadBytes)
      ((void)[&] { for (std::int64_t gi = 0; gi < groups; ++gi) step(gi, std::integral_constant<int, J>{}); }(), ...);
    } else {
      for (std::int64_t gi = 0; gi < groups; ++gi) (step(gi, std::integral_constant<int, J>{}), ...);
    }
  }(std::make_integer_sequence<int, NR>{});
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) res[r][j] = vsum(acc[r][j]);
}

template <int MR, int NR>
void i4_f32(const QW& w, const float* x, std::int64_t n0, float (*res)[NR]) {
  switch (w.group) {   // the buffer's groups: 32, 64 or 128 (numatp.runtime.gemm.quant.GROUPS)
    case 32: return i4_f32_g<MR, NR, 32>(w, x, n0, res);
    case 64: return i4_f32_g<MR, NR, 64>(w, x, n0, res);
    default: return i4_f32_g<MR, NR, 128>(w, x, n0, res);
  }
}

// ---- the AVX512-BF16 path, bf16 x ----
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// int4 in chunks of 128 values (64 bytes: four blocks of 32). With the chunk's bytes as 32 16-bit lanes,
// the nibbles are taken out as four vectors of 32 bf16 (the low nibbles of the even bytes, of the odd
// bytes, then the high nibbles likewise, each as bf16 128 + q); x is reordered once per call into the same order
// (reorder_x4). A dpbf16 lane j sums values of block j / 4 only, so one chunk's four products sum into t
// and t is scaled per lane by its block's group scale.
inline int x4_index(int p, int i) {   // the value (0..127 in the chunk) of vector p's 16-bit lane i
  const int byte = 2 * i + (p & 1);
  return 32 * (byte / 16) + (p >= 2 ? 16 : 0) + byte % 16;
}

// x (M, K) bf16 -> (M, Kp) in the chunks' order, Kp = K rounded up to 128, zero past K
void reorder_x4(const u16* x, std::int64_t m, std::int64_t k, u16* out) {
  const std::int64_t kp = (k + 127) / 128 * 128;
  int index[128];
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 32; ++i) index[32 * p + i] = x4_index(p, i);
  for (std::int64_t r = 0; r < m; ++r)
    for (std::int64_t c = 0; c < kp; c += 128)
      for (int e = 0; e < 128; ++e) {
        const std::int64_t at = c + index[e];
        out[r * kp + c + e] = at < k ? x[r * k + at] : u16(0);
      }
}

template <int MR, int NR>
void i4_bf16(const QW& w, const u16* xr, const float* corr, std::int64_t n0, float (*res)[NR]) {
  const std::int64_t k = w.k, row = k / 2, kp = (k + 127) / 128 * 128, g = w.group;
  // bf16 (q - 8) for q = 0..15: -8 .. 7
  const __m512i low4 = _mm512_set1_epi16(0x000F), magic = _mm512_set1_epi16(0x4300);
  const std::int64_t chunks = kp / 128;
  // lane -> the chunk's group holding it: lane j sums block j / 4
  const __m512i by_group = g == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                           : g == 64 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                     : _mm512_setzero_si512();
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  __m512 alt = _mm512_setzero_ps();   // one row: the current channel's second chain (odd chunks)
  const std::uint8_t* q = w.q + n0 * row;
  // one chunk of 128 values from c; Full: all 64 bytes are in the row, read by plain loads. Masks only
  // for a row's last, partial chunk: with a masked load of each chunk's scales, int4 streamed from memory
  // at 11 GB/s (groups of 32) and 19 GB/s (64) against 20 and 27 GB/s with plain loads (one Zen 5 core,
  // 48 weights of 4096 x 1024, the two alternated in one process; groups of 128 broadcast their scale).
  // channels [J0, J1) of the block; one row (MR = 1) takes them one at a time, a stream (see kAheadBytes)
  auto chunk = [&](std::int64_t c, auto full_c, auto j0_c, auto j1_c) {
    constexpr bool Full = decltype(full_c)::value;
    constexpr int J0 = decltype(j0_c)::value, J1 = decltype(j1_c)::value;
    const std::int64_t bytes = Full ? 64 : (k - c) / 2;
    const __mmask64 bm = Full ? ~__mmask64(0) : (__mmask64)((1ull << bytes) - 1);
    const __mmask8 gm = (__mmask8)((1u << std::max<std::int64_t>(1, 2 * bytes / g)) - 1);
    const float* sc = w.s + n0 * w.groups + c / g;
    __m512i xv[MR][4];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < 4; ++p) xv[r][p] = _mm512_loadu_si512(xr + r * kp + c + 32 * p);
#pragma GCC unroll 16
    for (int j = J0; j < J1; ++j) {
      const std::uint8_t* p = q + j * row + c / 2;
      if constexpr (MR == 1) ahead(p + kAheadBytes);
      else ahead(along(q + j * row, c / 2, row, NR * row));
      const __m512i v = Full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(bm, p);
      // (nibble & 15) | 0x4300: bf16 of 128 + q, exact
      const __m512i w0 = _mm512_ternarylogic_epi32(v, low4, magic, 0xEA);
      const __m512i w1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, magic, 0xEA);
      const __m512i w2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, magic, 0xEA);
      const __m512i w3 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 12), low4, magic, 0xEA);
      // the chunk's scales by lane
      const float* sj = sc + j * w.groups;
      __m128 s4;
      if (!Full) s4 = _mm_maskz_loadu_ps(gm, sj);
      else if (g == 32) s4 = _mm_loadu_ps(sj);
      else s4 = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sj)));
      const __m512 sv = g == 128 ? _mm512_set1_ps(*sj) : _mm512_permutexvar_ps(by_group, _mm512_castps128_ps512(s4));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        // two chains of two: the chunk's sum waits on two dot products' latency, not four
        __m512 t0 = _mm512_dpbf16_ps(_mm512_loadu_ps(corr + (r * chunks + c / 128) * 16), (__m512bh)xv[r][0],
                                     (__m512bh)w0);
        __m512 t1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xv[r][1], (__m512bh)w1);
        t0 = _mm512_dpbf16_ps(t0, (__m512bh)xv[r][2], (__m512bh)w2);
        t1 = _mm512_dpbf16_ps(t1, (__m512bh)xv[r][3], (__m512bh)w3);
        if constexpr (MR == 1) {   // one channel at a time: two chains of chunks, not one
          if ((c / 128) & 1) alt = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), sv, alt);
          else acc[r][j] = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), sv, acc[r][j]);
        } else {
          acc[r][j] = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), sv, acc[r][j]);
        }
      }
    }
  };
  const std::int64_t whole = k / 128 * 128;
  auto channels = [&](auto j0_c, auto j1_c) {
    for (std::int64_t c = 0; c < whole; c += 128) chunk(c, std::true_type{}, j0_c, j1_c);
    if (whole < kp) chunk(whole, std::false_type{}, j0_c, j1_c);
  };
  if constexpr (MR == 1) {
    [&]<int... J>(std::integer_sequence<int, J...>) {
      ((channels(std::integral_constant<int, J>{}, std::integral_constant<int, J + 1>{}),
        acc[0][J] = _mm512_add_ps(acc[0][J], alt), alt = _mm512_setzero_ps()), ...);
    }(std::make_integer_sequence<int, NR>{});
  } else {
    channels(std::integral_constant<int, 0>{}, std::integral_constant<int, NR>{});
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) res[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}

// int8, bf16 x (the q8dot provider): res[r][j] = s[n] * sum_k x[r, k] q[n, k], the weight widened
// to bf16 32 values at a time (exact: |q| <= 127 needs 7 of bf16's 8 bits; through fp32, vpmovsxbd,
// vcvtdq2ps, vcvtne2ps2bf16) and shared by every row of the pass, each row one _mm512_dpbf16_ps of 32 products
// (exact in fp32) where the fp32 path spends two FMAs of 16.
template <int MR, int NR>
void i8_bf16(const QW& w, const u16* x, std::int64_t n0, float (*res)[NR]) {
  const std::int64_t k = w.k;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const std::int8_t* q = reinterpret_cast<const std::int8_t*>(w.q) + n0 * k;
  auto step = [&](std::int64_t c, auto full_c) {
    constexpr bool Full = decltype(full_c)::value;
    const std::int64_t left = k - c;   // < 32 where not Full
    const __mmask32 xm = Full ? ~__mmask32(0) : (__mmask32)((1ull << left) - 1);
    const __mmask16 lo_m = Full ? __mmask16(0xFFFF) : (__mmask16)((1u << std::min<std::int64_t>(left, 16)) - 1);
    const __mmask16 hi_m = Full ? __mmask16(0xFFFF)
                                : (__mmask16)((1u << std::max<std::int64_t>(left - 16, 0)) - 1);
    __m512i xv[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      xv[r] = Full ? _mm512_loadu_si512(x + r * k + c) : _mm512_maskz_loadu_epi16(xm, x + r * k + c);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const std::int8_t* p = q + j * k + c;
      if (c % 64 == 0) ahead(along(q + j * k, c, k, NR * k));
      const __m128i b0 = Full ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(lo_m, p);
      const __m128i b1 = Full ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))
                              : _mm_maskz_loadu_epi8(hi_m, p + 16);
      const __m512bh wv = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1)),
                                              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0)));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv[r], wv);
    }
  };
  std::int64_t c = 0;
  for (; c + 32 <= k; c += 32) step(c, std::true_type{});
  if (c < k) step(c, std::false_type{});
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) res[r][j] = _mm512_reduce_add_ps(acc[r][j]) * w.s[n0 + j];
}
#else
constexpr bool kBf16Dot = false;
#endif

// ---- int8 activations (int8:a8, int4:gG:a8): x quantized per row in blocks of 32, integer dot products ----
//
// Each row of x, in blocks of 32 along K (K a multiple of 32): d = max |x| / 127 and qx = nearbyint(x / d)
// (to nearest, ties to even; d = 0: qx = 0), in fp32 (numatp.runtime.gemm.quant.quantize_activations is
// the same arithmetic). A channel's sum is then sum_b d_b sum_{k in b} qx[k] q[n, k], times s[n]: each
// block's integer sum is exact (int32), scaled once in fp32. llama.cpp's Q8_0 dot products quantize the
// activations the same way (blocks of 32, a scale each); the weight here keeps one scale per channel.
// The integer products are what make it fast: one VNNI vpdpbusd takes 64 weight bytes where the fp32
// path widens 16 at a time (two Zen 4 cores streaming int8 4096 x 1024 from memory, a test program:
// 21 -> 27 GB/s; 2048 x 1024: 22 -> 28).
//
// Per row, the call's activations: qx (K int8), d per block, and -128 x the sum over blocks of d times
// the block's sum of qx: vpdpbusd multiplies unsigned by signed bytes, so the VNNI path reads the weight
// as q + 128 (q XOR 0x80) and adds that constant to each channel's sum, which leaves sum_b d_b (qx . q)_b
// (the terms it takes back are of the size of the sum's own: fp32 rounding, no more).
struct Act8 {
  std::vector<std::int8_t> q;   // (M, K)
  std::vector<float> d;         // (M, K / 32)
  std::vector<float> c;         // (M): -128 sum_b d_b sum_{k in b} qx[k]
  // int4 weights (i4_a8): qx per run of kRun blocks, values 0-15 of each then 16-31 of each, rows of Kq
  // (K rounded up to whole runs, zeros past K); each block's d four times (rows of Kq / 8); and per group
  // g of the weight T_g = sum_{b in g} d_b sum_{k in b} qx[k] (rows of K / group)
  std::vector<std::int8_t> q4;
  std::vector<float> d4, t;
};

// blocks of a run: those one vector of int4 bytes holds (64 bytes with AVX512-VNNI, 32 with AVX2)
#if defined(__AVX512VNNI__)
constexpr std::int64_t kRun = 4;
#else
constexpr std::int64_t kRun = 2;
#endif
constexpr std::int64_t run_k(std::int64_t k) { return (k + 32 * kRun - 1) / (32 * kRun) * (32 * kRun); }

// the block's scale and its values quantized; fp32 x
inline float quantize_block(const float* x, std::int8_t* q) {
  float amax = 0.f;
  bool nan = false;
  for (int i = 0; i < 32; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    nan |= x[i] != x[i];
  }
  const float d = amax / 127.f;
  for (int i = 0; i < 32; ++i) {
    float t = d > 0.f ? x[i] / d : 0.f;
    t = std::nearbyint(std::min(127.f, std::max(-127.f, t)));
    q[i] = t == t ? static_cast<std::int8_t>(t) : std::int8_t(0);
  }
  // a block holding a NaN: its scale NaN; an infinity: its scale infinite (times a zero sum, NaN): the sums
  // that read the block are not finite, as x's product would not be
  return nan ? std::numeric_limits<float>::quiet_NaN() : d;
}

#if defined(__AVX512F__)
// the same in vectors (the same values: x / d is IEEE division either way, rounded to nearest even)
inline float quantize_block_v(const float* x, std::int8_t* q, int& sum) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  if (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) {
    const float d = quantize_block(x, q);
    sum = 0;
    for (int i = 0; i < 32; ++i) sum += q[i];
    return d;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float d = amax / 127.f;
  if (!(d > 0.f)) {
    std::memset(q, 0, 32);
    sum = 0;
    return d == d ? d : std::numeric_limits<float>::quiet_NaN();   // 0, or an infinity's NaN (as quantize_block)
  }
  const __m512 dv = _mm512_set1_ps(d), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  auto one = [&](__m512 v) {
    const __m512 t = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(v, dv)));
    return _mm512_cvtps_epi32(_mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  };
  const __m512i q0 = one(x0), q1 = one(x1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return d;
}
#endif

// group: the int4 weight's (0: an int8 weight, no int4 forms)
void quantize_rows(const float* x, std::int64_t m, std::int64_t k, std::int64_t group, Act8& a) {
  const std::int64_t blocks = k / 32, kq = run_k(k);
  a.q.resize(static_cast<std::size_t>(m * k));
  a.d.resize(static_cast<std::size_t>(m * blocks));
  a.c.assign(static_cast<std::size_t>(m), 0.f);
  if (group) {
    a.q4.assign(static_cast<std::size_t>(m * kq), 0);
    a.d4.assign(static_cast<std::size_t>(m * kq / 8), 0.f);
    a.t.assign(static_cast<std::size_t>(m * (k / group)), 0.f);
  }
  for (std::int64_t r = 0; r < m; ++r)
    for (std::int64_t b = 0; b < blocks; ++b) {
      std::int8_t* q = a.q.data() + r * k + 32 * b;
      int sum = 0;
#if defined(__AVX512F__)
      const float d = quantize_block_v(x + r * k + 32 * b, q, sum);
#else
      const float d = quantize_block(x + r * k + 32 * b, q);
      for (int i = 0; i < 32; ++i) sum += q[i];
#endif
      a.d[r * blocks + b] = d;
      a.c[r] += -128.f * float(sum) * d;
      if (group) {
        std::int8_t* run = a.q4.data() + r * kq + 32 * kRun * (b / kRun) + 16 * (b % kRun);
        std::memcpy(run, q, 16);
        std::memcpy(run + 16 * kRun, q + 16, 16);
        for (int l = 0; l < 4; ++l) a.d4[r * (kq / 8) + 4 * b + l] = d;
        a.t[r * (k / group) + 32 * b / group] += d * float(sum);
      }
    }
}

// rows [0, MR) of the call's quantized x (from row r0) against channels n0 .. n0 + NR, one channel after
// another (one stream, as the one-row kernels): res[r][j] = s[n] sum_b d_b (qx . q)_b
template <int MR, int NR>
void i8_a8(const QW& w, const Act8& a, std::int64_t r0, std::int64_t n0, float (*res)[NR]) {
  const std::int64_t k = w.k, blocks = k / 32;
  const std::int8_t* qx = a.q.data() + r0 * k;
  const float* dx = a.d.data() + r0 * blocks;
  for (int j = 0; j < NR; ++j) {
    const std::int8_t* q = reinterpret_cast<const std::int8_t*>(w.q) + (n0 + j) * k;
    float sum[MR];
#if defined(__AVX512VNNI__)
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    // a vector of 64 products holds two blocks, 8 lanes each: their scales from a vector of 4 blocks'
    const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i second = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    // the 64 bytes at c (masked: the row's last 32), their blocks' scales by lane from ds (4 blocks)
    auto chunk = [&](std::int64_t c, int h, __mmask64 bm, const __m512i& by_lane, __mmask8 dm) {
      ahead(q + c + kAheadBytes);
      const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bm, q + c), flip);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_maskz_loadu_epi8(bm, qx + r * k + c));
        const __m512 ds = _mm512_castps128_ps512(_mm_maskz_loadu_ps(dm, dx + r * blocks + (c / 128) * 4));
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(by_lane, ds), acc[r][h]);
      }
    };
    std::int64_t c = 0;
    for (; c + 128 <= k; c += 128) {
      chunk(c, 0, ~__mmask64(0), first, __mmask8(0xF));
      chunk(c + 64, 1, ~__mmask64(0), second, __mmask8(0xF));
    }
    if (c + 64 <= k) chunk(c, 0, ~__mmask64(0), first, __mmask8(0x3)), c += 64;
    if (c < k) chunk(c, 1, __mmask64(0xFFFFFFFFull), c % 128 ? second : first, __mmask8(c % 128 ? 0x7 : 0x1));
    for (int r = 0; r < MR; ++r)
      sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) + a.c[r0 + r];
#elif defined(__AVX2__) && defined(__FMA__)
    // vpmaddubsw multiplies unsigned by signed bytes into saturating 16-bit pairs: |q| by qx with q's
    // sign (|q| <= 128, |qx| <= 127: a pair's sum stays below 2^15), then pairs of those into int32
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    // block b into chain H (a constant, as in i4_a8)
    auto one = [&](std::int64_t b, auto h_c) {
      constexpr int H = decltype(h_c)::value;
      const std::int64_t c = 32 * b;
      if (b % 2 == 0) ahead(q + c + kAheadBytes);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c));
      const __m256i aw = _mm256_abs_epi8(wv);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * k + c));
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
        acc[r][H] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(dx + r * blocks + b), acc[r][H]);
      }
    };
    std::int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) one(b, std::integral_constant<int, 0>{}), one(b + 1, std::integral_constant<int, 1>{});
    if (b < blocks) one(b, std::integral_constant<int, 0>{});
    for (int r = 0; r < MR; ++r) sum[r] = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
    for (int r = 0; r < MR; ++r) {
      float t = 0.f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        std::int32_t dot = 0;
        for (int i = 0; i < 32; ++i) dot += std::int32_t(qx[r * k + 32 * b + i]) * q[32 * b + i];
        t += float(dot) * dx[r * blocks + b];
      }
      sum[r] = t;
    }
#endif
    for (int r = 0; r < MR; ++r) res[r][j] = sum[r] * w.s[n0 + j];
  }
}

// int4 weights against int8 activations (int4:gG:a8): the nibbles (0..15, unsigned) by qx (signed), through
// VNNI's vpdpbusd or AVX2's vpmaddubsw, each block's sum of q qx exact in int32, minus 8 x the block's sum
// of qx (folded into one constant per channel: -8 sum_g s[n, g] sum_{b in g} d_b S_b), scaled by
// d_b s[n, g] in fp32. A run of blocks a step (kRun: 4 with VNNI, 2 with AVX2): the low nibbles of the run
// in one vector, the high in another, and x reordered once per call to match (Act8::q4). Two Zen 4 cores,
// from memory, bf16 x, int4:g64 (1024 x 4096, 4096 x 1024): one row 26.4 and 26.1 GB/s through vpdpbusd,
// 14.8 and 15.6 with this CPU's build of the 256-bit vpmaddubsw loop, 28.3 and 26.6 for the weight-only
// dpbf16 kernel; four rows 11.6 and 10.7 against 13.9 and 14.1 (where the CPU has AVX512-BF16, int4:a8
// is for the numerics llama.cpp's Q4_0 has, not for speed).
template <int MR, int NR>
void i4_a8(const QW& w, const Act8& a, std::int64_t r0, std::int64_t n0, float (*res)[NR]) {
  const std::int64_t k = w.k, blocks = k / 32, row = k / 2, per_group = w.group / 32, kq = run_k(k);
  const std::int8_t* qx = a.q4.data() + r0 * kq;
  const float* d4 = a.d4.data() + r0 * (kq / 8);
  const float* tg = a.t.data() + r0 * w.groups;
  for (int j = 0; j < NR; ++j) {
    const std::int64_t n = n0 + j;
    const std::uint8_t* q = w.q + n * row;
    const float* s = w.s + n * w.groups;
    float sum[MR];
#if defined(__AVX512VNNI__)
    // four blocks (64 bytes) a step: vpdpbusd on the low nibbles and the high, each 32-bit lane the sum of
    // 8 products of one block; the lanes scaled by their block's d and group's s
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i by_group = per_group == 1 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                             : per_group == 2 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                              : _mm512_setzero_si512();
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int gshift = per_group == 1 ? 0 : per_group == 2 ? 1 : 2;   // block b's group: b >> gshift
    // the run of blocks from b into chain H; Full: four whole blocks (plain loads), else the row's last
    // blocks (masked). H is a constant and no division is left in the loop: an accumulator picked by a
    // run-time index lived on the stack, and the run's group count took an idiv (int4:g64:a8 from L2 at 13
    // GB/s on one core of an AMX Xeon, the int8 :a8 kernel 52)
    auto run = [&](std::int64_t b, auto full_c, auto h_c) {
      constexpr bool Full = decltype(full_c)::value;
      constexpr int H = decltype(h_c)::value;
      const std::uint8_t* p = q + 16 * b;
      ahead(p + kAheadBytes);
      __m512i v;
      __m128 s4;
      if constexpr (Full) {
        v = _mm512_loadu_si512(p);
        const float* sg = s + (b >> gshift);
        s4 = per_group == 1 ? _mm_loadu_ps(sg)
             : per_group == 2 ? _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sg)))
                              : _mm_set1_ps(*sg);
      } else {
        const std::int64_t left = blocks - b;   // 1 to 3
        v = _mm512_maskz_loadu_epi8((__mmask64(1) << (16 * left)) - 1, p);
        const int groups_here = static_cast<int>((left + per_group - 1) >> gshift);
        s4 = _mm_maskz_loadu_ps(__mmask8((1u << groups_here) - 1), s + (b >> gshift));
      }
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const __m512 sv = _mm512_permutexvar_ps(by_group, _mm512_castps128_ps512(s4));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const std::int8_t* xr = qx + r * kq + 32 * b;
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
        t = _mm512_dpbusd_epi32(t, hi, _mm512_loadu_si512(xr + 64));
        acc[r][H] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t),
                                    _mm512_mul_ps(_mm512_loadu_ps(d4 + r * (kq / 8) + 4 * b), sv), acc[r][H]);
      }
    };
    std::int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
      run(b, std::true_type{}, std::integral_constant<int, 0>{});
      run(b + 4, std::true_type{}, std::integral_constant<int, 1>{});
    }
    if (b + 4 <= blocks) run(b, std::true_type{}, std::integral_constant<int, 0>{}), b += 4;
    if (b < blocks) run(b, std::false_type{}, std::integral_constant<int, 1>{});
    // -8 sum_g s[n, g] T_g, 16 groups a vector
    for (int r = 0; r < MR; ++r) {
      const float* t = tg + r * w.groups;
      std::int64_t g = 0;
      for (; g + 16 <= w.groups; g += 16)
        acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(s + g), _mm512_mul_ps(_mm512_set1_ps(-8.f), _mm512_loadu_ps(t + g)),
                                    acc[r][0]);
      if (g < w.groups) {
        const __mmask16 gm = __mmask16((1u << (w.groups - g)) - 1);
        acc[r][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(gm, s + g),
                                    _mm512_mul_ps(_mm512_set1_ps(-8.f), _mm512_maskz_loadu_ps(gm, t + g)), acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) sum[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int gshift = per_group == 1 ? 0 : per_group == 2 ? 1 : 2;   // block b's group: b >> gshift
    // the run of blocks from b (its low and high nibbles, its blocks' group scales by lane) into chain H (a
    // constant: an accumulator picked at run time lives on the stack, as a division in the loop costs; see
    // the VNNI loop)
    auto run = [&](std::int64_t b, __m256i lo, __m256i hi, __m256 sv, auto h_c) {
      constexpr int H = decltype(h_c)::value;
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const std::int8_t* xr = qx + r * kq + 32 * b;
        const __m256i p16 = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32))));
        const __m256 t = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[r][H] = _mm256_fmadd_ps(t, _mm256_mul_ps(_mm256_loadu_ps(d4 + r * (kq / 8) + 4 * b), sv), acc[r][H]);
      }
    };
    auto pair = [&](std::int64_t b, auto h_c) {   // blocks b and b + 1
      const std::uint8_t* p = q + 16 * b;
      if (b % 8 == 0) ahead(p + kAheadBytes);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      run(b, _mm256_and_si256(v, low4), _mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
          _mm256_set_m128(_mm_set1_ps(s[(b + 1) >> gshift]), _mm_set1_ps(s[b >> gshift])), h_c);
    };
    std::int64_t b = 0;
    for (; b + 4 <= blocks; b += 4) pair(b, std::integral_constant<int, 0>{}), pair(b + 2, std::integral_constant<int, 1>{});
    if (b + 2 <= blocks) pair(b, std::integral_constant<int, 0>{}), b += 2;
    if (b < blocks) {   // an odd last block: its 16 bytes, the high half of the vectors zero
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
      const __m128i l4 = _mm_set1_epi8(0x0F);
      run(b, _mm256_zextsi128_si256(_mm_and_si128(v, l4)),
          _mm256_zextsi128_si256(_mm_and_si128(_mm_srli_epi16(v, 4), l4)), _mm256_set1_ps(s[b >> gshift]),
          std::integral_constant<int, 1>{});
    }
    for (int r = 0; r < MR; ++r) sum[r] = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
    for (int r = 0; r < MR; ++r) {
      float t = 0.f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        std::int32_t dot = 0;
        for (int i = 0; i < 16; ++i) {
          const std::uint8_t byte = q[16 * b + i];
          dot += std::int32_t(byte & 0x0F) * a.q[(r0 + r) * k + 32 * b + i] +
                 std::int32_t(byte >> 4) * a.q[(r0 + r) * k + 32 * b + 16 + i];
        }
        t += float(dot) * a.d[(r0 + r) * blocks + b] * s[b / per_group];
      }
      sum[r] = t;
    }
#endif
    for (int r = 0; r < MR; ++r) {
#if defined(__AVX512VNNI__)
      res[r][j] = sum[r];   // the correction is in the sum
#else
      float c = 0.f;   // -8 sum_g s[n, g] T_g
      for (std::int64_t g = 0; g < w.groups; ++g) c += s[g] * tg[r * w.groups + g];
      res[r][j] = sum[r] - 8.f * c;
#endif
    }
  }
}

// What one call reads: x in the form its path takes, the group sums of x where the weight has zeros.
struct Call {
  const QW& w;
  std::int64_t m;
  bool bf16;                 // x and y are bf16 (else fp32)
  const void* x;             // as given
  const float* xf;           // fp32 x (the fp32 path)
  const u16* xb;             // int4 and bf16 x: x reordered for the AVX512-BF16 path, rows of Kp (else null)
  const float* corr;         // with xb: -136 x the sum of the x values each dpbf16 lane reads, per chunk
  const u16* x8;             // int8 through dpbf16 (q8dot): bf16 x as given, for i8_bf16 (else null)
  std::vector<float> sums;   // (M, groups): sum_{k in g} x[r, k], where the weight has zeros
  const Act8* a8 = nullptr;  // int8 weights with int8 activations: x quantized (i8_a8)
};

constexpr int nr_for(int mr) { return mr == 1 ? 8 : mr <= 4 ? 4 : 2; }

// rows [r0, r0 + MR) x channels [n0, n0 + NR): the fp32 sums, by the path this call takes
template <int MR, int NR>
void block_sums(const Call& c, std::int64_t r0, std::int64_t n0, float (*res)[NR]) {
  const QW& w = c.w;
  if constexpr (MR <= 4) {
    if (c.a8) {   // int8 activations: integer products
      if (w.bits == 8) return i8_a8<MR, NR>(w, *c.a8, r0, n0, res);
      return i4_a8<MR, NR>(w, *c.a8, r0, n0, res);
    }
  }
#if defined(__AVX512BF16__)
  if (c.x8) return i8_bf16<MR, NR>(w, c.x8 + r0 * w.k, n0, res);   // int8, bf16 x, through dpbf16
#endif
  if constexpr (MR <= 4) {   // passes of more rows are i8_bf16's alone
#if defined(__AVX512BF16__)
    const std::int64_t kp = (w.k + 127) / 128 * 128;
    if (c.xb) return i4_bf16<MR, NR>(w, c.xb + r0 * kp, c.corr + r0 * (kp / 128) * 16, n0, res);   // int4, bf16 x
#endif
    if (w.bits == 8) i8_f32<MR, NR>(w, c.xf + r0 * w.k, n0, res);
    else i4_f32<MR, NR>(w, c.xf + r0 * w.k, n0, res);
  }
}

// channels [n0, n0 + NR) x rows [r0, r0 + MR): fp32 sums, then zeros and bias, rounded once into y
template <int MR, int NR>
void block(const Call& c, std::int64_t r0, std::int64_t n0, const void* bias, void* y) {
  const QW& w = c.w;
  float res[MR][NR];
  // the bias 64 channels on: each call finds it cold (a step streams the other weights between two), and
  // waiting for its lines in the epilogue took 3% of an int4 decode step's samples on gpt2-medium
  if (bias) ahead(static_cast<const char*>(bias) + (n0 + 64) * (c.bf16 ? 2 : 4));
  block_sums<MR, NR>(c, r0, n0, res);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      const std::int64_t n = n0 + j;
      float v = res[r][j];
      if (w.z) {
        const float* z = w.z + n * w.groups;
        const float* xs = c.sums.data() + (r0 + r) * w.groups;
        float zs = 0.f;
        for (std::int64_t g = 0; g < w.groups; ++g) zs += z[g] * xs[g];
        v += zs;
      }
      const std::int64_t at = (r0 + r) * w.n + n;
      if (c.bf16) {
        if (bias) v += bf16_to_float(static_cast<const u16*>(bias)[n]);
        static_cast<u16*>(y)[at] = float_to_bf16(v);
      } else {
        if (bias) v += static_cast<const float*>(bias)[n];
        static_cast<float*>(y)[at] = v;
      }
    }
}

void qgemv(const QW& w, const void* x, int x_bf16, const void* bias, void* y, std::int64_t m, int int8_dot,
           int act8) {
  Call c{w, m, x_bf16 != 0, x, nullptr, nullptr, nullptr, nullptr, {}};
  thread_local Act8 a8;   // the calling thread's, kept: no allocation per call
  if (act8) {   // the caller checks: weights without zeros, K a multiple of 32
    const float* xf = static_cast<const float*>(x);
    thread_local std::vector<float> widened;
    if (c.bf16) {
      widened.resize(static_cast<std::size_t>(m * w.k));
      for (std::int64_t i = 0; i < m * w.k; ++i) widened[i] = bf16_to_float(static_cast<const u16*>(x)[i]);
      xf = widened.data();
    }
    quantize_rows(xf, m, w.k, w.bits == 4 ? w.group : 0, a8);
    c.a8 = &a8;
    int8_dot = 0;
  }
  const std::int64_t k = w.k;
  [[maybe_unused]] const std::int64_t kp = (k + 127) / 128 * 128;
  std::vector<float> xf;
  std::vector<u16> xb;
  std::vector<float> corr;
  const bool dot = kBf16Dot && c.bf16 && w.bits == 4;
  // ops.cpp asks for it only with int8 weights without zeros, bf16 x, and a library built with AVX512-BF16
  const bool dot8 = kBf16Dot && int8_dot && c.bf16 && w.bits == 8 && !w.z;
  if (c.a8) {
    // x is read in its quantized form only
  } else if (dot8) {
    c.x8 = static_cast<const u16*>(x);
  } else if (c.bf16) {
    const u16* xs = static_cast<const u16*>(x);
    if (!dot || w.z) {
      xf.resize(static_cast<std::size_t>(m * k));
      for (std::int64_t i = 0; i < m * k; ++i) xf[i] = bf16_to_float(xs[i]);
      c.xf = xf.data();
    }
#if defined(__AVX512BF16__)
    if (dot) {
      xb.resize(static_cast<std::size_t>(m * kp));
      reorder_x4(xs, m, k, xb.data());
      c.xb = xb.data();
      const std::int64_t chunks = kp / 128;
      corr.resize(static_cast<std::size_t>(m * chunks * 16));
      for (std::int64_t r = 0; r < m; ++r)
        for (std::int64_t ch = 0; ch < chunks; ++ch)
          for (int l = 0; l < 16; ++l) {
            float t = 0.f;
            for (int p = 0; p < 4; ++p)
              for (int e = 0; e < 2; ++e) t += bf16_to_float(xb[r * kp + ch * 128 + 32 * p + 2 * l + e]);
            corr[(r * chunks + ch) * 16 + l] = -136.f * t;
          }
      c.corr = corr.data();
    }
#endif
  } else {
    c.xf = static_cast<const float*>(x);
  }
  if (w.z) {
    c.sums.assign(static_cast<std::size_t>(m * w.groups), 0.f);
    for (std::int64_t r = 0; r < m; ++r)
      for (std::int64_t g = 0; g < w.groups; ++g) {
        float t = 0.f;
        for (std::int64_t i = g * w.group; i < (g + 1) * w.group; ++i) t += c.xf[r * k + i];
        c.sums[r * w.groups + g] = t;
      }
  }
  // each thread a contiguous range of channel blocks; each block's rows in passes of up to 4 (8 for
  // i8_bf16), the block's weight read from memory once and from cache by the passes after the first. int4
  // in passes of 8 rows (2 channels a block, so that its nibbles are unpacked once for 8 rows) ran at
  // 0.55-0.67x of passes of 4 for 8-16 rows (one Zen 4 core, bf16 x, g64, alternated in one process): its 8
  // rows' x (4 vectors a row) and sums outgrow the 32 registers
  const std::int64_t span = 8;   // the ranges are cut in spans of 8 channels (a multiple of every NR)
  const std::int64_t blocks = (w.n + span - 1) / span;
  parallel(blocks, 8, [&](std::int64_t s0, std::int64_t s1) {
    for (std::int64_t s = s0; s < s1; ++s) {
      const std::int64_t c0 = s * span, c1 = std::min(w.n, c0 + span);
      const std::int64_t pass = dot8 ? 8 : 4;
      for (std::int64_t r0 = 0; r0 < m; r0 += pass) {
        const int mr = static_cast<int>(std::min<std::int64_t>(pass, m - r0));
        // channel blocks within [c0, c1): rows<MR> takes blocks of nr_for(MR) channels
        auto run = [&](auto mr_c) {
          constexpr int MR = decltype(mr_c)::value;
          constexpr int nr = nr_for(MR);
          std::int64_t n = c0;
          for (; n + nr <= c1; n += nr) block<MR, nr>(c, r0, n, bias, y);
          for (; n < c1; ++n) block<MR, 1>(c, r0, n, bias, y);
        };
        switch (mr) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          case 4: run(std::integral_constant<int, 4>{}); break;
#if defined(__AVX512BF16__)
          case 5: run(std::integral_constant<int, 5>{}); break;   // i8_bf16 only
          case 6: run(std::integral_constant<int, 6>{}); break;
          case 7: run(std::integral_constant<int, 7>{}); break;
          default: run(std::integral_constant<int, 8>{}); break;
#else
          default: break;   // passes of 4 rows at most
#endif
        }
      }
    }
  });
}

// channels [n0, n1) dequantized into out ((n1 - n0, K), fp32 or bf16): w = qv * s (+ z) in fp32 (the
// reference's arithmetic: a product then a sum, two roundings), then rounded to bf16 where asked.
// 32 values at a time into a row of fp32 (L1), then stored or rounded.
inline void put_row(const float* src, std::int64_t k, void* out, std::int64_t row, int to_bf16) {
  if (!to_bf16) {
    std::memcpy(static_cast<float*>(out) + row * k, src, static_cast<std::size_t>(k) * sizeof(float));
    return;
  }
  u16* o = static_cast<u16*>(out) + row * k;
  std::int64_t c = 0;
#if defined(__AVX512BF16__)
  for (; c + 32 <= k; c += 32)
    _mm512_storeu_si512(o + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + 16), _mm512_loadu_ps(src + c)));
#endif
  for (; c < k; ++c) o[c] = float_to_bf16(src[c]);
}

// channel n of W dequantized into dst (K floats, 32 spare): w = qv * s (+ z), a product then a sum
inline void dequant_row(const QW& w, std::int64_t n, float* dst) {
  const std::int64_t k = w.k;
  if (w.bits == 8) {
    const std::int8_t* q = reinterpret_cast<const std::int8_t*>(w.q) + n * k;
    const float s = w.s[n];
    const vf sv = vset(s);
    std::int64_t c = 0;
    for (; c + kLanes <= k; c += kLanes) vstore(dst + c, load_i8(q + c) * sv);
    for (; c < k; ++c) dst[c] = float(q[c]) * s;
  } else {
    const std::uint8_t* q = w.q + n * (k / 2);
    for (std::int64_t g = 0; g < w.groups; ++g) {
      const vf sv = vset(w.s[n * w.groups + g]);
      const vf zv = vset(w.z ? w.z[n * w.groups + g] : 0.f);
      for (std::int64_t c = g * w.group; c < (g + 1) * w.group; c += 32) {
        vf v[32 / kLanes];
        load_i4(q + c / 2, v);   // (q - 8) in order
        for (int e = 0; e < 32 / kLanes; ++e) {
          vf t = v[e] * sv;
          if (w.z) t = t + zv;
          vstore(dst + c + e * kLanes, t);
        }
      }
    }
  }
}

// channels at(0) .. at(count - 1) of W, in that order, into out ((count, K), fp32 or bf16)
template <typename At>
void rows(const QW& w, std::int64_t count, At at, void* out, int to_bf16) {
  parallel(count, 16, [&](std::int64_t a, std::int64_t b) {
    std::vector<float> tmp(static_cast<std::size_t>(w.k) + 32);
    for (std::int64_t i = a; i < b; ++i) {
      dequant_row(w, at(i), tmp.data());
      put_row(tmp.data(), w.k, out, i, to_bf16);
    }
  });
}

}  // namespace quant_kernels

extern "C" {

// y (M, N) = x (M, K) @ W^T (+ bias), x/bias/y fp32 (x_bf16 = 0) or bf16 (1), all contiguous; bias may be
// null. q, s, z: the buffer's sections (z null: no zeros); group: K for int8. int8_dot (the q8dot
// provider): int8 weights without zeros and bf16 x summed by i8_bf16 (AVX512-BF16; the caller checks).
void numatp_qgemv(const std::uint8_t* q, const float* s, const float* z, int bits, std::int64_t n, std::int64_t k,
                  std::int64_t group, const void* x, int x_bf16, const void* bias, void* y, std::int64_t m,
                  int int8_dot, int act8) {
  const quant_kernels::QW w{q, s, z, bits, n, k, group, k / group};
  quant_kernels::qgemv(w, x, x_bf16, bias, y, m, int8_dot, act8);
}

// x (M, K) fp32 (x_bf16 = 0) or bf16 (1), K a multiple of 32, as the :a8 kernels read it: each block of
// 32 quantized (qx, d) and written back as qx * d (fp32), rounded to bf16 where x is bf16
void numatp_qact8(const void* x, int x_bf16, std::int64_t m, std::int64_t k, void* out) {
  using namespace numatp_vec;
  // blocks over the calling thread's team (a prompt's x is rows x K: 512 x 1024 took 1.5 ms on one thread
  // element by element, against the few microseconds of a decode row)
  numatp_vec::parallel(m * k / 32, 64, [&](std::int64_t b0, std::int64_t b1) {
    alignas(64) float xf[32];
    alignas(16) std::int8_t q[32];
    for (std::int64_t b = b0; b < b1; ++b) {
#if defined(__AVX512F__)
      // in vectors: element by element this pass took 20-37% of an :a8 prompt's time over the weight-only
      // format's (one core of an AMX Xeon, gpt2-medium and qwen2.5-0.5b, 512 tokens)
      for (int h = 0; h < 2; ++h)
        _mm512_store_ps(xf + 16 * h, x_bf16 ? vload(static_cast<const bf16*>(x) + 32 * b + 16 * h)
                                            : vload(static_cast<const float*>(x) + 32 * b + 16 * h));
      int sum;
      const float d = quant_kernels::quantize_block_v(xf, q, sum);
      for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * h)))),
            _mm512_set1_ps(d));
        if (!x_bf16) {
          _mm512_storeu_ps(static_cast<float*>(out) + 32 * b + 16 * h, v);
          continue;
        }
        std::uint16_t* o = static_cast<std::uint16_t*>(out) + 32 * b + 16 * h;
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));   // to nearest even
#else
        _mm512_store_ps(xf + 16 * h, v);
        for (int i = 0; i < 16; ++i) o[i] = float_to_bf16(xf[16 * h + i]);
#endif
      }
#else
      for (int i = 0; i < 32; ++i)
        xf[i] = x_bf16 ? bf16_to_float(static_cast<const std::uint16_t*>(x)[32 * b + i])
                       : static_cast<const float*>(x)[32 * b + i];
      const float d = quant_kernels::quantize_block(xf, q);
      for (int i = 0; i < 32; ++i) {
        const float v = float(q[i]) * d;
        if (x_bf16) static_cast<std::uint16_t*>(out)[32 * b + i] = float_to_bf16(v);
        else static_cast<float*>(out)[32 * b + i] = v;
      }
#endif
    }
  });
}

// channels [n0, n1) of W into out, (n1 - n0, K) fp32 (to_bf16 = 0) or bf16 (1), contiguous
void numatp_qdequant(const std::uint8_t* q, const float* s, const float* z, int bits, std::int64_t n,
                     std::int64_t k, std::int64_t group, std::int64_t n0, std::int64_t n1, void* out, int to_bf16) {
  const quant_kernels::QW w{q, s, z, bits, n, k, group, k / group};
  quant_kernels::rows(w, n1 - n0, [n0](std::int64_t i) { return n0 + i; }, out, to_bf16);
}

// rows ids[0 .. count) of W (each in [0, N)) into out, (count, K) fp32 (to_bf16 = 0) or bf16 (1)
void numatp_qrows(const std::uint8_t* q, const float* s, const float* z, int bits, std::int64_t n, std::int64_t k,
                  std::int64_t group, const std::int64_t* ids, std::int64_t count, void* out, int to_bf16) {
  const quant_kernels::QW w{q, s, z, bits, n, k, group, k / group};
  quant_kernels::rows(w, count, [ids](std::int64_t i) { return ids[i]; }, out, to_bf16);
}

}  // extern "C"
