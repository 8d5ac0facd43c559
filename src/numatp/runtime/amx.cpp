// numatp's AMX kernel (Intel AMX-BF16, Sapphire Rapids and later Xeons): y (M, N) = x (M, K) @ W^T (+ b),
// bf16 in and out, fp32 sums rounded once, on a weight packed once into the tiles' layout.
//
//   numatp_amx_usable  1 where this build has the kernel and Linux lets this process use the tiles, else 0
//   numatp_amx_pack    W (N, K), any strides (a GPT-2 Conv1D's (K, N) weight read transposed), into the layout
//   numatp_amx_linear  the product, over the calling thread's OpenMP team
//   numatp_dot_usable, numatp_dot_linear  the same product on the same packed weight with AVX512-BF16 dot
//                      products, for CPUs without AMX (the dpbf16 provider; see dot_group below)
//
// Why: a decode step is bound by the weight bytes it streams, and it streams them once for all its rows.
// gemv.cpp's AVX512-BF16 dot products keep up with memory for one row, not for eight: one thread, bf16
// weights streamed from memory (1 GB in turn), gpt2-medium's shards at 2 sockets, GB/s of weight read:
// gemv 12.2-13.5 at 1 row, 7.7-9.3 at 8, 4.4-4.7 at 16; this kernel 13.4-14.2 at 1 row, 12.7-14.0 at 8,
// 12.3-13.6 at 16. One TDPBF16PS multiplies up to 16 rows by a 1 KiB tile of the weight; the tiles' unit
// does the arithmetic, so the core only moves bytes. The tiles must be packed: read from the weight as
// stored (16 channel rows of an (N, K) weight, or pairs of rows of a (K, N) one interleaved on the way),
// the same kernel streamed 5-8 GB/s (64 streams at once, or strided rows no prefetcher follows).
//
// Layout: N in blocks of 16 output channels, blocks in groups of up to 4 (64 channels), K padded with zeros
// to a multiple of 32. A group is one contiguous stretch: for each chunk of 32 along K, one tile per block
// of the group, 16 rows (k pairs) of 64 bytes (TDPBF16PS's B operand: row r holds w[n0 + j, k0 + 2r + e]
// at element 2j + e). Groups go to the team's threads; each reads its groups front to back.
//
// Up to 16 rows (a decode step), x is one tile and each chunk's tiles of a group meet it in turn, four sums
// in tiles. More rows (a prompt): x padded with zero rows to tiles of 16, taken two at a time against two
// blocks at a time (four sums: each tile loaded serves two products), K in slabs of 4 chunks so that a
// slab's tiles of x serve both pairs of blocks from L1 (the sums wait in memory between slabs); the group's
// tiles come from cache after the first pair of row tiles (a group is 64 channels x K x 2 bytes).
//
// No torch headers: plain pointers in and out (ops.cpp checks the tensors and keeps the packed buffer).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "vec.h"

namespace amx_kernels {

using u16 = std::uint16_t;

constexpr std::int64_t kBlock = 16;    // output channels per tile
constexpr std::int64_t kChunk = 32;    // k values per tile
constexpr std::int64_t kGroup = 4;     // blocks per group
constexpr std::int64_t kTile = kBlock * kChunk;   // bf16 values per weight tile (1 KiB)
constexpr std::int64_t kRows = 16;     // rows of x per tile
constexpr std::int64_t kDotAheadBytes = 4096;   // dpbf16 fetches the weight this far ahead of its loads

inline std::int64_t padded_k(std::int64_t k) { return (k + kChunk - 1) / kChunk * kChunk; }
inline std::int64_t blocks(std::int64_t n) { return (n + kBlock - 1) / kBlock; }

// W (N, K) with strides (sn, sk) in elements into out (blocks(N) * 16 * padded_k(K) values)
void pack(const u16* w, std::int64_t n, std::int64_t k, std::int64_t sn, std::int64_t sk, u16* out) {
  const std::int64_t kp = padded_k(k), nb = blocks(n);
  numatp_vec::parallel((nb + kGroup - 1) / kGroup, 1, [&](std::int64_t g0, std::int64_t g1) {
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t b0 = g * kGroup, in_group = std::min(kGroup, nb - b0);
      u16* base = out + b0 * kBlock * kp;
      for (std::int64_t c = 0; c < kp / kChunk; ++c)
        for (std::int64_t b = 0; b < in_group; ++b) {
          u16* tile = base + (c * in_group + b) * kTile;
          for (std::int64_t r = 0; r < kChunk / 2; ++r)
            for (std::int64_t j = 0; j < kBlock; ++j)
              for (std::int64_t e = 0; e < 2; ++e) {
                const std::int64_t ch = (b0 + b) * kBlock + j, at = c * kChunk + 2 * r + e;
                tile[r * 2 * kBlock + 2 * j + e] = ch < n && at < k ? w[ch * sn + at * sk] : u16(0);
              }
        }
    }
  });
}

