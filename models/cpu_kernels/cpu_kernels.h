// What the CPU kernels' sources share (cpu_kernels.cc, cpu_w8a8.cc, cpu_attention.cc):
// the FFI header, horizontal sums and the work split over XLA's intra-op pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxsample_cpu {

namespace ffi = xla::ffi;

inline int32_t HorizontalSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Runs body(i) for i in [0, n) on the calling thread and the intra-op pool's. The
// caller claims tasks too and waits only for tasks already claimed by another thread
// (never for one still queued), so it cannot deadlock on a busy pool; a pool task
// that starts late finds nothing left and returns.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Body body) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  auto shared = std::make_shared<Shared>();
  auto work = [shared, n, body]() {
    for (;;) {
      const int64_t i = shared->next.fetch_add(1);
      if (i >= n) return;
      body(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work(); });
  work();
  while (shared->done.load(std::memory_order_acquire) < n) _mm_pause();
}

constexpr int64_t kRowsPerTask = 64;  // output columns n per unit of work of a product

// body(n0, n1) over [0, N) in chunks of kRowsPerTask output columns (weight rows).
template <typename Body>
void ParallelRows(ffi::ThreadPool& pool, int64_t N, Body body) {
  ParallelFor(pool, (N + kRowsPerTask - 1) / kRowsPerTask, [=](int64_t c) {
    body(c * kRowsPerTask, std::min(N, (c + 1) * kRowsPerTask));
  });
}

// out[m, n] = sum_k x[m, k] w[n, k] (int32, exact for x in [-127, 127]) for x int8
// [M, K], w int8 [N, K] and n in [n0, n1), on the instruction set in use
// (jaxsample_set_isa: AVX-512 VNNI or AVX2). cpu_kernels.cc.
void Int8RowsNow(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t N,
                 int64_t K, int64_t n0, int64_t n1);

}  // namespace jaxsample_cpu
