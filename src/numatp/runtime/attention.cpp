// numatp's single-query attention: a decode step's new query of each sequence against its cached keys and
// values, reading each cached position once.
//
//   out[b, h] = sum_s p[s] v[b, hk, s] / sum_s p[s],  p[s] = exp(score[s] - max score),
//   score[s] = scale * (q[b, h] . k[b, hk, s]) + mask[b, h, s],  hk = h / (H / Hk)
//
// in fp32 (bf16 widened as loaded; bf16 products are exact in fp32), the result rounded once to the
// inputs' dtype. The query heads of one group of grouped K/V heads share each load of a K or V row.
//
// A position whose mask value is at most kMasked for every query head of a group is not read at all: its
// score is at least 1e30 below any unmasked one, so its weight exp(score - max) is exactly 0 in fp32. A
// static cache (transformers' StaticCache) holds the positions a sequence has not reached yet masked with
// the dtype's lowest value, so a decode step reads the keys and values written so far, not the whole
// cache. Nor is a position outside a group's span (from its heads' first unmasked position to their last,
// found once per mask row): a cache of 1056 positions with 128-192 written (numatp serve's default, one
// stream, gpt2-medium bf16 on 2 virtual sockets of a 2-core Zen 5) took a decode step 1.4 ms longer than
// one of 192 positions when every position was visited and checked, and no longer (20.9 against 20.8 ms)
// with the span. Where a head has no unmasked position at all (an idle row of a batch), every position
// counts with its mask added, as CPU flash attention does (all -inf: zeros).
//
// Measured on a 2-core AVX-512 Xeon, one thread, bf16, 8 heads of 64, a cache of 224 positions, 24 layers'
// caches in turn (scratch timing, the three side by side): 8 sequences with every position written 6.6 ms,
// with 160 written 4.5 ms, against 7.3 and 6.6 ms for torch's CPU flash attention and 14.4 and 14.7 ms for
// the fused Inductor loops over the cache that numatp emitted before; one sequence 0.59 / 0.53 ms against
// 0.64 / 0.62 (flash) and 1.39 / 1.31 (Inductor).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace attention_kernels {

using namespace numatp_vec;

constexpr float kMasked = -1e30f;
constexpr int64_t kAheadRows = 8;   // K and V rows fetched ahead of the one read
constexpr int kChunk = 4;           // vectors of V's columns summed in registers at a time

// q . k over D: q as given (qt) and widened to fp32 (qf)
template <typename T>
inline float dot(const T* qt, const float* qf, const T* k, int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {   // pairs of bf16 products (exact) summed into fp32 lanes
    __m512 t = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= D; d += 32)
      t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(qt + d), (__m512bh)_mm512_loadu_si512(k + d));
    if (d < D) {
      const __mmask32 m = (__mmask32)((1ull << (D - d)) - 1);
      t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_maskz_loadu_epi16(m, qt + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, k + d));
    }
    return _mm512_reduce_add_ps(t);
  }
#endif
  (void)qt;
  vf t = vzero();
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) t = vfma(vload(qf + d), vload(k + d), t);
  if (d < D) t = vfma(vload(qf + d, static_cast<int>(D - d)), vload(k + d, static_cast<int>(D - d)), t);
  return vsum(t);
}

// strides are in elements; the last dimension (D of q, k, v; S of the mask) is contiguous
struct Shape {
  int64_t batch, heads, kv_heads, positions, dim;
  int64_t q_b, q_h, k_b, k_h, k_s, v_b, v_h, v_s, m_b, m_h;   // m_b, m_h: 0 where the mask broadcasts
  float scale;
};

// A head's positions to read: [lo, hi) around every unmasked one; every position where none is unmasked
struct Span {
  int64_t lo, hi;
  bool every;
};

