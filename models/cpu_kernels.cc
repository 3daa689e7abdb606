// The int8 decode's CPU kernels for XLA, as typed FFI custom calls
// (models/cpu_kernels.py builds, loads and registers this file; models/quant.py and
// models/common.py call them).
//
//   jaxsample_int8_dot:   x int8 [M, K], w int8 [N, K] -> int32 [M, N], y = x w^T (exact)
//   jaxsample_f32_int8_dot: x f32 [M, K], w int8 [N, K] -> f32 [M, N], y = x float(w)^T
//   jaxsample_segment_attention: q [H, Q, D], k, v [H, M, D], mask [M] -> out [H, Q, D],
//       lse [H, Q]: the decode step's attention over the shared prefix (below)
//
// Why: XLA CPU (jaxlib 0.10.2) runs a small-M int8 x int8 dot through its int8 GEMM
// with a fixed cost of 0.1-0.3 ms per product on an AVX2 CPU, whatever the weight's
// size, and lowers a one-row one to a loop over an int32 copy of the weight; a
// float x int8 dot materialises a float32 copy of the weight first. These loops read
// each weight row once from memory for all M rows (benchmarks/RESULTS.md, "CPU
// kernels"). Requires AVX2; jaxsample_int8_cpu_supported() says whether this CPU has it.
//
// The int8 product is exact for x in [-127, 127] (W8A8's activations, clipped there)
// and any int8 w (int32 sums: with K < 2^17 none overflows), so it equals
// lax.dot_general bit for bit. The float one
// sums each output in an order fixed by K alone (8 lanes over k, then the lanes),
// so a row's result does not depend on M or on the other rows.
//
// The int8 inner loop is the AVX2 sign trick of llama.cpp's ggml (ggml-cpu quants),
// with the roles of x and w swapped:
// maddubs(|w|, sign(x, w)) multiplies unsigned by signed bytes into int16 pairs
// (at most 2 * 128 * 127 = 32512: no saturation).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerTask = 64;  // output rows n per unit of work
constexpr int64_t kBlock = 4;         // output rows n per inner loop

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

// out[m, n] = sum_k x[m, k] w[n, k] for n in [n0, n1).
void Int8Rows(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t N,
              int64_t K, int64_t n0, int64_t n1) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K32 = K / 32 * 32;
  int64_t n = n0;
  for (; n + kBlock <= n1; n += kBlock) {
    const int8_t* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xm = x + m * K;
      __m256i acc[kBlock];
      for (int j = 0; j < kBlock; ++j) acc[j] = _mm256_setzero_si256();
      for (int64_t k = 0; k < K32; k += 32) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + k));
        for (int j = 0; j < kBlock; ++j) {
          const __m256i wv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + j * K + k));
          // |w| as unsigned bytes (-128 -> 128) times x with w's sign: right for any w
          // while x stays in [-127, 127] (negating -128 would overflow).
          const __m256i p =
              _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
          acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, ones));
        }
      }
      for (int j = 0; j < kBlock; ++j) {
        int32_t s = HorizontalSum(acc[j]);
        for (int64_t k = K32; k < K; ++k) s += int32_t(xm[k]) * int32_t(wn[j * K + k]);
        out[m * N + n + j] = s;
      }
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k) s += int32_t(x[m * K + k]) * int32_t(w[n * K + k]);
      out[m * N + n] = s;
    }
}

// Rows m0 .. m0 + MR - 1 of x against the kBlock float rows in `buf`: MR x kBlock
// independent accumulators (an FMA's latency hidden), each summed over k in 8 lanes,
// then the lanes: the order depends on K alone.
template <int MR>
inline void F32Tile(const float* x, const float* buf, float* out, int64_t N, int64_t K,
                    int64_t m0, int64_t n, int64_t rows) {
  const int64_t K8 = K / 8 * 8;
  __m256 acc[MR][kBlock];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kBlock; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[kBlock];
    for (int j = 0; j < kBlock; ++j) wv[j] = _mm256_loadu_ps(buf + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < kBlock; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < rows; ++j) {
      float s = HorizontalSum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[(m0 + i) * K + k] * buf[j * K + k];
      out[(m0 + i) * N + n + j] = s;
    }
}

