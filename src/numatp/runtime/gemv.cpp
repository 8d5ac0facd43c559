// numatp's GEMV: y (M, N) = x (M, K) @ W (+ b) for a few rows (a decode step), streaming the weight once.
//
// A decode step reads every weight once for one token per sequence, so its matmuls are bound by how fast
// the weight streams from memory. Measured on a 2-core AVX-512/AMX Xeon (2 threads, 48 distinct bf16
// weights of 8 MiB, one row): ATen 5.4-12.0 GB/s, oneDNN on a packed weight 11.7-16.1, this one 17.3-19.4
// (fp32: every provider and this one 19-22). It reads the weight as the model stores it (no copy, no
// packing):
//
//   "nk" (nn.Linear, (N, K) rows): each output is a dot product along a weight row; 4-16 rows at a time,
//        the x rows reused from L1, fp32 accumulators reduced once per output (one row of x through fp32
//        FMAs: the weight rows one after another, dot_row);
//   "kn" (GPT-2 Conv1D, (K, N) rows): each weight row scales into partial outputs, four weight rows at
//        a time (one row of bf16 x on AVX2: one at a time, kn_band_in_turn), each thread over its own band
//        of rows; the bands' partials are added at the end (7 or 8 rows of x: column strips summed in
//        registers over blocks of 16 weight rows, see kn_strips).
//
// Any number of rows of x, in passes of up to 8 (past 8 the weight is read again per pass; ops.cpp calls
// it for up to 16): a decode step of a batch of 8 sequences streams each weight once (measured, bf16, one
// thread, weights streamed, 8 rows: 30-54 GFLOP/s in passes of 4, 45-75 in one pass of 8). Sums are in
// fp32 (bf16 products are exact in fp32), the bias is added in fp32 and the result rounded once to x's
// dtype (to nearest, ties to even, as torch rounds). The vector width is this CPU's (the library is built
// with -march=native): AVX512-BF16 dot products where present, else AVX-512 or AVX2 with FMA on bf16
// widened to fp32, else scalar loops.

// No torch headers: plain pointers in and out (ops.cpp checks the tensors and calls numatp_gemv_rows_*),
// so this file compiles in about a second, not the fifteen ATen's headers take.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace gemv_kernels {

using namespace numatp_vec;

// one output: the fp32 sum plus the bias, rounded once to T
template <typename T>
inline void put(T* y, int64_t at, float sum, const T* bias, int64_t col) {
  y[at] = static_cast<T>(bias ? sum + to_float(bias[col]) : sum);
}

// Software prefetch of the weight ahead of the loads: measured on an AVX-512 Xeon (2 threads, 48
// weights of 8 MiB), it takes the "nk" loop from 17-21 to 20-27 GB/s and the "kn" one from 15-16 to
// 21-25 where a row is 2 KiB: the hardware prefetcher alone keeps too few lines in flight for one core.
// "nk"'s dot_block reads 16 rows at once, 512 bytes ahead in each (1 x 1024 x 25128 bf16, ten weights in
// turn, modes interleaved: 7.9 -> 8.9 GB/s on 1 thread, 14.6 -> 16.9 on 2, against 4 rows 1 KiB ahead;
// fp32 unchanged); one row through fp32 FMAs reads the rows in turn instead (dot_row, kRowAheadBytes).
constexpr int64_t kAheadBytes = 512;    // "nk": this far along each weight row
constexpr int64_t kAheadRows = 4;       // "kn": this many weight rows down

// ---- "nk": y[r, n] = sum_k x[r, k] * W[n, k] ----

// NR weight rows (n0 ...) against MR rows of x.
template <typename T, int MR, int NR>
void dot_block(const T* x, const T* w, const T* bias, T* y, int64_t k, int64_t n0, int64_t ldo) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    // pairs of bf16 products summed into fp32 lanes: 32 elements of K per instruction
    __m512 acc[MR][NR];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) {
        ahead(reinterpret_cast<const char*>(w + (n0 + j) * k + i) + kAheadBytes);
        wv[j] = _mm512_loadu_si512(w + (n0 + j) * k + i);
      }
      for (int r = 0; r < MR; ++r) {
        __m512i xv = _mm512_loadu_si512(x + r * k + i);
        for (int j = 0; j < NR; ++j)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
      }
    }
    if (i < k) {
      const __mmask32 m = (__mmask32)((1ull << (k - i)) - 1);
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_maskz_loadu_epi16(m, w + (n0 + j) * k + i);
      for (int r = 0; r < MR; ++r) {
        __m512i xv = _mm512_maskz_loadu_epi16(m, x + r * k + i);
        for (int j = 0; j < NR; ++j)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) put(y, r * ldo + n0 + j, _mm512_reduce_add_ps(acc[r][j]), bias, n0 + j);
    return;
  }
