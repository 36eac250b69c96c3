// GGUF's Q5_0 and Q5_1 blocks (32 values of 5 bits: Q5_1 w = d q + m, Q5_0 w = d (q - 16)),
// served as stored. Layout per block of 32 and group of 8 columns (Q5Weight in block_matmul.h):
// vectors 0..3 as q4's (byte 4c + i of vector j: column c's k = 4j + i in the low nibble, k = 4j +
// 16 + i in the high one), then one vector of fifth bits (byte 4c + i, bit 2j + half: the fifth bit
// of k = 4j + 16 half + i), as Q5_K's (block_kquants.cpp); d, m fp16 per block and column as q4's.
// Per output element, block by block, q4's fixed order (block_matmul.h):
//   acc = fma(d_w * d_x, isum_b, acc); acc = fma(m_w, s_x, acc)
// with isum_b the exact integer dot product of the unsigned 5-bit q with the int8 activations; Q5_0
// stores no m: its isum_b is the dot product with q - 16 (isum + QuantRows::n16, exact) and there
// is no second fma, as Q4_0. Every path (portable, AVX2, AVX-VNNI, AVX-512 VNNI) gives the same bits,
// alone or in any batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "block_linear.h"
#include "block_matmul.h"

namespace kvblock {

// ---------------------------------------------------------------- portable reference loops

void q5_groups_ref(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                   int64_t g1, int64_t N, float* out) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < 8; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < x.KB; ++b) {
          const uint8_t* qb = w.qs + (g * x.KB + b) * 160;
          const int8_t* xb = x.q + r * x.K + b * kBlock;
          int32_t isum = 0;
          for (int k = 0; k < 32; ++k) {
            const int half = k / 16, j = (k % 16) / 4, i = k % 4;
            const uint8_t byte = qb[32 * j + 4 * c + i];
            const int32_t low = half ? byte >> 4 : byte & 0x0F;
            const int32_t top = (qb[128 + 4 * c + i] >> (2 * j + half)) & 1;
            isum += (low | top << 4) * xb[k];
          }
          const int64_t at = (g * x.KB + b) * 8 + c;
          const float dw = static_cast<float>(w.d[at]);
          if (w.m == nullptr) {  // Q5_0: the dot product with q - 16, exact in integers
            acc = std::fma(dw * x.d[r * x.KB + b], static_cast<float>(isum + x.n16[r * x.KB + b]),
                           acc);
            continue;
          }
          acc = std::fma(dw * x.d[r * x.KB + b], static_cast<float>(isum), acc);
          acc = std::fma(static_cast<float>(w.m[at]), x.s[r * x.KB + b], acc);
        }
        out[r * N + 8 * g + c] = acc;
      }
}

}  // namespace kvblock

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <type_traits>

#define Q5_AVX2 __attribute__((target("avx2,fma,f16c")))
#define Q5_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define Q5_VNNI512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

using kvblock::kBlock;
using kvblock::Q5Weight;
using kvblock::QuantRows;

constexpr int64_t kPrefetch = 8;  // blocks ahead

inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [r0, r1) in tiles of up to RMAX rows, each tile one call of f(rows, prefetch, first row); the
// tile of row 0 streams the weights from memory (and prefetches), later ones find them in cache.
template <int R, typename F>
inline void tile(int64_t n, bool first, int64_t r, F& f) {
  if constexpr (R > 1) {
    if (n < R) return tile<R - 1>(n, first, r, f);
  }
  first ? f(std::integral_constant<int, R>{}, std::true_type{}, r)
        : f(std::integral_constant<int, R>{}, std::false_type{}, r);
}

template <int RMAX, typename F>
inline void row_tiles(int64_t r0, int64_t r1, F&& f) {
  for (int64_t r = r0; r < r1; r += RMAX) tile<RMAX>(std::min<int64_t>(RMAX, r1 - r), r == 0, r, f);
}

// Bit P of each byte of h moved to bit 4 (16-bit shifts keep every bit within its byte here, as
// |4 - P| <= 3 or 4 with P <= 7), other bits cleared.
template <int P>
Q5_AVX2 inline __m256i bit4_avx2(__m256i h) {
  const __m256i sixteen = _mm256_set1_epi8(0x10);
  if constexpr (P < 4) return _mm256_and_si256(_mm256_slli_epi16(h, 4 - P), sixteen);
  if constexpr (P > 4) return _mm256_and_si256(_mm256_srli_epi16(h, P - 4), sixteen);
  return _mm256_and_si256(h, sixteen);
}