// out[m, n] = sum_k x[m, k] float(w[n, k]) for n in [n0, n1); `buf` holds kBlock * K
// floats: a block's weight rows converted once for all M (rows past N left zero).
void F32Rows(const float* x, const int8_t* w, float* out, int64_t M, int64_t N, int64_t K,
             int64_t n0, int64_t n1, float* buf) {
  const int64_t K8 = K / 8 * 8;
  for (int64_t n = n0; n < n1; n += kBlock) {
    const int64_t rows = std::min<int64_t>(kBlock, n1 - n);
    std::fill(buf, buf + kBlock * K, 0.0f);
    for (int64_t j = 0; j < rows; ++j) {
      const int8_t* wr = w + (n + j) * K;
      float* br = buf + j * K;
      int64_t k = 0;
      for (; k < K8; k += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + k));
        _mm256_storeu_ps(br + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
      }
      for (; k < K; ++k) br[k] = float(wr[k]);
    }
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) F32Tile<2>(x, buf, out, N, K, m, n, rows);
    if (m < M) F32Tile<1>(x, buf, out, N, K, m, n, rows);
  }
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

// body(n0, n1) over [0, N) in chunks of kRowsPerTask output rows.
template <typename Body>
void ParallelRows(ffi::ThreadPool& pool, int64_t N, Body body) {
  ParallelFor(pool, (N + kRowsPerTask - 1) / kRowsPerTask, [=](int64_t c) {
    body(c * kRowsPerTask, std::min(N, (c + 1) * kRowsPerTask));
  });
}

// x [B..., M, K], w [B'..., N, K] -> out [B..., M, N], where B' is all ones (one weight
// for every batch: the rows of all B are one product) or equals B (a weight per batch
// element): what vmap gives with vmap_method="expand_dims". `rows(x, w, out, M, N, K,
// n0, n1)` writes output columns [n0, n1) of one product.
template <ffi::DataType X, ffi::DataType O, typename Rows>
ffi::Error BatchedDot(ffi::ThreadPool& pool, ffi::Buffer<X> x, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<O> out, bool int32_sums, Rows rows) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  const size_t r = xd.size();
  if (r < 2 || wd.size() != r || od.size() != r || xd[r - 1] != wd[r - 1] ||
      od[r - 2] != xd[r - 2] || od[r - 1] != wd[r - 2])
    return ffi::Error::InvalidArgument("expected x [..., M, K], w [..., N, K], out [..., M, N]");
  int64_t bx = 1, bw = 1;
  for (size_t i = 0; i + 2 < r; ++i) {
    if (od[i] != xd[i] || (wd[i] != 1 && wd[i] != xd[i]))
      return ffi::Error::InvalidArgument("the batch dimensions of x, w and out disagree");
    bx *= xd[i];
    bw *= wd[i];
  }
  if (bw != 1 && bw != bx)
    return ffi::Error::InvalidArgument("w is batched over some of x's batch dimensions only");
  const int64_t M = xd[r - 2], K = xd[r - 1], N = wd[r - 2];
  if (int32_sums && K >= (int64_t(1) << 17))  // cpu_kernels.py routes these to XLA
    return ffi::Error::InvalidArgument("K >= 2^17 could overflow the int32 sums");
  const int64_t m = bw == 1 ? bx * M : M;  // one weight: every batch's rows at once
  for (int64_t b = 0; b < (bw == 1 ? 1 : bx); ++b) {
    const auto* xp = x.typed_data() + b * M * K;
    const int8_t* wp = w.typed_data() + b * N * K;
    auto* op = out->typed_data() + b * M * N;
    ParallelRows(pool, N, [=](int64_t n0, int64_t n1) { rows(xp, wp, op, m, N, K, n0, n1); });
  }
  return ffi::Error::Success();
}

ffi::Error Int8Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                   ffi::ResultBuffer<ffi::S32> out) {
  return BatchedDot(pool, x, w, out, true, Int8Rows);
}

ffi::Error F32Int8Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<ffi::F32> out) {
  return BatchedDot(pool, x, w, out, false,
                    [](const float* xp, const int8_t* wp, float* op, int64_t M, int64_t N,
                       int64_t K, int64_t n0, int64_t n1) {
                      std::vector<float> buf(kBlock * K);
                      F32Rows(xp, wp, op, M, N, K, n0, n1, buf.data());
                    });
}

// ---- Attention of a block of queries over one shared segment of keys ----
//
// q [H, Q, D] (scaled), k, v [H, M, D], mask [M] (the same keys visible to every
// query) -> out [H, Q, D] normalised over the segment, lse [H, Q] the log-sum-exp of
// the scores (-inf, with out 0, where no key is visible): common.partial_attention
// for one mask row. Tasks are (head, kQueryBlock queries, kKeyChunk keys); each keeps
// its chunk's maximum, sum and un-normalised output, merged per query at the end
// (split-K "flash decoding"), so the work spreads over the pool at any Q.