#endif
  vf acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    vf wv[NR];
    for (int j = 0; j < NR; ++j) {
      if ((i * sizeof(T)) % 64 == 0) ahead(reinterpret_cast<const char*>(w + (n0 + j) * k + i) + kAheadBytes);
      wv[j] = vload(w + (n0 + j) * k + i);
    }
    for (int r = 0; r < MR; ++r) {
      vf xv = vload(x + r * k + i);
      for (int j = 0; j < NR; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  if (i < k) {
    const int left = static_cast<int>(k - i);
    vf wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vload(w + (n0 + j) * k + i, left);
    for (int r = 0; r < MR; ++r) {
      vf xv = vload(x + r * k + i, left);
      for (int j = 0; j < NR; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) put(y, r * ldo + n0 + j, vsum(acc[r][j]), bias, n0 + j);
}

// One row of x through the fp32 FMAs (fp32 weights, or bf16 widened where the CPU has no bf16 dot
// product): a thread's weight rows one after another, each in four chains of sums, so that its part of the
// weight is one stream front to back (its rows follow each other in memory), fetched kRowAheadBytes
// ahead along it, on into the next rows. Reading 16 rows side by side, each 512 bytes ahead, streamed
// less: fp32, two threads at once (as two sockets), each reading its own weights in turn from memory,
// the two orders alternated in one test program on a 2-core Zen 4 (GB/s in all): 2432 x 896 28.4
// against 26.4, 896 x 2432 27.4 against 26.0, 1024 x 1024 30.4 against 23.5, 4096 x 1024 30.7 against
// 25.8, 75968 x 896 30.6 against 27.8. (bf16 on AVX512-BF16 CPUs keeps dot_block: another loop.)
constexpr int64_t kRowAheadBytes = 4096;

template <typename T>
inline float dot_row(const T* x, const T* w, int64_t k) {
  vf a[4] = {vzero(), vzero(), vzero(), vzero()};
  int64_t i = 0;
  for (; i + 4 * kLanes <= k; i += 4 * kLanes) {
    // one line of the weight per 64 bytes it reads here, kRowAheadBytes on
    for (int64_t b = 0; b < int64_t(4 * kLanes * sizeof(T)); b += 64)
      ahead(reinterpret_cast<const char*>(w + i) + b + kRowAheadBytes);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) a[u] = vfma(vload(x + i + u * kLanes), vload(w + i + u * kLanes), a[u]);
  }
  for (; i + kLanes <= k; i += kLanes) a[0] = vfma(vload(x + i), vload(w + i), a[0]);
  if (i < k) {
    const int left = static_cast<int>(k - i);
    a[1] = vfma(vload(x + i, left), vload(w + i, left), a[1]);
  }
  return vsum(vadd(vadd(a[0], a[1]), vadd(a[2], a[3])));
}

template <typename T>
void dot_rows_in_turn(const T* x, const T* w, const T* bias, T* y, int64_t k, int64_t n0, int64_t n1) {
  for (int64_t j = n0; j < n1; ++j) put(y, j, dot_row(x, w + j * k, k), bias, j);
}

template <typename T>
constexpr bool kRowsInTurn =
#if defined(__AVX512BF16__)
    !std::is_same_v<T, bf16>;
#else
    true;
#endif

template <typename T, int MR>
void nk_rows(const T* x, const T* w, const T* bias, T* y, int64_t k, int64_t n) {
  // blocks of NR weight rows (as many as the accumulators' registers allow: MR x NR), each thread one
  // contiguous range of them
  // past 4 rows of x, 2 weight rows (AVX-512: 16 accumulators of 32 registers), or 1 where only 16
  // registers exist (AVX2), so that the accumulators stay in registers
#if defined(__AVX512F__)
  constexpr int NR = MR == 1 ? 16 : MR == 2 ? 8 : MR <= 4 ? 4 : 2;
#else
  constexpr int NR = MR == 1 ? 16 : MR == 2 ? 8 : MR <= 4 ? 4 : 1;
#endif
  const int64_t blocks = (n + NR - 1) / NR;
  parallel(blocks, 64 / NR, [&](int64_t b0, int64_t b1) {
    if constexpr (MR == 1 && kRowsInTurn<T>) {
      dot_rows_in_turn(x, w, bias, y, k, NR * b0, std::min(n, NR * b1));
      return;
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = NR * b;
      if (n0 + NR <= n) {
        dot_block<T, MR, NR>(x, w, bias, y, k, n0, n);
      } else {
        for (int64_t j = n0; j < n; ++j) dot_block<T, MR, 1>(x, w, bias, y, k, j, n);
      }
    }
  });
}

// ---- "kn": y[r, :] = sum_k x[r, k] * W[k, :] ----
//
// The threads split K, not N: each reads whole rows of its own contiguous band of the weight (a split of
// N would give each thread a strip of every row, 128 bytes wide at 16 threads on a 1024-wide weight), and
// sums them into a partial y of its own; the partials are added at the end (T x N fp32, small next to
// the weight's K x N).

constexpr int64_t kColumnBlock = 4096;  // partial sums per pass over a band: MR x 4096 fp32 (16 KiB a row)
constexpr int kPassRows = 8;   // rows of x per pass over the weight (one pass for a batch of up to 8)

template <typename T, int MR>
void kn_band(const T* x, const T* w, float* part, int64_t k, int64_t n, int64_t k0, int64_t k1) {
  float xs[MR][4];
  for (int64_t c = 0; c < n; c += kColumnBlock) {
    const int64_t width = std::min(kColumnBlock, n - c);
    for (int r = 0; r < MR; ++r) std::fill(part + r * n + c, part + r * n + c + width, 0.f);
    for (int64_t i = k0; i < k1; i += 4) {
      const int rows = static_cast<int>(std::min<int64_t>(4, k1 - i));
      for (int r = 0; r < MR; ++r)
        for (int q = 0; q < 4; ++q) xs[r][q] = q < rows ? to_float(x[r * k + i + q]) : 0.f;
      const T* w0 = w + i * n + c;
      const T* w1 = rows > 1 ? w0 + n : w0;   // past the band: a real row scaled by 0
      const T* w2 = rows > 2 ? w0 + 2 * n : w0;
      const T* w3 = rows > 3 ? w0 + 3 * n : w0;
      const bool more = i + 4 + kAheadRows <= k1;
      int64_t v = 0;
      for (; v + kLanes <= width; v += kLanes) {
        if (more && (v * sizeof(T)) % 64 == 0) {
          ahead(w0 + kAheadRows * n + v);
          ahead(w1 + kAheadRows * n + v);
          ahead(w2 + kAheadRows * n + v);
          ahead(w3 + kAheadRows * n + v);
        }
        const vf a = vload(w0 + v), b = vload(w1 + v), cc = vload(w2 + v), d = vload(w3 + v);
        for (int r = 0; r < MR; ++r) {
          float* o = part + r * n + c + v;
          vf s = vload(o);
          s = vfma(vset(xs[r][0]), a, s);
          s = vfma(vset(xs[r][1]), b, s);
          s = vfma(vset(xs[r][2]), cc, s);
          s = vfma(vset(xs[r][3]), d, s);
          vstore(o, s);
        }
      }
      for (; v < width; ++v) {
        const float a = to_float(w0[v]), b = to_float(w1[v]), cc = to_float(w2[v]), d = to_float(w3[v]);
        for (int r = 0; r < MR; ++r)
          part[r * n + c + v] += xs[r][0] * a + xs[r][1] * b + xs[r][2] * cc + xs[r][3] * d;
      }
    }
  }
}

// 7 or 8 rows of x: column strips of kStripVectors vectors, each strip's MR x strip sums in registers over
// a block of kStripBlock weight rows, the strips of a block in turn (each thread over its own strips), the
// sums kept in memory between blocks. The band loop above loads and stores its partial sums once per four
// weight rows, which at 8 rows of x costs more than the weight's own stream; here once per 16. x is read
// as fp32 from a (K, MR) copy, one cache line per weight row. A strip steps down a block row by row, so
// each load of the next block is fetched ahead, a whole block (a pass over every strip) before its use.
// Measured (bf16, one thread, weights streamed, 8 rows, GPT-2 shapes K x N): 1024 x 1536 50 -> 67
// GFLOP/s, 1024 x 2048 46 -> 61, 1024 x 4096 48 -> 62, 512 x 1024 50 -> 52, 2048 x 1024 and 4096 x 1024
// unchanged (54-63); at 5 and 6 rows it was slower on two of these shapes, so fewer rows keep the bands.
constexpr int kStripRows = 7;
#if defined(__AVX512F__)
template <int MR>
constexpr int kStripVectors = 2;   // MR x 2 accumulators of 32 registers
#else
template <int MR>
constexpr int kStripVectors = 1;   // MR accumulators of 16 registers
#endif
constexpr int64_t kStripBlock = 16;   // weight rows per pass over the strips

template <typename T, int MR>
void kn_strips(const T* x, const T* w, const T* bias, T* y, int64_t k, int64_t n) {
  constexpr int SV = kStripVectors<MR>;
  constexpr int64_t width = SV * kLanes;
  std::vector<float> xt(static_cast<size_t>(k * MR));   // x as fp32, (K, MR)
  for (int r = 0; r < MR; ++r)
    for (int64_t i = 0; i < k; ++i) xt[i * MR + r] = to_float(x[r * k + i]);
  const int64_t strips = n / width;
  std::vector<float> part(static_cast<size_t>(MR * n), 0.f);   // (MR, N) sums so far
  parallel(strips, 4, [&](int64_t s0, int64_t s1) {
    for (int64_t i0 = 0; i0 < k; i0 += kStripBlock) {
      const int64_t i1 = std::min(k, i0 + kStripBlock);
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t c = s * width;
        vf acc[MR][SV];
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < SV; ++j) acc[r][j] = vload(part.data() + r * n + c + j * kLanes);
        // this strip's lines of the next block, a block (a pass over every strip) ahead of their use
        for (int64_t i = i1; i < std::min(k, i1 + kStripBlock); ++i)
          ahead(w + i * n + c, width * static_cast<int64_t>(sizeof(T)));
        for (int64_t i = i0; i < i1; ++i) {
          vf wv[SV];
          for (int j = 0; j < SV; ++j) wv[j] = vload(w + i * n + c + j * kLanes);
          const float* xi = xt.data() + i * MR;
          for (int r = 0; r < MR; ++r) {
            const vf xv = vset(xi[r]);
            for (int j = 0; j < SV; ++j) acc[r][j] = vfma(xv, wv[j], acc[r][j]);
          }
        }
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < SV; ++j) vstore(part.data() + r * n + c + j * kLanes, acc[r][j]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int64_t c = s0 * width; c < s1 * width; ++c) put(y, r * n + c, part[r * n + c], bias, c);
  });
  for (int64_t c = strips * width; c < n; ++c)   // the columns past the last whole strip
    for (int r = 0; r < MR; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < k; ++i) sum += xt[i * MR + r] * to_float(w[i * n + c]);
      put(y, r * n + c, sum, bias, c);
    }
}