// Vector j's 5-bit values of a block: lo (k = 4j + i) and hi (k = 4j + 16 + i), per column.
template <int J>
Q5_AVX2 inline void values_avx2(const uint8_t* qb, __m256i h, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * J));
  lo = _mm256_or_si256(_mm256_and_si256(v, low), bit4_avx2<2 * J>(h));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), bit4_avx2<2 * J + 1>(h));
}

// AVX-512 BW + VL: the fifth bits as a byte mask (vptestmb), added in as 16 under it.
template <int J>
Q5_VNNI512 inline void values_evex(const uint8_t* qb, __m256i h, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(0x10);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * J));
  const __mmask32 kl = _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << (2 * J))));
  const __mmask32 kh = _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << (2 * J + 1))));
  const __m256i l4 = _mm256_and_si256(v, low);
  const __m256i h4 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  lo = _mm256_mask_add_epi8(l4, kl, l4, sixteen);
  hi = _mm256_mask_add_epi8(h4, kh, h4, sixteen);
}

Q5_AVX2 inline void keep(__m256i& v) { asm("" : "+x"(v)); }

// RM rows x one group of 8 columns (ymm), written once and compiled per ISA: DP adds a block's
// exact integer sums for the RM rows into isum.
#define KV_Q5_YMM(ATTR, NS, DP)                                                          \
namespace NS {                                                                                   \
ATTR inline __m256 load_half8(const c10::Half* p) {                                              \
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));                  \
}                                                                                                \
                                                                                                 \
template <int RM, bool PF, bool Q50>                                                             \
ATTR void q5_group(const uint8_t* qs, const c10::Half* wd, const c10::Half* wm,                  \
                   const QuantRows& x, int64_t r0, float* out, int64_t N) {                      \
  const int64_t KB = x.KB;                                                                       \
  __m256 acc[RM];                                                                                \
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();                                     \
  for (int64_t b = 0; b < KB; ++b) {                                                             \
    const uint8_t* qb = qs + b * 160;                                                            \
    if constexpr (PF) {                                                                          \
      const char* p = reinterpret_cast<const char*>(qb + kPrefetch * 160);                       \
      for (int off = 0; off < 160; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);                \
      _mm_prefetch(reinterpret_cast<const char*>(wd + (b + kPrefetch) * 8), _MM_HINT_T0);        \
      if constexpr (!Q50)                                                                        \
        _mm_prefetch(reinterpret_cast<const char*>(wm + (b + kPrefetch) * 8), _MM_HINT_T0);      \
    }                                                                                            \
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 128));            \
    __m256i isum[RM];                                                                            \
    for (int r = 0; r < RM; ++r)                                                                 \
      isum[r] = Q50 ? _mm256_set1_epi32(x.n16[(r0 + r) * KB + b]) : _mm256_setzero_si256();      \
    DP<RM>(qb, h, x, r0, b, isum);                                                               \
    const __m256 dw = load_half8(wd + b * 8);                                                    \
    __m256 mw = _mm256_setzero_ps();                                                             \
    if constexpr (!Q50) mw = load_half8(wm + b * 8);                                             \
_Pragma("GCC unroll 4")                                                                          \
    for (int r = 0; r < RM; ++r) {                                                               \
      const __m256 dx = _mm256_set1_ps(x.d[(r0 + r) * KB + b]);                                  \
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[r]), acc[r]);      \
      if constexpr (!Q50)                                                                        \
        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[(r0 + r) * KB + b]), acc[r]);            \
    }                                                                                            \
  }                                                                                              \
  for (int r = 0; r < RM; ++r) _mm256_storeu_ps(out + (r0 + r) * N, acc[r]);                     \
}                                                                                                \
                                                                                                 \
