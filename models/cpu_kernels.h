// What the CPU kernels' sources share (models/cpu_kernels.cc, models/cpu_attention.cc):
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

}  // namespace jaxsample_cpu
