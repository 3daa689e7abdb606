// The int8 decode's CPU kernels for XLA, as typed FFI custom calls
// (models/cpu_kernels/cpu_kernels.py builds this file with cpu_attention.cc into one
// library, loads and registers it; models/quantization/quant.py and
// models/families/common.py call them).
//
//   jaxsample_int8_dot:   x int8 [M, K], w int8 [N, K] -> int32 [M, N], y = x w^T (exact)
//   jaxsample_f32_int8_dot: x f32 [M, K], w int8 [N, K] -> f32 [M, N], y = x float(w)^T
//   jaxsample_segment_attention: q [H, Q, D], k, v [H, M, D], mask [M] -> out [H, Q, D],
//       lse [H, Q]: the decode step's attention over the shared prefix (cpu_attention.cc)
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
#include <vector>

#include "cpu_kernels.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxsample_cpu;  // NOLINT: the shared helpers

constexpr int64_t kBlock = 4;         // output rows n per inner loop (the float product)
constexpr int64_t kAhead = 4;         // weight rows prefetched ahead (the VNNI loop)
constexpr int64_t kTileRows = 256;    // x rows per block of the VNNI 4 x 4 tile, at most
constexpr int64_t kTileBytes = 1 << 18;  // and at most this many bytes of offset x per block

// out[m, n] = sum_k x[m, k] w[n, k] for n in [n0, n1): one weight row at a time, read in
// order for each x row (from cache after the first). Four rows interleaved, as this loop
// read them before, streamed SmolLM2's projections at 8 GB/s on a Zen 4 core at M = 1,
// one row at 24 GB/s (the hardware prefetcher follows one stream).
void Int8Rows(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t N,
              int64_t K, int64_t n0, int64_t n1) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K32 = K / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xm = x + m * K;
      __m256i acc = _mm256_setzero_si256();
      for (int64_t k = 0; k < K32; k += 32) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + k));
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + k));
        // |w| as unsigned bytes (-128 -> 128) times x with w's sign: right for any w
        // while x stays in [-127, 127] (negating -128 would overflow).
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
      }
      int32_t s = HorizontalSum(acc);
      for (int64_t k = K32; k < K; ++k) s += int32_t(xm[k]) * int32_t(wn[k]);
      out[m * N + n] = s;
    }
  }
}

// The same product with AVX-512 VNNI, where the CPU has it (jaxsample_set_isa). vpdpbusd
// multiplies unsigned by signed bytes and sums each four into an int32 lane with no int16
// step, so x is offset to unsigned, x + 128 = x ^ 0x80, and the offset taken off with the
// weight row's sum: sum_k (x + 128) w = sum_k x w + 128 sum_k w. The int32 sums wrap
// (modulo 2^32) where the offset one overflows, and the true result fits: exact, as the
// AVX2 loop. One instruction per 64 byte products, against five per 32 there.
#define JAXSAMPLE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// v's four 128-bit lanes added, int32 lane by lane (wrapping).
JAXSAMPLE_VNNI inline __m128i LanesAdded(__m512i v) {
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The sum of v's 16 int32 lanes modulo 2^32 (_mm512_reduce_add_epi32's last add is a
// signed int one, undefined where it overflows; these vector adds wrap).
JAXSAMPLE_VNNI inline uint32_t WrappingSum(__m512i v) {
  __m128i s = LanesAdded(v);
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return uint32_t(_mm_cvtsi128_si32(s));
}

// x rows m0 .. m0 + MR - 1 against weight row n (at wn), K in 64-byte steps, the last one
// masked. kSums (the first tile of a row): also sum the weight row, times 128 (the offset),
// into *wsum, and prefetch the row kAhead rows on. One weight row at a time, read in order:
// at M = 1 this streamed 106 MB of SmolLM2's projections at 17-20 GB/s on one Zen 4 core,
// against 8 GB/s for four rows interleaved (a first version, as the AVX2 loop's was).
template <int MR, bool kSums>
JAXSAMPLE_VNNI inline void Int8TileVnni(const int8_t* x, const int8_t* wn, int32_t* out,
                                        int64_t N, int64_t K, int64_t m0, int64_t n,
                                        int32_t* wsum) {
  const __m512i offset = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
  __m512i acc[MR], sums = _mm512_setzero_si512();
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    const __mmask64 live = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    const __m512i wv = _mm512_maskz_loadu_epi8(live, wn + k);  // 0 past K
    if (kSums) {
      sums = _mm512_dpbusd_epi32(sums, ones, wv);
      _mm_prefetch(reinterpret_cast<const char*>(wn + kAhead * K + k), _MM_HINT_T0);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i xu =
          _mm512_xor_si512(_mm512_maskz_loadu_epi8(live, x + (m0 + i) * K + k), offset);
      acc[i] = _mm512_dpbusd_epi32(acc[i], xu, wv);
    }
  }
  if (kSums) *wsum = int32_t(WrappingSum(sums) << 7);
  for (int i = 0; i < MR; ++i)  // int32 lanes wrap: the offset sums' overflow cancels
    out[(m0 + i) * N + n] = int32_t(WrappingSum(acc[i]) - uint32_t(*wsum));
}