ATTR void q5_groups(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,   \
                    int64_t g1, int64_t N, float* out) {                                         \
  for (int64_t g = g0; g < g1; ++g) {                                                            \
    const uint8_t* qs = w.qs + g * x.KB * 160;                                                   \
    const c10::Half *d = w.d + g * x.KB * 8, *m = w.m ? w.m + g * x.KB * 8 : nullptr;            \
    row_tiles<4>(r0, r1, [&](auto rm, auto pf, int64_t r) {                                      \
      if (m == nullptr)                                                                          \
        q5_group<decltype(rm)::value, decltype(pf)::value, true>(qs, d, m, x, r, out + 8 * g, N);\
      else                                                                                       \
        q5_group<decltype(rm)::value, decltype(pf)::value, false>(qs, d, m, x, r, out + 8 * g, N);\
    });                                                                                          \
  }                                                                                              \
}                                                                                                \
}  /* namespace NS */                                                                            \
  static_assert(true)

// The block's integer sums, RM rows, on AVX2: products of 5-bit weights (below 32) and int8
// activations (within +-127) summed in int16 over two vectors (8 products per lane, at most
// 31496), then widened to int32: exact. (Functions templated on the vector J, not lambdas: a
// lambda would not inherit the target attribute.)
template <int J, int RM>
Q5_AVX2 inline void dot_avx2_vector(const uint8_t* qb, __m256i h, const QuantRows& x, int64_t r0,
                                    int64_t b, __m256i* pair, __m256i* isum) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i lo, hi;
  values_avx2<J>(qb, h, lo, hi);
#pragma GCC unroll 4
  for (int r = 0; r < RM; ++r) {
    const int8_t* xb = x.q + (r0 + r) * x.K + b * kBlock;
    const __m256i p =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(xb + 4 * J))),
                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(xb + 4 * J + 16))));
    if constexpr (J % 2 == 0) {
      pair[r] = p;
    } else {
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(pair[r], p), ones));
      keep(isum[r]);
    }
  }
}

template <int RM>
Q5_AVX2 inline void dot_avx2(const uint8_t* qb, __m256i h, const QuantRows& x, int64_t r0,
                             int64_t b, __m256i* isum) {
  __m256i pair[RM];
  dot_avx2_vector<0, RM>(qb, h, x, r0, b, pair, isum);
  dot_avx2_vector<1, RM>(qb, h, x, r0, b, pair, isum);
  dot_avx2_vector<2, RM>(qb, h, x, r0, b, pair, isum);
  dot_avx2_vector<3, RM>(qb, h, x, r0, b, pair, isum);
}

// vpdpbusd (VEX on AVX-VNNI, EVEX on AVX-512 VNNI + VL): products added straight into int32.
#define KV_Q5_DOT_VNNI(ATTR, NAME, VALUES, DPBUSD)                                               \
template <int J, int RM>                                                                         \
ATTR inline void NAME##_vector(const uint8_t* qb, __m256i h, const QuantRows& x, int64_t r0,     \
                               int64_t b, __m256i* isum) {                                       \
  __m256i lo, hi;                                                                                \
  VALUES<J>(qb, h, lo, hi);                                                                      \
_Pragma("GCC unroll 4")                                                                          \
  for (int r = 0; r < RM; ++r) {                                                                 \
    const int8_t* xb = x.q + (r0 + r) * x.K + b * kBlock;                                        \
    isum[r] = DPBUSD(isum[r], lo, _mm256_set1_epi32(load4(xb + 4 * J)));                         \
    isum[r] = DPBUSD(isum[r], hi, _mm256_set1_epi32(load4(xb + 4 * J + 16)));                    \
    asm("" : "+x"(isum[r]));                                                                     \
  }                                                                                              \
}                                                                                                \
                                                                                                 \
template <int RM>                                                                                \
ATTR inline void NAME(const uint8_t* qb, __m256i h, const QuantRows& x, int64_t r0, int64_t b,   \
                      __m256i* isum) {                                                           \
  NAME##_vector<0, RM>(qb, h, x, r0, b, isum);                                                   \
  NAME##_vector<1, RM>(qb, h, x, r0, b, isum);                                                   \
  NAME##_vector<2, RM>(qb, h, x, r0, b, isum);                                                   \
  NAME##_vector<3, RM>(qb, h, x, r0, b, isum);                                                   \
}                                                                                                \
  static_assert(true)

KV_Q5_DOT_VNNI(Q5_AVXVNNI, dot_vex, values_avx2, _mm256_dpbusd_avx_epi32);
KV_Q5_DOT_VNNI(Q5_VNNI512, dot_evex, values_evex, _mm256_dpbusd_epi32);


