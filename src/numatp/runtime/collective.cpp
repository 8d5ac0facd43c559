// numatp's all-reduce between the sockets of one process (see numatp/runtime/collective.py).
//
// Every socket's worker thread calls numatp_all_reduce with its partial sum (src) and the tensor that
// receives the total (dst, allocated by that worker, so on its own node). The peers' partials are read
// in place: sockets share one address space, so nothing is copied into staging buffers.
//   small tensors: after one barrier every socket sums all N partials, in socket order, into its dst;
//   large tensors: reduce-scatter (socket r sums slice r of every partial into its own dst), a barrier,
//                  then all-gather (socket r copies the other slices from their owners' dst).
// A closing barrier keeps every partial and every dst alive until no peer reads it. Sums run in fp32
// (bf16 is widened, summed, rounded to nearest even once), so every socket holds the same bits.
// Barriers spin on atomics with a pause, then yield; they give up on abort (a peer failed) or timeout,
// and a timeout reports the sockets that never arrived. Loops run on the calling thread's OpenMP team:
// the socket's own threads, pinned to its CPUs.

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <sched.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NUMATP_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define NUMATP_PAUSE() asm volatile("yield")
#else
#define NUMATP_PAUSE() ((void)0)
#endif

namespace {

constexpr int kMaxRanks = 64;
constexpr int kSpinsBeforeYield = 1 << 14;

struct alignas(64) Slot {
  std::atomic<std::uint64_t> arrived{0};   // barriers this rank has reached
  const void* src = nullptr;
  void* dst = nullptr;
};

struct Comm {
  int size = 0;
  std::atomic<std::uint64_t> count{0};      // arrivals at the current barrier
  std::atomic<std::uint64_t> generation{0}; // barriers completed
  std::atomic<int> aborted{0};
  Slot slots[kMaxRanks];
};

double now_seconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// 0: every rank arrived; 1: aborted; 2: timed out (*missing: bit r set for each rank not arrived)
int barrier(Comm* c, int rank, double deadline, std::uint64_t* missing) {
  const std::uint64_t gen = c->generation.load(std::memory_order_acquire);
  c->slots[rank].arrived.store(gen + 1, std::memory_order_release);
  if (c->count.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint64_t>(c->size)) {
    c->count.store(0, std::memory_order_relaxed);
    c->generation.store(gen + 1, std::memory_order_release);
    return 0;
  }
  for (std::uint64_t spins = 1;; ++spins) {
    if (c->generation.load(std::memory_order_acquire) != gen) return 0;
    if (c->aborted.load(std::memory_order_relaxed)) return 1;
    if (spins < kSpinsBeforeYield) {
      NUMATP_PAUSE();
      continue;
    }
    sched_yield();
    if ((spins & 255) == 0 && now_seconds() > deadline) {
      std::uint64_t m = 0;
      for (int r = 0; r < c->size; ++r)
        if (c->slots[r].arrived.load(std::memory_order_acquire) < gen + 1) m |= std::uint64_t(1) << r;
      *missing = m;
      c->aborted.store(1, std::memory_order_relaxed);  // the others stop too, instead of timing out one by one
      return 2;
    }
  }
}

inline float bf16_to_float(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<std::uint16_t>(u >> 16);
}

constexpr std::int64_t kBlock = 2048;  // elements per OpenMP work item: inner loops vectorize over a block

// out[i] = sum over ranks of src_r[i], i in [lo, hi), ranks in order
void sum_f32(Comm* c, float* out, std::int64_t lo, std::int64_t hi) {
  const int n = c->size;
  const std::int64_t blocks = (hi - lo + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t a = lo + b * kBlock, len = (hi - a < kBlock) ? hi - a : kBlock;
    float* __restrict o = out + a;
    const float* __restrict s0 = static_cast<const float*>(c->slots[0].src) + a;
    const float* __restrict s1 = static_cast<const float*>(c->slots[1].src) + a;
    for (std::int64_t i = 0; i < len; ++i) o[i] = s0[i] + s1[i];
    for (int r = 2; r < n; ++r) {
      const float* __restrict sr = static_cast<const float*>(c->slots[r].src) + a;
      for (std::int64_t i = 0; i < len; ++i) o[i] += sr[i];
    }
  }
}

void sum_bf16(Comm* c, std::uint16_t* out, std::int64_t lo, std::int64_t hi) {
  const int n = c->size;
  const std::int64_t blocks = (hi - lo + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t a = lo + b * kBlock, len = (hi - a < kBlock) ? hi - a : kBlock;
    alignas(64) float acc[kBlock];
    const std::uint16_t* __restrict s0 = static_cast<const std::uint16_t*>(c->slots[0].src) + a;
    const std::uint16_t* __restrict s1 = static_cast<const std::uint16_t*>(c->slots[1].src) + a;
    for (std::int64_t i = 0; i < len; ++i) acc[i] = bf16_to_float(s0[i]) + bf16_to_float(s1[i]);
    for (int r = 2; r < n; ++r) {
      const std::uint16_t* __restrict sr = static_cast<const std::uint16_t*>(c->slots[r].src) + a;
      for (std::int64_t i = 0; i < len; ++i) acc[i] += bf16_to_float(sr[i]);
    }
    std::uint16_t* __restrict o = out + a;
    for (std::int64_t i = 0; i < len; ++i) o[i] = float_to_bf16(acc[i]);
  }
}

void copy_bytes(char* dst, const char* src, std::int64_t bytes) {
  constexpr std::int64_t kChunk = 1 << 16;
  const std::int64_t chunks = (bytes + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (std::int64_t k = 0; k < chunks; ++k) {
    const std::int64_t off = k * kChunk;
    std::memcpy(dst + off, src + off, (bytes - off < kChunk) ? bytes - off : kChunk);
  }
}

void reduce_range(Comm* c, int dtype, void* dst, std::int64_t lo, std::int64_t hi) {
  if (dtype == 0) sum_f32(c, static_cast<float*>(dst), lo, hi);
  else sum_bf16(c, static_cast<std::uint16_t*>(dst), lo, hi);
}

}  // namespace

extern "C" {

void* numatp_comm_new(int size) {
  if (size < 2 || size > kMaxRanks) return nullptr;
  Comm* c = new Comm();
  c->size = size;
  return c;
}

void numatp_comm_free(void* comm) { delete static_cast<Comm*>(comm); }

// Stop every barrier now and until numatp_comm_reset (a socket failed, or the caller was interrupted).
void numatp_comm_abort(void* comm) { static_cast<Comm*>(comm)->aborted.store(1, std::memory_order_relaxed); }

// Only while no rank is inside a call: a fresh start after an abort or a timeout.
void numatp_comm_reset(void* comm) {
  Comm* c = static_cast<Comm*>(comm);
  c->count.store(0);
  const std::uint64_t gen = c->generation.load();
  for (int r = 0; r < c->size; ++r) c->slots[r].arrived.store(gen);
  c->aborted.store(0);
}

// A barrier alone (0 ok, 1 aborted, 2 timed out with *missing set).
int numatp_barrier(void* comm, int rank, double timeout_s, std::uint64_t* missing) {
  return barrier(static_cast<Comm*>(comm), rank, now_seconds() + timeout_s, missing);
}

// dst = sum over ranks of their src; numel elements of dtype 0 (float32) or 1 (bfloat16), contiguous.
// fused_bytes: at or below this size every rank sums everything (one barrier fewer).
// *waited += the seconds this rank spent in the first barrier: waiting for the last peer to arrive.
// Returns as numatp_barrier; on 1 or 2, dst holds nothing usable.
int numatp_all_reduce(void* comm, int rank, const void* src, void* dst, std::int64_t numel, int dtype,
                      std::int64_t fused_bytes, double timeout_s, std::uint64_t* missing, double* waited) {
  Comm* c = static_cast<Comm*>(comm);
  const double start = now_seconds(), deadline = start + timeout_s;
  const std::int64_t elsize = dtype == 0 ? 4 : 2;
  c->slots[rank].src = src;
  c->slots[rank].dst = dst;
  int rc = barrier(c, rank, deadline, missing);  // every src and dst is published
  *waited += now_seconds() - start;
  if (rc) return rc;
  if (numel * elsize <= fused_bytes) {
    reduce_range(c, dtype, dst, 0, numel);
    return barrier(c, rank, deadline, missing);  // no peer reads my src any more
  }
  // slices of whole cache lines: socket r owns [bounds(r), bounds(r + 1))
  const std::int64_t unit = 64 / elsize;
  const std::int64_t units = (numel + unit - 1) / unit;
  auto bound = [&](int r) {
    const std::int64_t b = units / c->size * r + (r < units % c->size ? r : units % c->size);
    return b * unit < numel ? b * unit : numel;
  };
  reduce_range(c, dtype, dst, bound(rank), bound(rank + 1));
  rc = barrier(c, rank, deadline, missing);  // every slice is reduced
  if (rc) return rc;
  for (int k = 1; k < c->size; ++k) {
    const int s = (rank + k) % c->size;  // start at a different owner on each socket
    const std::int64_t lo = bound(s), hi = bound(s + 1);
    copy_bytes(static_cast<char*>(dst) + lo * elsize, static_cast<const char*>(c->slots[s].dst) + lo * elsize,
               (hi - lo) * elsize);
  }
  return barrier(c, rank, deadline, missing);  // no peer reads my src or my dst any more
}

// A CPU kept awake while this process waits for another's message (numatp/runtime/hosts.py): the thread
// that runs numatp_awake_run sleeps while *state is 0, yields in a loop while it is 1 (at SCHED_IDLE, set by
// its caller: it gives way to any other thread of its CPU), and returns once it is 2. numatp_awake_set
// stores a state and wakes the sleeper. The thread is named numatp-awake (top, perf).
void numatp_awake_run(std::int32_t* state) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "numatp-awake");
#endif
  std::atomic_ref<std::int32_t> s(*state);
  for (;;) {
    const std::int32_t v = s.load(std::memory_order_acquire);
    if (v == 2) return;
    if (v == 1) {
      sched_yield();
      continue;
    }
#if defined(__linux__)
    syscall(SYS_futex, state, FUTEX_WAIT_PRIVATE, 0, nullptr, nullptr, 0);  // returns at once unless still 0
#else
    timespec nap{0, 1000000};
    nanosleep(&nap, nullptr);
#endif
  }
}

void numatp_awake_set(std::int32_t* state, std::int32_t value) {
  std::atomic_ref<std::int32_t>(*state).store(value, std::memory_order_release);
#if defined(__linux__)
  if (value != 0) syscall(SYS_futex, state, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
#endif
}

}  // extern "C"