// At M >= 4 (the branches of a decode step): 4 x rows against 4 weight rows n .. n + 3,
// 16 sums in registers, each x and w vector loaded once per 64-byte step for four
// products (one weight row at a time loads both once per product, as many loads as
// vpdpbusd). xu holds x offset to unsigned (once per task of weight rows), rows of
// Kp (K rounded up to 64) bytes, zero past K. An x row's four sums are reduced
// together and stored as four consecutive outputs. On one Zen 4 core at M = 16,
// SmolLM2's projection shapes: 130 GMAC/s in cache against 65 for one row at a time,
// 87 against 57 streaming the weights.
//
// The sums of four vectors' 16 lanes each, as four int32 lanes (wrapping adds).
JAXSAMPLE_VNNI inline __m128i SumsOfFour(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return LanesAdded(
      _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd)));
}

#define JAXSAMPLE_STEP4X4(LOADW)                                                         \
  {                                                                                     \
    const __m512i w0 = LOADW(w0p + k), w1 = LOADW(w1p + k), w2 = LOADW(w2p + k),        \
                  w3 = LOADW(w3p + k);                                                  \
    __m512i xv = _mm512_loadu_si512(x0 + k);                                            \
    a00 = _mm512_dpbusd_epi32(a00, xv, w0); a01 = _mm512_dpbusd_epi32(a01, xv, w1);     \
    a02 = _mm512_dpbusd_epi32(a02, xv, w2); a03 = _mm512_dpbusd_epi32(a03, xv, w3);     \
    xv = _mm512_loadu_si512(x1 + k);                                                    \
    a10 = _mm512_dpbusd_epi32(a10, xv, w0); a11 = _mm512_dpbusd_epi32(a11, xv, w1);     \
    a12 = _mm512_dpbusd_epi32(a12, xv, w2); a13 = _mm512_dpbusd_epi32(a13, xv, w3);     \
    xv = _mm512_loadu_si512(x2 + k);                                                    \
    a20 = _mm512_dpbusd_epi32(a20, xv, w0); a21 = _mm512_dpbusd_epi32(a21, xv, w1);     \
    a22 = _mm512_dpbusd_epi32(a22, xv, w2); a23 = _mm512_dpbusd_epi32(a23, xv, w3);     \
    xv = _mm512_loadu_si512(x3 + k);                                                    \
    a30 = _mm512_dpbusd_epi32(a30, xv, w0); a31 = _mm512_dpbusd_epi32(a31, xv, w1);     \
    a32 = _mm512_dpbusd_epi32(a32, xv, w2); a33 = _mm512_dpbusd_epi32(a33, xv, w3);     \
    if (kSums) {                                                                        \
      s0 = _mm512_dpbusd_epi32(s0, ones, w0); s1 = _mm512_dpbusd_epi32(s1, ones, w1);   \
      s2 = _mm512_dpbusd_epi32(s2, ones, w2); s3 = _mm512_dpbusd_epi32(s3, ones, w3);   \
    }                                                                                   \
  }