KV_Q5_YMM(Q5_AVX2, avx2, dot_avx2);
KV_Q5_YMM(Q5_AVXVNNI, vex, dot_vex);
KV_Q5_YMM(Q5_VNNI512, evex, dot_evex);

// ---------------------------------------------------------------- AVX-512 VNNI (zmm)

// Two column groups a, b side by side per zmm register (b == a for a lone last group, whose upper
// half is then not stored), 8-row tiles: the same integers and float sequence per lane as above.
constexpr int kRows512 = 8;
constexpr int64_t kFewRows = 8;  // calls of fewer rows run the ymm kernels (one weight stream)

Q5_VNNI512 inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

Q5_VNNI512 inline __m512 half_pair(const c10::Half* a, const c10::Half* b) {  // 8 + 8 fp16
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

struct Q5Pair {
  const uint8_t *qa, *qb;
  const c10::Half *da, *db, *ma, *mb;
  bool two;
};

// A pair's 5-bit weights unpacked once for all the row tiles of a panel (U below): per block b and
// vector j, the 64 bytes of q for k = 4j + i at un + (8 b + 2 j) * 64, those for k = 4j + 16 + i
// right after: the bytes q5_pair's nibble and fifth-bit steps make for every tile.
constexpr int64_t kUnpackRows = 2 * kRows512;  // rows from which a panel's tiles share them

// Vector j's 5-bit values of a block of the pair (qa, qb its 160 bytes, h its fifth-bit vector):
// lo for k = 4j + i, hi for k = 4j + 16 + i.
Q5_VNNI512 inline void values_q5(const uint8_t* qa, const uint8_t* qb, __m512i h, int j,
                                 __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  const __m512i v = load_pair(qa + 32 * j, qb + 32 * j);
  const __mmask64 kl = _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << (2 * j))));
  const __mmask64 kh =
      _mm512_test_epi8_mask(h, _mm512_set1_epi8(static_cast<char>(1 << (2 * j + 1))));
  const __m512i l4 = _mm512_and_si512(v, low);
  const __m512i h4 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  lo = _mm512_mask_add_epi8(l4, kl, l4, sixteen);
  hi = _mm512_mask_add_epi8(h4, kh, h4, sixteen);
}

Q5_VNNI512 void unpack_q5_pair(const Q5Pair& p, int64_t KB, uint8_t* un) {
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t *qa = p.qa + b * 160, *qb = p.qb + b * 160;
    const __m512i h = load_pair(qa + 128, qb + 128);
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      values_q5(qa, qb, h, j, lo, hi);
      _mm512_storeu_si512(un + (8 * b + 2 * j) * 64, lo);
      _mm512_storeu_si512(un + (8 * b + 2 * j + 1) * 64, hi);
    }
  }
}

template <int RM, bool PF, bool Q50, bool U = false>
Q5_VNNI512 void q5_pair(const Q5Pair& p, const QuantRows& x, int64_t r0, float* out, int64_t N,
                        const uint8_t* un = nullptr) {
  const int64_t KB = x.KB, K = x.K;
  __m512 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t *qa = p.qa + b * 160, *qb = p.qb + b * 160;
    if constexpr (PF) {
      for (int64_t off = 0; off < 160; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(qa + kPrefetch * 160 + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(qb + kPrefetch * 160 + off), _MM_HINT_T0);
      }
    }
    __m512i h = _mm512_setzero_si512();
    if constexpr (!U) h = load_pair(qa + 128, qb + 128);
    __m512i isum[RM];
    for (int r = 0; r < RM; ++r)
      isum[r] = Q50 ? _mm512_set1_epi32(x.n16[(r0 + r) * KB + b]) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      if constexpr (U) {
        lo = _mm512_loadu_si512(un + (8 * b + 2 * j) * 64);
        hi = _mm512_loadu_si512(un + (8 * b + 2 * j + 1) * 64);
      } else {
        values_q5(qa, qb, h, j, lo, hi);
      }
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r) {
        const int8_t* xb = x.q + (r0 + r) * K + b * kBlock;
        isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(load4(xb + 4 * j)));
        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(load4(xb + 4 * j + 16)));
        asm("" : "+v"(isum[r]));
      }
    }
    const __m512 dw = half_pair(p.da + b * 8, p.db + b * 8);
    __m512 mw = _mm512_setzero_ps();
    if constexpr (!Q50) mw = half_pair(p.ma + b * 8, p.mb + b * 8);
