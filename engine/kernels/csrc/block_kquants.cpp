// The K-quant block kernels (GGUF Q4_K, Q5_K, Q6_K, super-blocks of 256 values), served as stored:
// the values' low 4 bits in the q4 layout of block_matmul.cpp (per block of 32 and group of 8
// columns, vector j's byte 4c + i holds column c's k = 4j + i in its low nibble and 4j + 16 + i in
// its high one), their higher bits in 1 (Q5_K) or 2 (Q6_K) more vectors after those 4 (see
// KWeight in block_matmul.h), and the super-block's scales as GGUF stores them, unpacked:
//   Q4_K / Q5_K: w = d * sc_b * q - dmin * m_b per block b of 32 (q in 0..15 / 0..31);
//   Q6_K:        w = d * sc_h * (q - 32) per half block h of 16 (q in 0..63, sc_h int8).
// d * sc and dmin * m are exact in float32 (an fp16 times an integer below 2^8), so these are
// gguf's dequantized weights bit for bit. Per output element, block by block, in this fixed order:
//   Q4_K / Q5_K: acc = fma(d sc_b * d_x, isum_b, acc); acc = fma(-(dmin m_b), s_x, acc)
//   Q6_K:        t = sc_lo (ilo - 32 hx_lo) + sc_hi (ihi - 32 hx_hi) (exact int32, |t| < 2^24);
//                acc = fma(d * d_x, t, acc)
// with isum / ilo / ihi the exact integer dot products of the weights' unsigned q with the int8
// activations and hx the activations' integer sums per half block. Every path computes the same
// integers and the same float sequence, so all give the same bits, alone or in any batch.
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_matmul.h"

namespace kvblock {

// ---------------------------------------------------------------- portable reference loops

namespace {

// Column c's value k (0..31) of block b of a group's interleaved block at `qb`.
inline int32_t kvalue(const uint8_t* qb, int bits, int c, int k) {
  const int half = k / 16, j = (k % 16) / 4, i = k % 4;
  const uint8_t byte = qb[32 * j + 4 * c + i];
  int32_t v = half ? byte >> 4 : byte & 0x0F;
  if (bits == 5) v |= ((qb[128 + 4 * c + i] >> (2 * j + half)) & 1) << 4;
  if (bits == 6) v |= ((qb[128 + 32 * (j / 2) + 4 * c + i] >> (4 * (j % 2) + 2 * half)) & 3) << 4;
  return v;
}

}  // namespace

void kq_groups_ref(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                   int64_t g1, int64_t N, float* out) {
  const int64_t planes = 4 + (w.bits - 4);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < 8; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < x.KB; ++b) {
          const uint8_t* qb = w.qs + (g * x.KB + b) * planes * 32;
          const int8_t* xb = x.q + r * x.K + b * kBlock;
          const uint8_t* sc = w.sc + (g * x.KB + b) * 16;
          const c10::Half* dm = w.dm + (g * (x.KB / 8) + b / 8) * 16;
          int32_t isum[2] = {0, 0};
          for (int k = 0; k < 32; ++k) isum[k / 16] += kvalue(qb, w.bits, c, k) * xb[k];
          const float d = static_cast<float>(dm[c]), dx = x.d[r * x.KB + b];
          if (w.bits == 6) {
            const int32_t* hx = x.h + r * 2 * x.KB + 2 * b;
            const int32_t t = static_cast<int8_t>(sc[c]) * (isum[0] - 32 * hx[0]) +
                              static_cast<int8_t>(sc[8 + c]) * (isum[1] - 32 * hx[1]);
            acc = std::fma(d * dx, static_cast<float>(t), acc);
          } else {
            const float scale = d * static_cast<float>(sc[c]);
            const float mn = static_cast<float>(dm[8 + c]) * static_cast<float>(sc[8 + c]);
            acc = std::fma(scale * dx, static_cast<float>(isum[0] + isum[1]), acc);
            acc = std::fma(-mn, x.s[r * x.KB + b], acc);
          }
        }
        out[r * N + 8 * g + c] = acc;
      }
}

}  // namespace kvblock

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#define KQ_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KQ_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define KQ_VNNI512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