#define JAXSAMPLE_LOAD(p) _mm512_loadu_si512(p)
#define JAXSAMPLE_MLOAD(p) _mm512_maskz_loadu_epi8(live, p)  // 0 past K

template <bool kSums>
JAXSAMPLE_VNNI inline void Int8Tile4x4(const uint8_t* xu, int64_t Kp, const int8_t* w,
                                       int32_t* out, int64_t N, int64_t K, int64_t m0,
                                       int64_t n, __m128i* wsum) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i z = _mm512_setzero_si512();
  __m512i a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
  __m512i a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
  __m512i s0 = z, s1 = z, s2 = z, s3 = z;
  const int8_t *w0p = w + n * K, *w1p = w0p + K, *w2p = w1p + K, *w3p = w2p + K;
  const uint8_t *x0 = xu + m0 * Kp, *x1 = x0 + Kp, *x2 = x1 + Kp, *x3 = x2 + Kp;
  const int64_t K64 = K / 64 * 64;
  int64_t k = 0;
  for (; k < K64; k += 64) {
    if (kSums) {
      _mm_prefetch(reinterpret_cast<const char*>(w0p + 4 * K + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1p + 4 * K + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w2p + 4 * K + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w3p + 4 * K + k), _MM_HINT_T0);
    }
    JAXSAMPLE_STEP4X4(JAXSAMPLE_LOAD)
  }
  if (k < K) {  // the last, partial step: w masked (0 past K), xu is zero there anyway
    const __mmask64 live = (__mmask64(1) << (K - k)) - 1;
    JAXSAMPLE_STEP4X4(JAXSAMPLE_MLOAD)
  }
  if (kSums) *wsum = _mm_slli_epi32(SumsOfFour(s0, s1, s2, s3), 7);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (m0 + 0) * N + n),
                   _mm_sub_epi32(SumsOfFour(a00, a01, a02, a03), *wsum));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (m0 + 1) * N + n),
                   _mm_sub_epi32(SumsOfFour(a10, a11, a12, a13), *wsum));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (m0 + 2) * N + n),
                   _mm_sub_epi32(SumsOfFour(a20, a21, a22, a23), *wsum));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (m0 + 3) * N + n),
                   _mm_sub_epi32(SumsOfFour(a30, a31, a32, a33), *wsum));
}

#undef JAXSAMPLE_STEP4X4
#undef JAXSAMPLE_LOAD
#undef JAXSAMPLE_MLOAD