template <typename T>
void group(const T* q, const T* k, const T* v, const T* mask, T* out, const Shape& a, int64_t b, int64_t hk,
           const Span* spans, std::vector<float>& buf) {
  const int64_t G = a.heads / a.kv_heads, D = a.dim;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  // the group's span: the union of its heads' (a cache's positions past the last one written are never read)
  int64_t lo = a.positions, hi = 0;
  for (int64_t g = 0; g < G; ++g) {
    lo = std::min(lo, spans[g].lo);
    hi = std::max(hi, spans[g].hi);
  }
  const int64_t S = std::max<int64_t>(hi - lo, 0);
  // the thread's scratch, reused from item to item (no allocation per item once it is large enough)
  buf.assign(static_cast<size_t>(G * D * 2 + G * S + 2 * G), 0.f);
  float* qf = buf.data();          // G x D: the queries, fp32
  float* acc = qf + G * D;         // G x D: sum_s p[s] v[s]
  float* sc = acc + G * D;         // G x S: scores, then weights, of positions lo to hi - 1
  float* peak = sc + G * S;        // G: the largest score
  float* total = peak + G;         // G: sum_s p[s]
  std::fill(peak, peak + G, kNone);
  auto qrow = [&](int64_t g) { return q + b * a.q_b + (hk * G + g) * a.q_h; };
  auto mrow = [&](int64_t g) { return mask + b * a.m_b + (hk * G + g) * a.m_h + lo; };
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(qrow(g)[d]);
  const T* kb = k + b * a.k_b + hk * a.k_h + lo * a.k_s;
  const T* vb = v + b * a.v_b + hk * a.v_h + lo * a.v_s;
  // scores: each K row loaded once for the group's query heads
  for (int64_t s = 0; s < S; ++s) {
    bool read = false;
    for (int64_t g = 0; g < G && !read; ++g) read = !mask || spans[g].every || to_float(mrow(g)[s]) > kMasked;
    if (!read) {
      for (int64_t g = 0; g < G; ++g) sc[g * S + s] = kNone;
      continue;
    }
    const T* kr = kb + s * a.k_s;
    ahead(kr + kAheadRows * a.k_s, D * static_cast<int64_t>(sizeof(T)));
    for (int64_t g = 0; g < G; ++g) {
      const float m = mask ? to_float(mrow(g)[s]) : 0.f;
      if (mask && !spans[g].every && m <= kMasked) {
        sc[g * S + s] = kNone;
        continue;
      }
      const float score = dot(qrow(g), qf + g * D, kr, D) * a.scale + m;
      sc[g * S + s] = score;
      peak[g] = std::max(peak[g], score);
    }
  }
  // weights exp(score - peak), and their sums
  for (int64_t g = 0; g < G; ++g) {
    float* row = sc + g * S;
    if (peak[g] == kNone) {   // every score -inf: no weight anywhere (flash attention returns zeros)
      std::fill(row, row + S, 0.f);
      continue;
    }
    const vf top = vset(peak[g]);
    vf sum = vzero();
    int64_t s = 0;
    for (; s + kLanes <= S; s += kLanes) {
      const vf e = vexp(vsub(vload(row + s), top));
      vstore(row + s, e);
      sum = vadd(sum, e);
    }
    float rest = 0.f;
    for (; s < S; ++s) {
      row[s] = row[s] == kNone ? 0.f : std::exp(row[s] - peak[g]);
      rest += row[s];
    }
    total[g] = vsum(sum) + rest;
  }
  // sum_s p[s] v[s]: per query head, kChunk columns at a time in registers, over the positions it weighs
  // (a group's later heads find the V rows in cache)
  for (int64_t g = 0; g < G; ++g) {
    const float* p = sc + g * S;
    int64_t d = 0;
    for (; d + kChunk * kLanes <= D; d += kChunk * kLanes) {
      vf t[kChunk];
      for (int j = 0; j < kChunk; ++j) t[j] = vzero();
      for (int64_t s = 0; s < S; ++s) {
        if (p[s] == 0.f) continue;
        const T* vr = vb + s * a.v_s + d;
        if (g == 0) ahead(vr + kAheadRows * a.v_s, kChunk * kLanes * static_cast<int64_t>(sizeof(T)));
        const vf w = vset(p[s]);
        for (int j = 0; j < kChunk; ++j) t[j] = vfma(w, vload(vr + j * kLanes), t[j]);
      }
      for (int j = 0; j < kChunk; ++j) vstore(acc + g * D + d + j * kLanes, t[j]);
    }
    for (int64_t s = 0; d < D && s < S; ++s) {   // columns past the last whole chunk
      if (p[s] == 0.f) continue;
      const T* vr = vb + s * a.v_s;
      for (int64_t c = d; c < D; ++c) acc[g * D + c] += p[s] * to_float(vr[c]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    T* o = out + ((b * a.heads) + hk * G + g) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

// Sequence b's heads' spans (heads of them): the positions from each one's first unmasked position to its
// last; every position, marked so, where none is unmasked, or without a mask. One scan per mask row: a mask
// broadcast over the heads (m_h 0) has one row per sequence.
template <typename T>
void spans_of(const T* mask, const Shape& a, int64_t b, Span* out) {
  if (!mask) {
    std::fill(out, out + a.heads, Span{0, a.positions, false});
    return;
  }
  const int64_t rows = a.m_h != 0 ? a.heads : 1;
  for (int64_t h = 0; h < rows; ++h) {
    const T* m = mask + b * a.m_b + h * a.m_h;
    int64_t lo = 0, hi = a.positions;
    while (lo < hi && to_float(m[lo]) <= kMasked) ++lo;
    while (hi > lo && to_float(m[hi - 1]) <= kMasked) --hi;
    out[h] = lo < hi ? Span{lo, hi, false} : Span{0, a.positions, true};
  }
  std::fill(out + rows, out + a.heads, out[0]);
}

template <typename T>
void attend(const T* q, const T* k, const T* v, const T* mask, T* out, const Shape& a) {
  std::vector<Span> spans(static_cast<size_t>(a.batch * a.heads));
  for (int64_t b = 0; b < a.batch; ++b) spans_of(mask, a, b, spans.data() + b * a.heads);
  const int64_t G = a.heads / a.kv_heads;
  parallel(a.batch * a.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / a.kv_heads, hk = i % a.kv_heads;
      group(q, k, v, mask, out, a, b, hk, spans.data() + b * a.heads + hk * G, buf);
    }
  });
}

}  // namespace attention_kernels

extern "C" {

// out (B, H, 1, D) contiguous; q (B, H, 1, D), k and v (B, Hk, S, D), mask (B or 1, H or 1, 1, S) or null,
// with the strides given (elements; the last dimension contiguous). dtype: fp32 (bf16 = 0) or bf16.
void numatp_decode_attention(const void* q, const void* k, const void* v, const void* mask, void* out, int is_bf16,
                             const std::int64_t* sizes, const std::int64_t* strides, float scale) {
  using attention_kernels::Shape;
  const Shape a{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4],
                strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6], strides[7],
                strides[8], strides[9], scale};
  if (is_bf16) {
    using numatp_vec::bf16;
    attention_kernels::attend(static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v),
                              static_cast<const bf16*>(mask), static_cast<bf16*>(out), a);
  } else {
    attention_kernels::attend(static_cast<const float*>(q), static_cast<const float*>(k),
                              static_cast<const float*>(v), static_cast<const float*>(mask),
                              static_cast<float*>(out), a);
  }
}

}  // extern "C"