namespace {

using kvblock::kBlock;
using kvblock::KWeight;
using kvblock::QuantRows;

constexpr int64_t kPrefetch = 8;  // blocks ahead (the ymm kernels)
// The zmm kernels stream two column groups from two places at once: each stream asks for its
// weights 8 KB ahead, as the Q4/Q8 zmm kernels (block_matmul_vnni.cpp). Against 8 blocks (1-1.5 KB)
// ahead, a Llama-shaped step's Q4_K/Q6_K matmuls on 2 threads: 0.87x the time at 8 rows, 0.95x at 32.
constexpr int64_t kAheadBytes512 = 8192;

inline int32_t load4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// u8 x s8 products, 4 per 32-bit lane, added to acc: AVX2 in two steps (pairs in int16, exact for
// weights below 64 and activations within +-127, then pairs of pairs in int32), VNNI in one.
KQ_AVX2 inline __m256i dot_avx2(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
}

// Rows [r0, r1) in tiles of up to RMAX rows, as block_matmul_vnni.cpp's row_tiles.
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

constexpr int kRows = 4;  // rows per tile

// One group of 8 columns per ymm register, RM rows; BITS 4, 5 or 6. Written once, compiled for
// AVX2 (dot_avx2), AVX-VNNI (VEX vpdpbusd) and AVX-512 VNNI + VL (EVEX vpdpbusd on ymm).
#define KV_KQUANT_KERNELS(ATTR, DOT)                                                              \
ATTR inline void keep(__m256i& v) { asm("" : "+x"(v)); }                                          \
                                                                                                  \
ATTR inline __m256 load_half8(const c10::Half* p) {                                               \
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));                   \
}                                                                                                 \
                                                                                                  \
ATTR inline __m256i load8(const uint8_t* p) {  /* 8 bytes -> 8 int32 lanes (zero-extended) */     \
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));              \
}                                                                                                 \
                                                                                                  \
ATTR inline __m256i load8s(const uint8_t* p) {  /* 8 int8 -> 8 int32 lanes (sign-extended) */     \
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));              \
}                                                                                                 \
                                                                                                  \
/* Vector j's low-half and high-half values of a block (bytes 0..63), from its planes. */         \
template <int BITS>                                                                               \
ATTR inline void values(const uint8_t* qb, int j, __m256i& lo, __m256i& hi) {                     \
  const __m256i low = _mm256_set1_epi8(0x0F);                                                     \
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 32 * j));            \
  lo = _mm256_and_si256(v, low);                                                                  \
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                                            \
  if constexpr (BITS == 5) {                                                                      \
    const __m256i one = _mm256_set1_epi8(1);                                                      \
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 128));             \
    const __m256i bl = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j)), one);      \
    const __m256i bh = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * j + 1)), one);  \
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(bl, 4));                                           \
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(bh, 4));                                           \
  } else if constexpr (BITS == 6) {                                                               \
    const __m256i three = _mm256_set1_epi8(3);                                                    \
    const __m256i h =                                                                             \
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 128 + 32 * (j / 2)));            \
    const int sh = 4 * (j % 2);                                                                   \
    const __m256i bl = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(sh)), three);       \
    const __m256i bh = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(sh + 2)), three);   \
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(bl, 4));                                           \
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(bh, 4));                                           \
  }                                                                                               \
}                                                                                                 \
                                                                                                  \