#pragma GCC unroll 8
    for (int r = 0; r < RM; ++r) {
      const __m512 dx = _mm512_set1_ps(x.d[(r0 + r) * KB + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum[r]), acc[r]);
      if constexpr (!Q50)
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[(r0 + r) * KB + b]), acc[r]);
    }
  }
  for (int r = 0; r < RM; ++r) {
    if (p.two)
      _mm512_storeu_ps(out + (r0 + r) * N, acc[r]);
    else
      _mm256_storeu_ps(out + (r0 + r) * N, _mm512_castps512_ps256(acc[r]));
  }
}

Q5_VNNI512 void q5_pairs(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1,
                         int64_t g0, int64_t g1, int64_t N, float* out) {
  const int64_t qstride = x.KB * 160, sstride = x.KB * 8;
  const bool unpack = r1 - r0 >= kUnpackRows;
  thread_local std::vector<uint8_t> un;
  if (unpack) un.resize(x.KB * 512);
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two = g + 1 < g1;
    const int64_t h = two ? g + 1 : g;
    const Q5Pair p{w.qs + g * qstride, w.qs + h * qstride, w.d + g * sstride, w.d + h * sstride,
                   w.m ? w.m + g * sstride : nullptr, w.m ? w.m + h * sstride : nullptr, two};
    if (unpack) unpack_q5_pair(p, x.KB, un.data());
    row_tiles<kRows512>(r0, r1, [&](auto rm, auto pf, int64_t r) {
      constexpr int R = decltype(rm)::value;
      if (unpack) {  // the weights already read: nothing to ask for ahead
        if (p.ma == nullptr)
          q5_pair<R, false, true, true>(p, x, r, out + 8 * g, N, un.data());
        else
          q5_pair<R, false, false, true>(p, x, r, out + 8 * g, N, un.data());
      } else if (p.ma == nullptr) {
        q5_pair<R, decltype(pf)::value, true>(p, x, r, out + 8 * g, N);
      } else {
        q5_pair<R, decltype(pf)::value, false>(p, x, r, out + 8 * g, N);
      }
    });
  }
}

}  // namespace

namespace kvblock {

void q5_groups_avx2(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                    int64_t g1, int64_t N, float* out) {
  avx2::q5_groups(w, x, r0, r1, g0, g1, N, out);
}

void q5_groups_avxvnni(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                       int64_t g1, int64_t N, float* out) {
  vex::q5_groups(w, x, r0, r1, g0, g1, N, out);
}

void q5_groups_avx512vnni(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1,
                          int64_t g0, int64_t g1, int64_t N, float* out) {
  if (r1 - r0 < kFewRows) return evex::q5_groups(w, x, r0, r1, g0, g1, N, out);
  q5_pairs(w, x, r0, r1, g0, g1, N, out);
}

}  // namespace kvblock

#endif

// ---------------------------------------------------------------- the op

namespace {

using kvblock::kBlock;
using kvblock::QuantRows;

// Q5 blocks (block_matmul.h's Q5Weight): qs uint8 [N/8, K/32, 5, 32], d fp16 [N/8, K/32, 8], m
// the same (Q5_1) or empty (Q5_0: the sums take q - 16). Column groups split across threads (each output
// element wholly on one thread), rows in panels, as the q4 / q8 / K-quant ops.
at::Tensor q5_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == 5 && qs.size(3) == 32 &&
                  qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "q5_linear: qs must be uint8 [N/8, K/32, 5, 32]");
  const bool q5_0 = m.numel() == 0;
  for (const at::Tensor* t : {&d, &m}) {
    if (t == &m && q5_0) continue;
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == qs.size(0) && t->size(1) == qs.size(1) && t->size(2) == 8,
                "q5_linear: scales must be float16 [N/8, K/32, 8]");
  }
  const int64_t K = qs.size(1) * kBlock;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "q5_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "q5_linear: x has ", x.size(1), " features, the weight ", K);
  const at::Tensor xc = x.contiguous();
  kvblock::AnyWeight w;
  w.kind = kvblock::kWeightQ5, w.groups = qs.size(0), w.K = K;
  w.q5 = kvblock::Q5Weight{qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(),
                           q5_0 ? nullptr : m.data_ptr<c10::Half>()};
  return kvblock::block_linear(xc, w, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("q5_linear(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("q5_linear", q5_linear); }
