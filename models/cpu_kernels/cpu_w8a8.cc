// W8A8's whole product in one typed FFI custom call (built with cpu_kernels.cc into one
// library by cpu_kernels.py beside it; models/quantization/quant.py's _w8a8_rows calls it):
//
//   jaxsample_w8a8_dot: x f32 [M, K], w int8 [N, K], scale f32 [N], idx s32 [J],
//       keep f32 [K] (or [0]: no channel kept apart), w_out f32 [J, N] -> f32 [M, N]
//
// The steps of the XLA expression (quant.w8a8_expression), in its order (its divisions
// are products by reciprocals, as XLA CPU rewrites them):
//   xo = x[:, idx]                           the J input channels kept in float
//   xf = x * keep                            (keep is 0 on them, 1 elsewhere)
//   s  = max_k |xf| * (1/127), 1 where 0     the row's activation scale
//   xq = int8(clip(round_half_even(xf * (1 / s)), -127, 127))
//   y  = float(xq w^T) * s * scale + xo w_out
// The int8 product is Int8RowsNow's (exact). Without kept channels the result equals
// the XLA expression bit for bit; with them the J terms xo[:, j] w_out[j] are added to
// y one by one, j = 0 .. J-1, each a fused multiply-add, where XLA sums the J terms
// first in its dot's order (float32 rounding apart). A row with a NaN or an infinity
// gives NaN outputs (s is NaN or inf there), as the XLA expression does.
//
// Why: the XLA expression is 6 to 8 small fusions and a dot per product around the
// int8 custom call, 121 products in a SmolLM2 step. The step's time is the same either
// way, but the programs are smaller: a warm start of the README command with int8
// weights fetched its compiled programs in half the time (benchmarks/RESULTS.md,
// "W8A8's product in one call").

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxsample_cpu;  // NOLINT: the shared helpers

constexpr float kQmax = 127.0f;
constexpr float kInvQmax = 1.0f / 127.0f;  // the scale is max |x| times it, as XLA's
constexpr int64_t kOutlierBlock = 512;  // columns, at least, per task of the kept channels' product

// Row m of x quantised: xq (int8 [K]) and its scale; false where the scale is not
// finite (a NaN or an infinity in the row: the row's outputs are NaN).
bool QuantizeRow(const float* x, const float* keep, int64_t K, int8_t* xq, float* scale) {
  const int64_t K8 = K / 8 * 8, K32 = K / 32 * 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  auto xf8 = [&](int64_t k) {
    const __m256 v = _mm256_loadu_ps(x + k);
    return keep ? _mm256_mul_ps(v, _mm256_loadu_ps(keep + k)) : v;
  };
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 a = _mm256_and_ps(xf8(k), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    amax = _mm256_max_ps(amax, a);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.0f;
  for (float l : lanes) m = std::max(m, l);
  bool finite = _mm256_movemask_ps(nan) == 0;
  for (int64_t k = K8; k < K; ++k) {
    const float a = std::fabs(keep ? x[k] * keep[k] : x[k]);
    finite &= !std::isnan(a);
    m = std::max(m, a);
  }
  float s = m * kInvQmax;
  s = s == 0.0f ? 1.0f : s;
  finite &= std::isfinite(s);
  *scale = s;
  if (!finite) return false;
  const float inv = 1.0f / s;
  const __m256 iv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-kQmax), hi = _mm256_set1_ps(kQmax);
  auto q8 = [&](int64_t k) {  // 8 values rounded to nearest even and clipped, as int32
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(xf8(k), iv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
  };
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t k = 0; k < K32; k += 32) {  // 32 int32 packed to int8 (in range: exact)
    const __m256i ab = _mm256_packs_epi32(q8(k), q8(k + 8));
    const __m256i cd = _mm256_packs_epi32(q8(k + 16), q8(k + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + k), bytes);
  }
  for (int64_t k = K32; k < K; ++k) {  // round-to-nearest-even: the default rounding mode
    const float r = std::nearbyint((keep ? x[k] * keep[k] : x[k]) * inv);
    xq[k] = int8_t(std::min(std::max(r, -kQmax), kQmax));
  }
  return true;
}