template <int BITS, int RM, bool PF>                                                              \
ATTR void kq_group(const uint8_t* qs, const uint8_t* sc, const c10::Half* dm,                     \
                   const QuantRows& x, int64_t r0, float* out, int64_t N) {                       \
  constexpr int64_t P = BITS;  /* 4 + BITS - 4 vectors of 32 bytes per block */                   \
  constexpr bool Q6 = BITS == 6;                                                                  \
  const int64_t KB = x.KB, K = x.K;                                                               \
  __m256 acc[RM];                                                                                 \
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();                                      \
  for (int64_t b = 0; b < KB; ++b) {                                                              \
    const uint8_t* qb = qs + b * P * 32;                                                          \
    if constexpr (PF) {                                                                           \
      const char* p = reinterpret_cast<const char*>(qb + kPrefetch * P * 32);                     \
      for (int64_t off = 0; off < P * 32; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);          \
      _mm_prefetch(reinterpret_cast<const char*>(sc + (b + kPrefetch) * 16), _MM_HINT_T0);        \
    }                                                                                             \
    __m256i ilo[RM], ihi[RM];                                                                     \
    for (int r = 0; r < RM; ++r) ilo[r] = _mm256_setzero_si256(), ihi[r] = ilo[r];                \
_Pragma("GCC unroll 4")                                                                           \
    for (int j = 0; j < 4; ++j) {                                                                 \
      __m256i lo, hi;                                                                             \
      values<BITS>(qb, j, lo, hi);                                                                \
_Pragma("GCC unroll 4")                                                                           \
      for (int r = 0; r < RM; ++r) {                                                              \
        const int8_t* xb = x.q + (r0 + r) * K + b * kBlock;                                       \
        ilo[r] = DOT(ilo[r], lo, _mm256_set1_epi32(load4(xb + 4 * j)));                           \
        keep(ilo[r]);                                                                             \
        if constexpr (Q6) {                                                                       \
          ihi[r] = DOT(ihi[r], hi, _mm256_set1_epi32(load4(xb + 4 * j + 16)));                    \
          keep(ihi[r]);                                                                           \
        } else {                                                                                  \
          ilo[r] = DOT(ilo[r], hi, _mm256_set1_epi32(load4(xb + 4 * j + 16)));                    \
          keep(ilo[r]);                                                                           \
        }                                                                                         \
      }                                                                                           \
    }                                                                                             \
    const __m256 d = load_half8(dm + (b / 8) * 16);                                               \
    if constexpr (Q6) {                                                                           \
      const __m256i slo = load8s(sc + b * 16), shi = load8s(sc + b * 16 + 8);                     \
_Pragma("GCC unroll 4")                                                                           \
      for (int r = 0; r < RM; ++r) {                                                              \
        const int32_t* hx = x.h + (r0 + r) * 2 * KB + 2 * b;                                      \
        const __m256i lo = _mm256_sub_epi32(ilo[r], _mm256_set1_epi32(32 * hx[0]));               \
        const __m256i hi = _mm256_sub_epi32(ihi[r], _mm256_set1_epi32(32 * hx[1]));               \
        const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(slo, lo),                           \
                                           _mm256_mullo_epi32(shi, hi));                          \
        const __m256 dx = _mm256_set1_ps(x.d[(r0 + r) * KB + b]);                                 \
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(t), acc[r]);            \
      }                                                                                           \
    } else {                                                                                      \
      const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(load8(sc + b * 16)));              \
      const __m256 mn = _mm256_mul_ps(load_half8(dm + (b / 8) * 16 + 8),                          \
                                      _mm256_cvtepi32_ps(load8(sc + b * 16 + 8)));                \
_Pragma("GCC unroll 4")                                                                           \
      for (int r = 0; r < RM; ++r) {                                                              \
        const __m256 dx = _mm256_set1_ps(x.d[(r0 + r) * KB + b]);                                 \
        const __m256 sx = _mm256_set1_ps(x.s[(r0 + r) * KB + b]);                                 \
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx), _mm256_cvtepi32_ps(ilo[r]), acc[r]);   \
        acc[r] = _mm256_fnmadd_ps(mn, sx, acc[r]);                                                \
      }                                                                                           \
    }                                                                                             \
  }                                                                                               \
  for (int r = 0; r < RM; ++r) _mm256_storeu_ps(out + (r0 + r) * N, acc[r]);                      \
}                                                                                                 \
                                                                                                  \
template <int BITS>                                                                               \
ATTR void kq_groups_bits(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1,            \
                         int64_t g0, int64_t g1, int64_t N, float* out) {                         \
  for (int64_t g = g0; g < g1; ++g) {                                                             \
    const uint8_t* qs = w.qs + g * x.KB * BITS * 32;                                              \
    const uint8_t* sc = w.sc + g * x.KB * 16;                                                     \
    const c10::Half* dm = w.dm + g * (x.KB / 8) * 16;                                             \
    row_tiles<kRows>(r0, r1, [&](auto rm, auto pf, int64_t r) {                                   \
      kq_group<BITS, decltype(rm)::value, decltype(pf)::value>(qs, sc, dm, x, r, out + 8 * g, N); \
    });                                                                                           \
  }                                                                                               \
}                                                                                                 \
                                                                                                  \