// One row of x over a (K, N) bf16 weight on an AVX2 CPU (no AVX-512): each weight row in turn, added
// into the band's partial y (which stays in cache), fetched kRowAheadBytes ahead along the stream, where
// kn_band reads four rows side by side. Measured with the kernels built for AVX2 (-march=znver3) on a
// 2-core Zen 4, two threads at once (as two sockets) each streaming its own weights, the two alternated
// in a test program (GB/s in all), gpt2-medium's shards at 2 sockets: 1024 x 1536 31.8 against 24.8,
// 512 x 1024 31.8 against 21.4, 1024 x 2048 33.4 against 27.7, 2048 x 1024 34.2 against 22.1 (one thread
// 18.8 against 12.8 and 19.1 against 11.3). fp32, and bf16 built with AVX-512, ran as fast or faster four
// rows at a time (fp32 AVX2 1024 x 2048 31.9 four rows, 24.8 in turn): they keep kn_band.
template <typename T>
constexpr bool kKnRowsInTurn =
#if defined(__AVX2__) && !defined(__AVX512F__)
    std::is_same_v<T, bf16>;
#else
    false;
#endif

template <typename T>
void kn_band_in_turn(const T* x, const T* w, float* part, int64_t n, int64_t k0, int64_t k1) {
  std::fill(part, part + n, 0.f);
  for (int64_t i = k0; i < k1; ++i) {
    const float xi = to_float(x[i]);
    const vf xv = vset(xi);
    const T* row = w + i * n;
    int64_t v = 0;
    for (; v + kLanes <= n; v += kLanes) {
      if ((v * sizeof(T)) % 64 == 0) ahead(reinterpret_cast<const char*>(row + v) + kRowAheadBytes);
      vstore(part + v, vfma(xv, vload(row + v), vload(part + v)));
    }
    for (; v < n; ++v) part[v] += xi * to_float(row[v]);
  }
}

