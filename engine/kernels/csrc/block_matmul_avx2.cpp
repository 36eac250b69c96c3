// The AVX2 + FMA + F16C block kernels (x86 since ~2013): vpmaddubsw products summed exactly in
// int16 / int32 per block, then the fixed float combination of block_matmul.h. Layouts: see
// block_matmul.cpp.
#include "block_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

using kvblock::BlockWeight;
using kvblock::kBlock;
using kvblock::QuantRows;

constexpr int64_t kRowTile = 4;  // activation rows sharing each unpacked weight vector

KV_AVX2 inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

KV_AVX2 void quantize_row_avx2_impl(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    __m256 nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float amax_s = _mm_cvtss_f32(m);
    if (!_mm256_testz_ps(nan, nan)) amax_s = NAN;  // a NaN poisons only this row's outputs
    const float scale = amax_s / 127.f;
    const float inv = amax_s != 0.f && !std::isnan(amax_s) ? 127.f / amax_s : 0.f;
    const __m256 mul = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)  // round to nearest even, as nearbyint
      qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                         _mm256_add_epi32(qi[2], qi[3]));
    const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
    const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), p);
    d[b] = scale;
    s[b] = scale * static_cast<float>(hsum_i32(sum));
  }
}

KV_AVX2 inline __m256 load_half8(const c10::Half* p) {  // 8 fp16 -> 8 float
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KV_AVX2 inline __m256i broadcast4(const int8_t* p) {  // 4 activation bytes into every 32-bit lane
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// Weights stream from memory once per call (decode) in short runs per thread, too short for the
// hardware prefetcher to ramp up: ask for the blocks kPrefetch ahead (they run on into the next
// column group, which follows in memory), and for their scales. 32 blocks (4 KB of q4): a batch-1
// Q4_0 decode step 0.96x the time of 16 ahead (AVX-512 EPYC, 2 threads, alternated in one process,
// 10 rounds, twice; 48 and 64 ahead 0.95-0.96x; batch 4 0.99x; Q8_0 batch 1 1.00x).
constexpr int64_t kPrefetch = 32;

KV_AVX2 inline void prefetch_ahead(const void* block, int64_t bytes, const c10::Half* d,
                                   const c10::Half* m) {
  const char* p = static_cast<const char*>(block) + kPrefetch * bytes;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + kPrefetch * 8), _MM_HINT_T0);
  if (m != nullptr) _mm_prefetch(reinterpret_cast<const char*>(m + kPrefetch * 8), _MM_HINT_T0);
}

// Integer sums are associative, so GCC computes a block's products for all RM rows first and adds
// them up last, spilling them to the stack (57 stack accesses per 4-row block); making each running
// sum a register value after every add keeps the loop in registers: 1.2-1.3x at 8-128 rows, the
// same integers, so the same outputs bit for bit.
KV_AVX2 inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// RM rows x one group of 8 columns, q4. Per block: 8 vpmaddubsw (4-bit w x int8 x, pairs) summed in
// int16 (16 products of at most 15 * 127 each: exact), one widening to int32, then per lane
// acc = fma(d_w d_x, sum, acc) and acc = fma(m_w, s_x, acc); Q4_0 (Q40: no m) adds n8 to the int32
// sum instead (the dot product with q - 8) and has no second fma. Same instructions for every lane
// and every row, whatever RM is, so tiling and batching never change a value.
template <int RM, bool PF, bool Q40>
KV_AVX2 void q4_group(const uint8_t* __restrict qs, const c10::Half* __restrict wd,
                      const c10::Half* __restrict wm, const QuantRows& x, int64_t r0,
                      float* __restrict out, int64_t N) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t KB = x.KB, K = x.K;
  const int8_t* xq[RM];
  const float *xd[RM], *xs[RM];
  const int32_t* xn[RM];
  for (int r = 0; r < RM; ++r) {
    xq[r] = x.q + (r0 + r) * K, xd[r] = x.d + (r0 + r) * KB, xs[r] = x.s + (r0 + r) * KB;
    xn[r] = Q40 ? x.n8 + (r0 + r) * KB : nullptr;
  }
  __m256 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* wb = qs + b * 128;
    if constexpr (PF) prefetch_ahead(wb, 128, wd + b * 8, Q40 ? nullptr : wm + b * 8);
    __m256i isum[RM];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
      for (int r = 0; r < RM; ++r) {
        const int8_t* xb = xq[r] + b * kBlock;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xb + 4 * j)),
                                           _mm256_maddubs_epi16(hi, broadcast4(xb + 4 * j + 16)));
        isum[r] = j == 0 ? p : _mm256_add_epi16(isum[r], p);
        keep_in_register(isum[r]);
      }
    }
    const __m256 dw = load_half8(wd + b * 8);
    __m256 mw = _mm256_setzero_ps();
    if constexpr (!Q40) mw = load_half8(wm + b * 8);