constexpr int64_t kKeyChunk = 256;
constexpr int64_t kQueryBlock = 8;

// e^x for x <= 0 (a score minus the maximum), within a few ulp; exactly 0 below -87
// and at -inf, NaN at NaN (a NaN score must reach the output, as in XLA's softmax).
// Cody-Waite reduction by ln 2 and Cephes' expf polynomial on [-ln2/2, ln2/2]
// (S. Moshier, Cephes Math Library), times 2^n.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ);  // NaN kept
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // max_ps returns its 2nd operand at NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

// The 8 lane sums of a[0..7], as one vector.
inline __m256 Sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k_i for the 8 keys k [8, D] (D a multiple of 8), in registers.
inline __m256 Scores8(const float* q, const float* k, int64_t D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * D + d), acc[i]);
  }
  return Sum8(acc);
}

// Two query rows q0, q1 against 4 keys k [4, D]: [q0 . k_0..3, q1 . k_0..3] (each key
// loaded once for both rows).
inline __m256 Scores2x4(const float* q0, const float* q1, const float* k, int64_t D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 a = _mm256_loadu_ps(q0 + d), b = _mm256_loadu_ps(q1 + d);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = _mm256_loadu_ps(k + i * D + d);
      acc[i] = _mm256_fmadd_ps(a, kv, acc[i]);
      acc[4 + i] = _mm256_fmadd_ps(b, kv, acc[4 + i]);
    }
  }
  return Sum8(acc);
}

// out_r[0, 8C) = sum_i p_r[i] v[i * D, + 8C) over the n keys, for the rows r < R
// (R = 1 or 2: each value row loaded once for both; keys whose p are all 0 skipped).
template <int R, int C>
inline void WeightedSum(const float* const* p, const float* v, int64_t n, int64_t D,
                        float* const* out) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    bool zero = true;
    for (int r = 0; r < R; ++r) zero &= p[r][i] == 0.0f;
    if (zero) continue;
    for (int c = 0; c < C; ++c) {
      const __m256 vv = _mm256_loadu_ps(v + i * D + 8 * c);
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][i]), vv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out[r] + 8 * c, acc[r][c]);
}

// One task: rows [0, R) of q against keys [0, n) of k, v (n <= kKeyChunk).
// Writes mx[r] (the chunk's maximum score, -inf if none visible), sum[r] and
// o[r * D ...] (sum_j e^(s_rj - mx_r) v_j).
void AttendChunk(const float* q, const float* k, const float* v, const bool* mask,
                 int64_t R, int64_t n, int64_t D, float* mx, float* sum, float* o) {
  alignas(32) float s[kQueryBlock * kKeyChunk];
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j < n; j += 8) {  // scores, 8 keys at a time (a tail block padded with -inf)
    const int64_t kn = std::min<int64_t>(8, n - j);
    int64_t visible = 0;
    for (int64_t i = 0; i < kn; ++i) visible += mask[j + i];
    const bool any = visible > 0, all = visible == 8;
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s + r * kKeyChunk + j;
      if (!any) {
        for (int64_t i = 0; i < 8; ++i) sr[i] = ninf;
        continue;
      }
      const float* qr = q + r * D;
      if (kn == 8 && r + 1 < R) {  // two rows at once
        const __m256 lo = Scores2x4(qr, qr + D, k + j * D, D);
        const __m256 hi = Scores2x4(qr, qr + D, k + (j + 4) * D, D);
        _mm256_storeu_ps(sr, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(sr + kKeyChunk, _mm256_permute2f128_ps(lo, hi, 0x31));
        if (!all)
          for (int64_t i = 0; i < 8; ++i)
            if (!mask[j + i]) sr[i] = sr[kKeyChunk + i] = ninf;
        ++r;
        continue;
      }
      if (kn == 8) {
        _mm256_storeu_ps(sr, Scores8(qr, k + j * D, D));
      } else {
        for (int64_t i = 0; i < kn; ++i) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(k + (j + i) * D + d), acc);
          sr[i] = HorizontalSum(acc);
        }
      }
      if (!all)
        for (int64_t i = 0; i < 8; ++i)
          if (i >= kn || !mask[j + i]) sr[i] = ninf;
    }
  }
  const int64_t n8 = j;  // n rounded up to 8
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * kKeyChunk;
    __m256 m8 = _mm256_set1_ps(ninf), nan8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 x = _mm256_loadu_ps(sr + i);
      m8 = _mm256_max_ps(m8, x);
      nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // max_ps drops NaN
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    const float m = _mm256_movemask_ps(nan8) ? std::numeric_limits<float>::quiet_NaN()
                                             : *std::max_element(lanes, lanes + 8);
    mx[r] = m;
    if (m == ninf) {  // no visible key: p = 0, so out = 0
      sum[r] = 0.0f;
      std::fill(sr, sr + n8, 0.0f);
      continue;
    }
    __m256 l8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
      const __m256 e = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(sr + i), _mm256_set1_ps(m)));
      _mm256_storeu_ps(sr + i, e);
      l8 = _mm256_add_ps(l8, e);
    }
    sum[r] = HorizontalSum(l8);
  }
  for (int64_t r = 0; r < R; r += 2) {  // out += p_j v_j: two rows, 32 columns at a time
    const float* p[2] = {s + r * kKeyChunk, s + (r + 1) * kKeyChunk};
    float* out[2] = {o + r * D, o + (r + 1) * D};
    const bool two = r + 1 < R;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const float* vd = v + d0;
      float* od[2] = {out[0] + d0, out[1] + d0};
      if (d0 + 32 <= D)
        two ? WeightedSum<2, 4>(p, vd, n, D, od) : WeightedSum<1, 4>(p, vd, n, D, od);
      else
        for (int64_t c = d0; c < D; c += 8) {
          float* oc[2] = {out[0] + c, out[1] + c};
          two ? WeightedSum<2, 1>(p, v + c, n, D, oc) : WeightedSum<1, 1>(p, v + c, n, D, oc);
        }
    }
  }
}