ffi::Error W8A8Dot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                   ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> idx,
                   ffi::Buffer<ffi::F32> keep, ffi::Buffer<ffi::F32> w_out,
                   ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || od.size() != 2 ||
      od[0] != xd[0] || od[1] != wd[0])
    return ffi::Error::InvalidArgument("expected x [M, K], w [N, K], out [M, N]");
  const int64_t M = xd[0], K = xd[1], N = wd[0], J = idx.element_count();
  const auto od2 = w_out.dimensions();
  if (scale.element_count() != N || idx.dimensions().size() != 1 ||
      keep.element_count() != (J ? K : 0) || od2.size() != 2 || od2[0] != J || od2[1] != N)
    return ffi::Error::InvalidArgument(
        "expected scale [N], idx [J], keep [K] (or [0] with J = 0), w_out [J, N]");
  if (K >= (int64_t(1) << 17))  // cpu_kernels.py routes these to XLA
    return ffi::Error::InvalidArgument("K >= 2^17 could overflow the int32 sums");
  const float* xp = x.typed_data();
  const float* kp = keep.element_count() ? keep.typed_data() : nullptr;
  const int32_t* ip = idx.typed_data();
  for (int64_t j = 0; j < J; ++j)
    if (ip[j] < 0 || ip[j] >= K) return ffi::Error::InvalidArgument("idx outside [0, K)");

  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M), xo(M * J);
  std::vector<char> finite(M);
  const int64_t row_blocks = (M + kRowsPerTask - 1) / kRowsPerTask;
  ParallelFor(pool, row_blocks, [&](int64_t b) {
    for (int64_t m = b * kRowsPerTask; m < std::min(M, (b + 1) * kRowsPerTask); ++m) {
      for (int64_t j = 0; j < J; ++j) xo[m * J + j] = xp[m * K + ip[j]];
      finite[m] = QuantizeRow(xp + m * K, kp, K, xq.data() + m * K, &sx[m]);
    }
  });

  float* op = out->typed_data();
  int32_t* acc = reinterpret_cast<int32_t*>(op);  // the int32 sums, then y in their place
  const float* sp = scale.typed_data();
  const float* wo = w_out.typed_data();
  const int8_t* wp = w.typed_data();
  ParallelRows(pool, N, [&](int64_t n0, int64_t n1) {
    Int8RowsNow(xq.data(), wp, acc, M, N, K, n0, n1);
    const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
    for (int64_t m = 0; m < M; ++m) {
      float* row = op + m * N;
      const __m256 s = _mm256_set1_ps(sx[m]);
      for (int64_t n = n0; n < n8; n += 8) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + n));
        _mm256_storeu_ps(row + n, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), s),
                                                _mm256_loadu_ps(sp + n)));
      }
      for (int64_t n = n8; n < n1; ++n) {
        int32_t a;
        std::memcpy(&a, row + n, sizeof a);
        row[n] = float(a) * sx[m] * sp[n];
      }
    }
  });
  // The kept channels' float product, y += xo[:, j] w_out[j] for j = 0 .. J-1, in column
  // blocks of at least kOutlierBlock: each of w_out's rows read as one long stream (in
  // the int8 tasks' 64 columns, J short rows N floats apart, it ran at half the speed).
  if (J) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(
        pool.num_threads(), N / kOutlierBlock));
    ParallelFor(pool, blocks, [&](int64_t b) {
      const int64_t c0 = N * b / blocks / 8 * 8;
      const int64_t c1 = b + 1 == blocks ? N : N * (b + 1) / blocks / 8 * 8;
      const int64_t c8 = c0 + (c1 - c0) / 8 * 8;
      for (int64_t m = 0; m < M; ++m) {
        float* row = op + m * N;
        for (int64_t j = 0; j < J; ++j) {
          const float* wj = wo + j * N;
          const float xj = xo[m * J + j];
          const __m256 xv = _mm256_set1_ps(xj);
          for (int64_t n = c0; n < c8; n += 8)
            _mm256_storeu_ps(row + n, _mm256_fmadd_ps(xv, _mm256_loadu_ps(wj + n),
                                                      _mm256_loadu_ps(row + n)));
          for (int64_t n = c8; n < c1; ++n) row[n] = std::fma(xj, wj[n], row[n]);
        }
      }
    });
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t m = 0; m < M; ++m)  // rows whose scale is NaN or inf: NaN, as XLA's
    if (!finite[m]) std::fill(op + m * N, op + (m + 1) * N, nan);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsample_w8a8_dot, W8A8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
