// Attention of a block of queries over one shared segment of keys, for XLA as a typed
// FFI custom call (built with cpu_kernels.cc into one library by cpu_kernels.py beside it;
// models/families/common.py's partial_attention calls it for the int8 decode step's prefix).
//
// jaxsample_segment_attention: q [H, Q, D] (scaled), k, v [H, M, D], mask [M] (the same
// keys visible to every query) -> out [H, Q, D] normalised over the segment, lse [H, Q]
// the log-sum-exp of the scores (-inf, with out 0, where no key is visible; NaN where a
// score is NaN): common.partial_attention for one mask row. Tasks are (head,
// kQueryBlock queries, kKeyChunk keys); each keeps its chunk's maximum, sum and
// un-normalised output, merged per query at the end (split-K "flash decoding"), so the
// work spreads over the pool at any Q. jaxsample_segment_attention_f16: the same with k
// and v float16 (a W8A8 model's prefix), each element widened to float32 as it is
// loaded (F16C's conversion, exact), so the same arithmetic on those values.

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxsample_cpu;  // NOLINT: the shared helpers

constexpr int64_t kKeyChunk = 256;
constexpr int64_t kQueryBlock = 8;
constexpr int64_t kAheadKeys = 32;  // how far ahead of the scores the keys are prefetched

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

// 8 keys' or values' elements as float32: a float32 load, or float16 widened (exact).
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// q . k_i for the 8 keys k [8, D] (D a multiple of 8), in registers.
template <typename T>
inline __m256 Scores8(const float* q, const T* k, int64_t D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < 8; ++i)
      acc[i] = _mm256_fmadd_ps(qv, Load8(k + i * D + d), acc[i]);
  }
  return Sum8(acc);
}

// Two query rows q0, q1 against 4 keys k [4, D]: [q0 . k_0..3, q1 . k_0..3] (each key
// loaded once for both rows).
template <typename T>
inline __m256 Scores2x4(const float* q0, const float* q1, const T* k, int64_t D) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 a = _mm256_loadu_ps(q0 + d), b = _mm256_loadu_ps(q1 + d);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = Load8(k + i * D + d);
      acc[i] = _mm256_fmadd_ps(a, kv, acc[i]);
      acc[4 + i] = _mm256_fmadd_ps(b, kv, acc[4 + i]);
    }
  }
  return Sum8(acc);
}

// out_r[0, 8C) = sum_i p_r[i] v[i * D, + 8C) over the n keys, for the rows r < R
// (R = 1 or 2: each value row loaded once for both; keys whose p are all 0 skipped).
template <int R, int C, typename T>
inline void WeightedSum(const float* const* p, const T* v, int64_t n, int64_t D,
                        float* const* out) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    bool zero = true;
    for (int r = 0; r < R; ++r) zero &= p[r][i] == 0.0f;
    if (zero) continue;
    for (int c = 0; c < C; ++c) {
      const __m256 vv = Load8(v + i * D + 8 * c);
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
template <typename T>
void AttendChunk(const float* q, const T* k, const T* v, const bool* mask,
                 int64_t R, int64_t n, int64_t D, float* mx, float* sum, float* o) {
  alignas(32) float s[kQueryBlock * kKeyChunk];
  const float ninf = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j < n; j += 8) {  // scores, 8 keys at a time (a tail block padded with -inf)
    const int64_t kn = std::min<int64_t>(8, n - j);
    {  // ask for the keys kAheadKeys on and this block's values (read after the softmax)
      const char* kp = reinterpret_cast<const char*>(k + std::min(j + kAheadKeys, n - 1) * D);
      const char* vp = reinterpret_cast<const char*>(v + j * D);
      const int64_t bytes = kn * D * int64_t(sizeof(T));
      for (int64_t b = 0; b < bytes; b += 64) {
        _mm_prefetch(kp + b, _MM_HINT_T0);
        _mm_prefetch(vp + b, _MM_HINT_T1);
      }
    }
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
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), Load8(k + (j + i) * D + d), acc);
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
      const T* vd = v + d0;
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

template <ffi::DataType KV>
ffi::Error SegmentAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                            ffi::Buffer<KV> k, ffi::Buffer<KV> v,
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
  const float* qp = q.typed_data();
  const auto *kp = k.typed_data(), *vp = v.typed_data();
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

#define JAXSAMPLE_SEGMENT_ATTENTION(NAME, KV)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, SegmentAttention<KV>,      \
                                ffi::Ffi::Bind()                 \
                                    .Ctx<ffi::ThreadPool>()      \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<KV>>()      \
                                    .Arg<ffi::Buffer<KV>>()      \
                                    .Arg<ffi::Buffer<ffi::PRED>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>());

JAXSAMPLE_SEGMENT_ATTENTION(jaxsample_segment_attention, ffi::F32)
JAXSAMPLE_SEGMENT_ATTENTION(jaxsample_segment_attention_f16, ffi::F16)