template <typename T, int MR>
void kn_rows(const T* x, const T* w, const T* bias, T* y, int64_t k, int64_t n) {
  // bands of whole groups of 4 rows, at most one per thread
  const int64_t groups = (k + 3) / 4;
  const int64_t bands = std::max<int64_t>(1, std::min<int64_t>(team_size(), groups));
  std::vector<float> part(static_cast<size_t>(bands * MR * n));
  parallel(bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = std::min(k, 4 * (groups * b / bands)), i1 = std::min(k, 4 * (groups * (b + 1) / bands));
      if constexpr (MR == 1 && kKnRowsInTurn<T>) kn_band_in_turn(x, w, part.data() + b * n, n, i0, i1);
      else kn_band<T, MR>(x, w, part.data() + b * MR * n, k, n, i0, i1);
    }
  });
  parallel(n, 256, [&](int64_t c0, int64_t c1) {
    for (int r = 0; r < MR; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        float sum = 0.f;
        for (int64_t b = 0; b < bands; ++b) sum += part[(b * MR + r) * n + c];
        put(y, r * n + c, sum, bias, c);
      }
  });
}

template <typename T, int MR>
void pass(const T* x, const T* w, const T* bias, T* y, int64_t k, int64_t n, bool kn) {
  if (!kn) {
    nk_rows<T, MR>(x, w, bias, y, k, n);
  } else if constexpr (MR >= kStripRows) {
    kn_strips<T, MR>(x, w, bias, y, k, n);
  } else {
    kn_rows<T, MR>(x, w, bias, y, k, n);
  }
}