ATTR void kq_groups(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,     \
                    int64_t g1, int64_t N, float* out) {                                          \
  if (w.bits == 4) return kq_groups_bits<4>(w, x, r0, r1, g0, g1, N, out);                        \
  if (w.bits == 5) return kq_groups_bits<5>(w, x, r0, r1, g0, g1, N, out);                        \
  kq_groups_bits<6>(w, x, r0, r1, g0, g1, N, out);                                                \
}                                                                                                 \
  static_assert(true)

namespace avx2 {
KV_KQUANT_KERNELS(KQ_AVX2, dot_avx2);
}  // namespace avx2

namespace vex {
KV_KQUANT_KERNELS(KQ_AVXVNNI, _mm256_dpbusd_avx_epi32);
}  // namespace vex

namespace evex {
KV_KQUANT_KERNELS(KQ_VNNI512, _mm256_dpbusd_epi32);
}  // namespace evex

// ---------------------------------------------------------------- AVX-512 VNNI (zmm)

// Two column groups a, b side by side per zmm register (b == a for a lone last group, whose upper
// half is then not stored), 8-row tiles: the same integers and float sequence per lane as above.
constexpr int kRows512 = 8;
constexpr int64_t kFewRows = 8;  // calls of fewer rows run the ymm kernels (one weight stream)

KQ_VNNI512 inline void keep512(__m512i& v) { asm("" : "+v"(v)); }

KQ_VNNI512 inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {  // 32 bytes of each
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

KQ_VNNI512 inline __m512 half_pair(const c10::Half* a, const c10::Half* b) {  // 8 + 8 fp16
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

KQ_VNNI512 inline __m128i bytes_pair(const uint8_t* a, const uint8_t* b) {  // 8 + 8 bytes
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}

template <int BITS>
KQ_VNNI512 inline void values512(const uint8_t* qa, const uint8_t* qb, int j, __m512i& lo,
                                 __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i v = load_pair(qa + 32 * j, qb + 32 * j);
  lo = _mm512_and_si512(v, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  if constexpr (BITS == 5) {
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i h = load_pair(qa + 128, qb + 128);
    const __m512i bl = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * j)), one);
    const __m512i bh = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * j + 1)), one);
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(bl, 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi16(bh, 4));
  } else if constexpr (BITS == 6) {
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i h = load_pair(qa + 128 + 32 * (j / 2), qb + 128 + 32 * (j / 2));
    const int sh = 4 * (j % 2);
    const __m512i bl = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(sh)), three);
    const __m512i bh = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(sh + 2)), three);
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(bl, 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi16(bh, 4));
  }
}

struct KPair {
  const uint8_t *qa, *qb, *sa, *sb;
  const c10::Half *da, *db;
  bool two;
};