// f(std::integral_constant<int, NB>) for a group of in_group blocks (1-4): the kernels take NB as a constant
template <typename F>
void by_blocks(std::int64_t in_group, F&& f) {
  switch (in_group) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

constexpr bool kDotBuilt = true;

// rows [r0, r0 + rows) x block b's channels of the sums (rows 16 floats apart) into y, bias added, rounded
// once (to nearest, ties to even, as float_to_bf16)
inline void put(const float* sums, std::int64_t r0, std::int64_t rows, std::int64_t b, std::int64_t n,
                const u16* bias, u16* y) {
  const std::int64_t n0 = b * kBlock, cols = std::min(kBlock, n - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0)), 16))
                          : _mm512_setzero_ps();
  for (std::int64_t r = 0; r < rows; ++r) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums + r * 16), add));
    _mm256_mask_storeu_epi16(y + (r0 + r) * n + n0, keep, reinterpret_cast<const __m256i&>(v));
  }
}

// dpbf16: rows of x by a group's NB blocks with AVX512-BF16 dot products (no tiles). A tile row of the
// layout (16 channels x a pair of k) is the operand VDPBF16PS takes against one pair of x broadcast, so MR
// rows x NB blocks of sums stay in registers while the group goes by. A decode step's rows (kWide false,
// 8 x 4: all 32 registers hold sums) take each weight row once per block, the group streamed from memory
// (fetched ahead by software only for 5-8 rows: see below); a prompt's (kWide true, 6 x 4: 24 sums, 4
// weight rows, the broadcast) load a k pair's rows of all NB blocks at once and use each broadcast pair of
// x for all of them (the group from cache).
// Sums into c as decode_group leaves them (block b's row r at c + b * 256 + r * 16).
inline __m512bh x_pair(const u16* x, std::int64_t at) {
  std::uint32_t pair;
  std::memcpy(&pair, x + at, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

template <int MR, int NB, bool kWide>
void dot_group(const u16* wg, const u16* x, std::int64_t kp, float* c, bool once) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
  for (std::int64_t ch = 0; ch < kp / kChunk; ++ch) {
    const u16* t = wg + ch * NB * kTile;
    if constexpr (!kWide) {
      // up to 4 rows: the chunk's tiles one after another, each in address order (the empty asm keeps the
      // compiler from interleaving the four tiles' loads, 1 KiB apart), and no software prefetch: the
      // hardware's own keeps up with one stream read in order. Zen 4, gpt2-medium's shard shapes in turn
      // on two threads at once (a test program), one row: 29.6 GB/s in all against 22.9 interleaved and
      // prefetched as before, 26.9 in order and prefetched; one thread 23.6 against 15.6. Whole decode
      // steps, 2 virtual sockets, the variants alternated in one process: one row, gpt2-medium 27.0 ms
      // against 28.8 (8 rounds), 26.0 against 26.8 (12) and 25.3 against 25.5 (6), qwen2.5-0.5b 36.6
      // against 38.1 (6), in order but prefetched no faster than before; 2 rows (gpt2-medium) 26.3 against
      // 28.4, 4 rows 30.4 against 31.2 (6 each). With 5-8 rows it measured no faster (8 rows: 44.4
      // against 43.6 ms a step): there the dot products, not the stream, set the pace, so those passes
      // keep the prefetch and the compiler's order.
      constexpr bool kInOrder = MR <= 4;
      if constexpr (!kInOrder) {
        const char* next = reinterpret_cast<const char*>(t) + kDotAheadBytes;
        for (std::int64_t i = 0; i < NB * kTile * 2; i += 64) {
          if (once) numatp_vec::ahead_once(next + i);
          else numatp_vec::ahead(next + i);
        }
      }
      for (int b = 0; b < NB; ++b) {
        for (int r = 0; r < kChunk / 2; ++r) {
          const __m512bh w = (__m512bh)_mm512_loadu_si512(t + b * kTile + r * 2 * kBlock);
          for (int i = 0; i < MR; ++i)
            acc[i][b] = _mm512_dpbf16_ps(acc[i][b], x_pair(x, i * kp + ch * kChunk + 2 * r), w);
        }
        if constexpr (kInOrder) asm volatile("" ::: "memory");
      }
    } else {
      for (int r = 0; r < kChunk / 2; ++r) {
        __m512bh w[NB];
        for (int b = 0; b < NB; ++b) w[b] = (__m512bh)_mm512_loadu_si512(t + b * kTile + r * 2 * kBlock);
        for (int i = 0; i < MR; ++i) {
          const __m512bh pair = x_pair(x, i * kp + ch * kChunk + 2 * r);
          for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], pair, w[b]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int b = 0; b < NB; ++b) _mm512_store_ps(c + b * 256 + i * 16, acc[i][b]);
}

void dot_linear(const u16* packed, std::int64_t n, std::int64_t k, const u16* x, std::int64_t m, const u16* bias,
                u16* y) {
  const std::int64_t kp = padded_k(k), nb = blocks(n), groups = (nb + kGroup - 1) / kGroup;
  std::vector<u16> xp(static_cast<std::size_t>(m * kp), u16(0));   // x, zero past K
  // rows in one pass (8 or fewer): each weight line is read once, so fetched non-temporal (vec.h's
  // ahead_once) where a pass fetches ahead at all (5-8 rows, see dot_group); more rows read the group again
  // from L2. Decode steps on 2 virtual sockets of a 2-core Zen 5 (bf16 weights, 64 new tokens; the two hints
  // alternated within one process by a switch built for the test, median ms per step): qwen2.5-0.5b 18.9
  // kept, 15.9 non-temporal (12 runs each); gpt2-medium 14.8 and 13.3 (10 each). The same switch in
  // quant.cpp's int4 kernel: 7.9 and 8.05 ms, so it keeps ahead().
  const bool once = m <= 8;
  for (std::int64_t r = 0; r < m; ++r) std::memcpy(xp.data() + r * kp, x + r * k, static_cast<std::size_t>(k) * 2);
  numatp_vec::parallel(groups, 1, [&](std::int64_t g0, std::int64_t g1) {
    alignas(64) float c[kGroup * 256];
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t b0 = g * kGroup, in_group = std::min(kGroup, nb - b0);
      const u16* wg = packed + b0 * kBlock * kp;
      // a decode step's rows 8 at a time (then 4, 2, 1), a prompt's (more than kRows) 6 at a time; past the
      // first pass the group comes from L2 (64 channels x K x 2 bytes)
      for (std::int64_t r0 = 0, mr = 0; r0 < m; r0 += mr) {
        const std::int64_t left = m - r0;
        const bool wide = m > kRows && left >= 6;
        mr = wide ? 6 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const u16* xr = xp.data() + r0 * kp;
        by_blocks(in_group, [&](auto nb) {
          constexpr int NB = decltype(nb)::value;
          if (wide) dot_group<6, NB, true>(wg, xr, kp, c, false);
          else if (mr == 8) dot_group<8, NB, false>(wg, xr, kp, c, once);
          else if (mr == 4) dot_group<4, NB, false>(wg, xr, kp, c, once);
          else if (mr == 2) dot_group<2, NB, false>(wg, xr, kp, c, once);
          else dot_group<1, NB, false>(wg, xr, kp, c, once);
        });
        for (std::int64_t b = 0; b < in_group; ++b) put(c + b * 256, r0, mr, b0 + b, n, bias, y);
      }
    }
  });
}

#else

constexpr bool kDotBuilt = false;
void dot_linear(const u16*, std::int64_t, std::int64_t, const u16*, std::int64_t, const u16*, u16*) {}

#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

constexpr bool kBuilt = true;

// Linux hands a process the tiles' 8 KiB of register state only when asked (arch_prctl), once per process
bool permitted() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

// Every tile 64 bytes wide; x's tiles and the sums have mr rows, the weight's 16. A decode step (mr <= 16
// rows) uses 0 for x, 1-3 for the weight, 4-7 for four blocks' sums; a prompt 0-1 for two row tiles of x,
// 2-3 for two blocks, 4-7 for their four sums.
void configure(int mr, bool prompt) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    const bool weight = prompt ? (t == 2 || t == 3) : (t >= 1 && t <= 3);
    cfg.rows[t] = static_cast<std::uint8_t>(weight ? 16 : mr);
    cfg.colsb[t] = 64;
  }
  // GCC 12 does not count LDTILECFG as a reader of the configuration and dropped these stores (the
  // instruction then faulted on the garbage left in rows and colsb): a compiler barrier keeps them
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

constexpr std::int64_t kAheadBytes = 4096;   // a decode step fetches the weight this far ahead of its loads
constexpr std::int64_t kSlab = 4;   // a prompt's chunks of K per pass (4: 2-10% faster than 8, 16 or all of K)

// decode: x (one tile of mr rows, kp wide) by the NB blocks of a group; sums into c (NB x (mr, 16) fp32)
template <int NB>
void decode_group(const u16* wg, const u16* x, std::int64_t kp, float* c) {
  _tile_zero(4);
  if constexpr (NB > 1) _tile_zero(5);
  if constexpr (NB > 2) _tile_zero(6);
  if constexpr (NB > 3) _tile_zero(7);
  for (std::int64_t i = 0; i < kp / kChunk; ++i) {
    const u16* t = wg + i * NB * kTile;
    numatp_vec::ahead(reinterpret_cast<const char*>(t) + kAheadBytes, NB * kTile * 2);
    _tile_loadd(0, x + i * kChunk, kp * 2);
    _tile_loadd(1, t, 64);
    _tile_dpbf16ps(4, 0, 1);
    if constexpr (NB > 1) {
      _tile_loadd(2, t + kTile, 64);
      _tile_dpbf16ps(5, 0, 2);
    }
    if constexpr (NB > 2) {
      _tile_loadd(3, t + 2 * kTile, 64);
      _tile_dpbf16ps(6, 0, 3);
    }
    if constexpr (NB > 3) {
      _tile_loadd(1, t + 3 * kTile, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
  }
  _tile_stored(4, c, 64);
  if constexpr (NB > 1) _tile_stored(5, c + 256, 64);
  if constexpr (NB > 2) _tile_stored(6, c + 512, 64);
  if constexpr (NB > 3) _tile_stored(7, c + 768, 64);
}

// prompt: RT row tiles of x (16 rows each, from x) by NB blocks (from block b of a group of `in_group`), over
// the chunks [c0, c1) of K: sums added to c (tile (rt, nb) at c + (rt * 2 + nb) * 256), or started there at 0
template <int RT, int NB>
void prompt_tiles(const u16* wg, std::int64_t in_group, std::int64_t b, const u16* x, std::int64_t kp,
                  std::int64_t c0, std::int64_t c1, bool start, float* c) {
  if (start) {
    _tile_zero(4);
    if constexpr (NB > 1) _tile_zero(5);
    if constexpr (RT > 1) _tile_zero(6);
    if constexpr (RT > 1 && NB > 1) _tile_zero(7);
  } else {
    _tile_loadd(4, c, 64);
    if constexpr (NB > 1) _tile_loadd(5, c + 256, 64);
    if constexpr (RT > 1) _tile_loadd(6, c + 512, 64);
    if constexpr (RT > 1 && NB > 1) _tile_loadd(7, c + 768, 64);
  }
  for (std::int64_t i = c0; i < c1; ++i) {
    const u16* t = wg + (i * in_group + b) * kTile;
    _tile_loadd(0, x + i * kChunk, kp * 2);
    if constexpr (RT > 1) _tile_loadd(1, x + kRows * kp + i * kChunk, kp * 2);
    _tile_loadd(2, t, 64);
    if constexpr (NB > 1) _tile_loadd(3, t + kTile, 64);
    _tile_dpbf16ps(4, 0, 2);
    if constexpr (NB > 1) _tile_dpbf16ps(5, 0, 3);
    if constexpr (RT > 1) _tile_dpbf16ps(6, 1, 2);
    if constexpr (RT > 1 && NB > 1) _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, c, 64);
  if constexpr (NB > 1) _tile_stored(5, c + 256, 64);
  if constexpr (RT > 1) _tile_stored(6, c + 512, 64);
  if constexpr (RT > 1 && NB > 1) _tile_stored(7, c + 768, 64);
}

void linear(const u16* packed, std::int64_t n, std::int64_t k, const u16* x, std::int64_t m, const u16* bias,
            u16* y) {
  const std::int64_t kp = padded_k(k), nb = blocks(n), groups = (nb + kGroup - 1) / kGroup;
  const bool prompt = m > kRows;
  const int mr = static_cast<int>(std::min(m, kRows));
  const std::int64_t tiles = (m + mr - 1) / mr;
  std::vector<u16> xp(static_cast<std::size_t>(tiles * mr * kp), u16(0));   // x, zero past K and past M
  for (std::int64_t r = 0; r < m; ++r) std::memcpy(xp.data() + r * kp, x + r * k, static_cast<std::size_t>(k) * 2);
  numatp_vec::parallel(groups, 1, [&](std::int64_t g0, std::int64_t g1) {
    configure(mr, prompt);
    alignas(64) float c[2 * kGroup * 256];   // decode: 4 blocks' sums; prompt: 2 row tiles x 4 blocks
    for (std::int64_t g = g0; g < g1; ++g) {
      const std::int64_t b0 = g * kGroup, in_group = std::min(kGroup, nb - b0);
      const u16* wg = packed + b0 * kBlock * kp;
      if (!prompt) {
        by_blocks(in_group, [&](auto nb) { decode_group<decltype(nb)::value>(wg, xp.data(), kp, c); });
        for (std::int64_t b = 0; b < in_group; ++b) put(c + b * 256, 0, m, b0 + b, n, bias, y);
        continue;
      }
      // K in slabs of kSlab chunks: a slab's tiles of x (two row tiles) and of the group's 4 blocks stay in
      // L1 while both block pairs use them; the sums wait in c between slabs
      for (std::int64_t rt = 0; rt < tiles; rt += 2) {
        const bool two_rows = rt + 1 < tiles;
        const u16* xr = xp.data() + rt * kRows * kp;
        for (std::int64_t c0 = 0; c0 < kp / kChunk; c0 += kSlab) {
          const std::int64_t c1 = std::min(c0 + kSlab, kp / kChunk);
          for (std::int64_t b = 0; b < in_group; b += 2) {
            const bool two_blocks = b + 1 < in_group;
            float* cb = c + b * 512;
            if (two_rows && two_blocks) prompt_tiles<2, 2>(wg, in_group, b, xr, kp, c0, c1, c0 == 0, cb);
            else if (two_rows) prompt_tiles<2, 1>(wg, in_group, b, xr, kp, c0, c1, c0 == 0, cb);
            else if (two_blocks) prompt_tiles<1, 2>(wg, in_group, b, xr, kp, c0, c1, c0 == 0, cb);
            else prompt_tiles<1, 1>(wg, in_group, b, xr, kp, c0, c1, c0 == 0, cb);
          }
        }
        for (std::int64_t b = 0; b < in_group; b += 2)
          for (std::int64_t i = 0; i < (two_rows ? 2 : 1); ++i)
            for (std::int64_t j = 0; j < std::min<std::int64_t>(2, in_group - b); ++j) {
              const std::int64_t r0 = (rt + i) * kRows;
              put(c + b * 512 + (i * 2 + j) * 256, r0, std::min(kRows, m - r0), b0 + b + j, n, bias, y);
            }
      }
    }
    _tile_release();
  });
}

#else

constexpr bool kBuilt = false;
bool permitted() { return false; }
void linear(const u16*, std::int64_t, std::int64_t, const u16*, std::int64_t, const u16*, u16*) {}

#endif

}  // namespace amx_kernels

extern "C" {

// 1 where this build has the kernel (a compiler and CPU with AMX-BF16) and Linux lets the process use the
// tiles, else 0
int numatp_amx_usable() { return amx_kernels::kBuilt && amx_kernels::permitted() ? 1 : 0; }

// 1 where this build has the dpbf16 kernel (AVX512-BF16: the library is built for the CPU it runs on)
int numatp_dot_usable() { return amx_kernels::kDotBuilt ? 1 : 0; }

// y (M, N) = x (M, K) @ W^T (+ bias) on W packed by numatp_amx_pack, with AVX512-BF16 dot products (no
// tiles), any M; as numatp_amx_linear otherwise. Call only where numatp_dot_usable() is 1.
void numatp_dot_linear(const std::uint16_t* packed, std::int64_t n, std::int64_t k, const std::uint16_t* x,
                       std::int64_t m, const std::uint16_t* bias, std::uint16_t* y) {
  amx_kernels::dot_linear(packed, n, k, x, m, bias, y);
}

// bf16 values of W (N, K) packed
std::int64_t numatp_amx_packed_size(std::int64_t n, std::int64_t k) {
  return amx_kernels::blocks(n) * amx_kernels::kBlock * amx_kernels::padded_k(k);
}

// W (N, K), element (i, j) at w[i * sn + j * sk], into out (numatp_amx_packed_size values)
void numatp_amx_pack(const std::uint16_t* w, std::int64_t n, std::int64_t k, std::int64_t sn, std::int64_t sk,
                     std::uint16_t* out) {
  amx_kernels::pack(w, n, k, sn, sk, out);
}

// y (M, N) = x (M, K) @ W^T (+ bias) on W packed by numatp_amx_pack; x, bias (N) or null and y bf16 and
// contiguous, M >= 1. Call only where numatp_amx_usable() is 1.
void numatp_amx_linear(const std::uint16_t* packed, std::int64_t n, std::int64_t k, const std::uint16_t* x,
                       std::int64_t m, const std::uint16_t* bias, std::uint16_t* y) {
  amx_kernels::linear(packed, n, k, x, m, bias, y);
}
}