ffi::Error SegmentAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                            ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || kd[0] != qd[0] ||
      kd[2] != qd[2] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      mask.dimensions().size() != 1 || mask.dimensions()[0] != kd[1] || qd[2] % 8 != 0)
    return ffi::Error::InvalidArgument(
        "expected q [H, Q, D], k and v [H, M, D], mask [M], with D a multiple of 8");
  const int64_t H = qd[0], Q = qd[1], D = qd[2], M = kd[1];
  const int64_t nb = (Q + kQueryBlock - 1) / kQueryBlock, nc = (M + kKeyChunk - 1) / kKeyChunk;
  std::vector<float> mx(H * Q * nc), sum(H * Q * nc), part(H * Q * nc * D);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float *mxp = mx.data(), *sump = sum.data(), *partp = part.data();
  if (M > 0)
    ParallelFor(pool, H * nb * nc, [=](int64_t t) {
      const int64_t h = t / (nb * nc), b = t / nc % nb, c = t % nc;
      const int64_t r0 = b * kQueryBlock, j0 = c * kKeyChunk;
      const int64_t at = (h * nc + c) * Q + r0;  // partials laid out [H, nc, Q]
      AttendChunk(qp + (h * Q + r0) * D, kp + (h * M + j0) * D, vp + (h * M + j0) * D,
                  mp + j0, std::min(kQueryBlock, Q - r0), std::min(kKeyChunk, M - j0), D,
                  mxp + at, sump + at, partp + at * D);
    });
  float *op = out->typed_data(), *lp = lse->typed_data();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < Q; ++r) {  // merge the chunks by log-sum-exp
      float m = ninf;
      bool nan = false;
      for (int64_t c = 0; c < nc; ++c) {
        const float x = mx[(h * nc + c) * Q + r];
        nan |= std::isnan(x);
        m = std::max(m, x);
      }
      float* orow = op + (h * Q + r) * D;
      if (nan || m == ninf) {  // a NaN score: NaN out (as XLA's); no visible key: 0, -inf
        std::fill(orow, orow + D, nan ? std::numeric_limits<float>::quiet_NaN() : 0.0f);
        lp[h * Q + r] = nan ? std::numeric_limits<float>::quiet_NaN() : ninf;
        continue;
      }
      std::fill(orow, orow + D, 0.0f);
      float l = 0.0f;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t at = (h * nc + c) * Q + r;
        if (mx[at] == ninf) continue;
        const float w = std::exp(mx[at] - m);
        l += w * sum[at];
        for (int64_t d = 0; d < D; ++d) orow[d] += w * part[at * D + d];
      }
      for (int64_t d = 0; d < D; ++d) orow[d] /= l;
      lp[h * Q + r] = std::log(l) + m;
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsample_int8_dot, Int8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsample_f32_int8_dot, F32Int8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsample_segment_attention, SegmentAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int jaxsample_int8_cpu_supported() { return __builtin_cpu_supports("avx2") &&
                                                      __builtin_cpu_supports("fma"); }