#pragma GCC unroll 4
    for (int r = 0; r < RM; ++r) {
      __m256i wide = _mm256_madd_epi16(isum[r], ones);
      if constexpr (Q40) wide = _mm256_add_epi32(wide, _mm256_set1_epi32(xn[r][b]));
      const __m256 sum = _mm256_cvtepi32_ps(wide);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(xd[r] + b)), sum, acc[r]);
      if constexpr (!Q40) acc[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs[r] + b), acc[r]);
    }
  }
  for (int r = 0; r < RM; ++r) _mm256_storeu_ps(out + (r0 + r) * N, acc[r]);
}

// RM rows x 8 columns, q8: |w| (unsigned) times x carrying w's sign, pairs widened to int32 at once
// (127 * 127 * 2 leaves no int16 headroom), then acc = fma(d_w d_x, sum, acc) per block.
template <int RM, bool PF>
KV_AVX2 void q8_group(const int8_t* __restrict qs, const c10::Half* __restrict wd,
                      const QuantRows& x, int64_t r0, float* __restrict out, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t KB = x.KB, K = x.K;
  const int8_t* xq[RM];
  const float* xd[RM];
  for (int r = 0; r < RM; ++r) xq[r] = x.q + (r0 + r) * K, xd[r] = x.d + (r0 + r) * KB;
  __m256 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const int8_t* wb = qs + b * 256;
    if constexpr (PF) prefetch_ahead(wb, 256, wd + b * 8, nullptr);
    __m256i isum[RM];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes (128 for -128)
#pragma GCC unroll 4
      for (int r = 0; r < RM; ++r) {
        const __m256i xs = _mm256_sign_epi8(broadcast4(xq[r] + b * kBlock + 4 * j), w);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
        isum[r] = j == 0 ? p : _mm256_add_epi32(isum[r], p);
        keep_in_register(isum[r]);
      }
    }
    const __m256 dw = load_half8(wd + b * 8);
#pragma GCC unroll 4
    for (int r = 0; r < RM; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(xd[r] + b)),
                               _mm256_cvtepi32_ps(isum[r]), acc[r]);
  }
  for (int r = 0; r < RM; ++r) _mm256_storeu_ps(out + (r0 + r) * N, acc[r]);
}

// Rows [r0, r1) of one column group, in tiles of 4 rows and a remainder; the tile of row 0 streams
// the weights from memory (and prefetches), later tiles find them in cache.
template <typename Group>
KV_AVX2 inline void row_tiles(int64_t r0, int64_t r1, Group&& group) {
  using std::integral_constant;
  int64_t r = r0;
  if (r == 0 && r1 >= kRowTile) {
    group(integral_constant<int, 4>{}, integral_constant<bool, true>{}, r);
    r += kRowTile;
  }
  for (; r + kRowTile <= r1; r += kRowTile)
    group(integral_constant<int, 4>{}, integral_constant<bool, false>{}, r);
  const bool first = r == 0;
  switch (r1 - r) {
    case 3:
      first ? group(integral_constant<int, 3>{}, integral_constant<bool, true>{}, r)
            : group(integral_constant<int, 3>{}, integral_constant<bool, false>{}, r);
      break;
    case 2:
      first ? group(integral_constant<int, 2>{}, integral_constant<bool, true>{}, r)
            : group(integral_constant<int, 2>{}, integral_constant<bool, false>{}, r);
      break;
    case 1:
      first ? group(integral_constant<int, 1>{}, integral_constant<bool, true>{}, r)
            : group(integral_constant<int, 1>{}, integral_constant<bool, false>{}, r);
      break;
    default: break;
  }
}

KV_AVX2 void q4_groups_avx2_impl(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                            int64_t g0, int64_t g1, int64_t N, float* out) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* qs = w.q4 + g * x.KB * 128;
    const c10::Half *d = w.d + g * x.KB * 8, *m = w.m != nullptr ? w.m + g * x.KB * 8 : nullptr;
    row_tiles(r0, r1, [&](auto rm, auto pf, int64_t r) {
      if (m == nullptr)
        q4_group<decltype(rm)::value, decltype(pf)::value, true>(qs, d, m, x, r, out + 8 * g, N);
      else
        q4_group<decltype(rm)::value, decltype(pf)::value, false>(qs, d, m, x, r, out + 8 * g, N);
    });
  }
}

KV_AVX2 void q8_groups_avx2_impl(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                            int64_t g0, int64_t g1, int64_t N, float* out) {
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* qs = w.q8 + g * x.KB * 256;
    const c10::Half* d = w.d + g * x.KB * 8;
    row_tiles(r0, r1, [&](auto rm, auto pf, int64_t r) {
      q8_group<decltype(rm)::value, decltype(pf)::value>(qs, d, x, r, out + 8 * g, N);
    });
  }
}

}  // namespace

namespace kvblock {

void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  quantize_row_avx2_impl(x, K, q, d, s);
}

void q4_groups_avx2(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                    int64_t g1, int64_t N, float* out) {
  q4_groups_avx2_impl(w, x, r0, r1, g0, g1, N, out);
}

void q8_groups_avx2(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                    int64_t g1, int64_t N, float* out) {
  q8_groups_avx2_impl(w, x, r0, r1, g0, g1, N, out);
}

}  // namespace kvblock

#endif