template <int BITS, int RM, bool PF>
KQ_VNNI512 void kq_pair(const KPair& p, const QuantRows& x, int64_t r0, float* out, int64_t N) {
  constexpr int64_t P = BITS;
  constexpr bool Q6 = BITS == 6;
  const int64_t KB = x.KB, K = x.K;
  __m512 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t *qa = p.qa + b * P * 32, *qb = p.qb + b * P * 32;
    if constexpr (PF) {
      constexpr int64_t ahead = kAheadBytes512 / (P * 32) * (P * 32);  // whole blocks
      for (int64_t off = 0; off < P * 32; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(qa + ahead + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(qb + ahead + off), _MM_HINT_T0);
      }
    }
    __m512i ilo[RM], ihi[RM];
    for (int r = 0; r < RM; ++r) ilo[r] = _mm512_setzero_si512(), ihi[r] = ilo[r];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      values512<BITS>(qa, qb, j, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r) {
        const int8_t* xb = x.q + (r0 + r) * K + b * kBlock;
        ilo[r] = _mm512_dpbusd_epi32(ilo[r], lo, _mm512_set1_epi32(load4(xb + 4 * j)));
        keep512(ilo[r]);
        if constexpr (Q6) {
          ihi[r] = _mm512_dpbusd_epi32(ihi[r], hi, _mm512_set1_epi32(load4(xb + 4 * j + 16)));
          keep512(ihi[r]);
        } else {
          ilo[r] = _mm512_dpbusd_epi32(ilo[r], hi, _mm512_set1_epi32(load4(xb + 4 * j + 16)));
          keep512(ilo[r]);
        }
      }
    }
    const int64_t s = (b / 8) * 16;
    const __m512 d = half_pair(p.da + s, p.db + s);
    const uint8_t *sa = p.sa + b * 16, *sb = p.sb + b * 16;
    if constexpr (Q6) {
      const __m512i slo = _mm512_cvtepi8_epi32(bytes_pair(sa, sb));
      const __m512i shi = _mm512_cvtepi8_epi32(bytes_pair(sa + 8, sb + 8));
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r) {
        const int32_t* hx = x.h + (r0 + r) * 2 * KB + 2 * b;
        const __m512i lo = _mm512_sub_epi32(ilo[r], _mm512_set1_epi32(32 * hx[0]));
        const __m512i hi = _mm512_sub_epi32(ihi[r], _mm512_set1_epi32(32 * hx[1]));
        const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(slo, lo), _mm512_mullo_epi32(shi, hi));
        const __m512 dx = _mm512_set1_ps(x.d[(r0 + r) * KB + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(t), acc[r]);
      }
    } else {
      const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes_pair(sa, sb))));
      const __m512 mn = _mm512_mul_ps(half_pair(p.da + s + 8, p.db + s + 8),
                                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes_pair(sa + 8, sb + 8))));
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r) {
        const __m512 dx = _mm512_set1_ps(x.d[(r0 + r) * KB + b]);
        const __m512 sx = _mm512_set1_ps(x.s[(r0 + r) * KB + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, dx), _mm512_cvtepi32_ps(ilo[r]), acc[r]);
        acc[r] = _mm512_fnmadd_ps(mn, sx, acc[r]);
      }
    }
  }
  for (int r = 0; r < RM; ++r) {
    if (p.two)
      _mm512_storeu_ps(out + (r0 + r) * N, acc[r]);
    else
      _mm256_storeu_ps(out + (r0 + r) * N, _mm512_castps512_ps256(acc[r]));
  }
}

template <int BITS>
KQ_VNNI512 void kq_pairs(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                         int64_t g1, int64_t N, float* out) {
  const int64_t qstride = x.KB * BITS * 32, sstride = x.KB * 16, dstride = (x.KB / 8) * 16;
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two = g + 1 < g1;
    const int64_t h = two ? g + 1 : g;
    const KPair p{w.qs + g * qstride, w.qs + h * qstride, w.sc + g * sstride,
                  w.sc + h * sstride, w.dm + g * dstride, w.dm + h * dstride, two};
    row_tiles<kRows512>(r0, r1, [&](auto rm, auto pf, int64_t r) {
      kq_pair<BITS, decltype(rm)::value, decltype(pf)::value>(p, x, r, out + 8 * g, N);
    });
  }
}

}  // namespace

namespace kvblock {

void kq_groups_avx2(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                    int64_t g1, int64_t N, float* out) {
  avx2::kq_groups(w, x, r0, r1, g0, g1, N, out);
}

void kq_groups_avxvnni(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                       int64_t g1, int64_t N, float* out) {
  vex::kq_groups(w, x, r0, r1, g0, g1, N, out);
}

void kq_groups_avx512vnni(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                          int64_t g0, int64_t g1, int64_t N, float* out) {
  if (r1 - r0 < kFewRows) return evex::kq_groups(w, x, r0, r1, g0, g1, N, out);
  if (w.bits == 4) return kq_pairs<4>(w, x, r0, r1, g0, g1, N, out);
  if (w.bits == 5) return kq_pairs<5>(w, x, r0, r1, g0, g1, N, out);
  kq_pairs<6>(w, x, r0, r1, g0, g1, N, out);
}

}  // namespace kvblock

#endif