template <typename T>
void rows(const T* x, const T* w, const T* bias, T* y, int64_t m, int64_t k, int64_t n, bool kn) {
  for (int64_t r = 0; r < m; r += kPassRows) {
    const int64_t mr = std::min<int64_t>(kPassRows, m - r);
    const T* xr = x + r * k;
    T* o = y + r * n;
    switch (mr) {
      case 1: pass<T, 1>(xr, w, bias, o, k, n, kn); break;
      case 2: pass<T, 2>(xr, w, bias, o, k, n, kn); break;
      case 3: pass<T, 3>(xr, w, bias, o, k, n, kn); break;
      case 4: pass<T, 4>(xr, w, bias, o, k, n, kn); break;
      case 5: pass<T, 5>(xr, w, bias, o, k, n, kn); break;
      case 6: pass<T, 6>(xr, w, bias, o, k, n, kn); break;
      case 7: pass<T, 7>(xr, w, bias, o, k, n, kn); break;
      default: pass<T, 8>(xr, w, bias, o, k, n, kn); break;
    }
  }
}

}  // namespace gemv_kernels

// y (M, N) = x (M, K) @ W (+ bias), all contiguous: W is (N, K) (kn = 0) or (K, N) (kn = 1); bias may be null
extern "C" {

void numatp_gemv_rows_f32(const float* x, const float* w, const float* bias, float* y, std::int64_t m,
                          std::int64_t k, std::int64_t n, int kn) {
  gemv_kernels::rows(x, w, bias, y, m, k, n, kn != 0);
}

void numatp_gemv_rows_bf16(const std::uint16_t* x, const std::uint16_t* w, const std::uint16_t* bias,
                           std::uint16_t* y, std::int64_t m, std::int64_t k, std::int64_t n, int kn) {
  using numatp_vec::bf16;
  gemv_kernels::rows(reinterpret_cast<const bf16*>(x), reinterpret_cast<const bf16*>(w),
                     reinterpret_cast<const bf16*>(bias), reinterpret_cast<bf16*>(y), m, k, n, kn != 0);
}

}  // extern "C"