JAXSAMPLE_VNNI void Int8RowsVnni(const int8_t* x, const int8_t* w, int32_t* out, int64_t M,
                                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
  if (M == 0) return;
  if (K == 0) {  // empty sums (and no x block to size below)
    for (int64_t m = 0; m < M; ++m) std::fill(out + m * N + n0, out + m * N + n1, 0);
    return;
  }
  int64_t n = n0;
  if (M >= 4) {
    // x in blocks of up to kTileRows rows and kTileBytes bytes (a prefill's x, offset,
    // stays in L2 with the task's weight rows), each block against all of the task's
    // weight rows, 4 at a time. Each task (kRowsPerTask weight rows) offsets x itself.
    const int64_t Kp = (K + 63) / 64 * 64, n4 = n0 + (n1 - n0) / 4 * 4;
    const int64_t block = std::clamp<int64_t>(kTileBytes / Kp / 4 * 4, 4, kTileRows);
    std::vector<uint8_t> xu(std::min(M, block) * Kp, 0);
    for (int64_t mb = 0; mb < M; mb += block) {
      const int64_t rows = std::min(M - mb, block), full = rows / 4 * 4;
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t k = 0; k < K; ++k) xu[m * Kp + k] = uint8_t(x[(mb + m) * K + k]) ^ 0x80;
      int32_t* ob = out + mb * N;
      const int8_t* xb = x + mb * K;
      for (int64_t nt = n0; nt < n4; nt += 4) {
        alignas(16) int32_t ws[4];  // the weight rows' sums times 128, from the first tile
        if (full > 0) {
          __m128i wsum;
          Int8Tile4x4<true>(xu.data(), Kp, w, ob, N, K, 0, nt, &wsum);
          for (int64_t m = 4; m < full; m += 4)
            Int8Tile4x4<false>(xu.data(), Kp, w, ob, N, K, m, nt, &wsum);
          _mm_store_si128(reinterpret_cast<__m128i*>(ws), wsum);
        } else {  // a last block of 1 to 3 rows: its first row one weight row at a time
          for (int j = 0; j < 4; ++j)
            Int8TileVnni<1, true>(xb, w + (nt + j) * K, ob, N, K, 0, nt + j, &ws[j]);
        }
        for (int64_t m = full > 0 ? full : 1; m < rows; ++m)  // rows past the last tile
          for (int j = 0; j < 4; ++j)
            Int8TileVnni<1, false>(xb, w + (nt + j) * K, ob, N, K, m, nt + j, &ws[j]);
      }
    }
    n = n4;
  }
  for (; n < n1; ++n) {  // M < 4 (the one-branch step: one weight row at a time), or n's tail
    const int8_t* wn = w + n * K;
    int32_t wsum;
    int64_t m = M >= 4 ? 4 : 1;
    if (M >= 4)
      Int8TileVnni<4, true>(x, wn, out, N, K, 0, n, &wsum);
    else
      Int8TileVnni<1, true>(x, wn, out, N, K, 0, n, &wsum);
    for (; m + 4 <= M; m += 4) Int8TileVnni<4, false>(x, wn, out, N, K, m, n, &wsum);
    for (; m < M; ++m) Int8TileVnni<1, false>(x, wn, out, N, K, m, n, &wsum);
  }
}

// 1 where the CPU (and the OS's saved state) has AVX-512 with VNNI, else 0: the most
// jaxsample_set_isa allows.
int BestIsa() {
  static const int best = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return best;
}
std::atomic<int> g_isa{-1};  // -1: not set, BestIsa()

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
  return BatchedDot(pool, x, w, out, true, Int8RowsNow);
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

}  // namespace

namespace jaxsample_cpu {

void Int8RowsNow(const int8_t* x, const int8_t* w, int32_t* out, int64_t M, int64_t N,
                 int64_t K, int64_t n0, int64_t n1) {
  const int isa = g_isa.load(std::memory_order_relaxed);
  (isa < 0 ? BestIsa() : isa) ? Int8RowsVnni(x, w, out, M, N, K, n0, n1)
                              : Int8Rows(x, w, out, M, N, K, n0, n1);
}

}  // namespace jaxsample_cpu

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

extern "C" int jaxsample_int8_cpu_supported() { return __builtin_cpu_supports("avx2") &&
                                                      __builtin_cpu_supports("fma") &&
                                                      __builtin_cpu_supports("f16c"); }

// The int8 product's instruction set: level 0 AVX2, 1 AVX-512 VNNI (at most what this
// CPU has); a level < 0 changes nothing. Returns the level in use (at first the best).
// For cpu_kernels.py's `isa` and `use_isa`: the results are the same bit for bit.
extern "C" int jaxsample_set_isa(int level) {
  if (level >= 0) g_isa.store(std::min(level, BestIsa()));
  const int isa = g_isa.load();
  return isa < 0 ? BestIsa() : isa;
}
