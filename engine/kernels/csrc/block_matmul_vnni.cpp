// The VNNI block kernels: vpdpbusd (u8 x s8 products, 4 per 32-bit lane, added to an int32 lane)
// on zmm (AVX-512 VNNI, two column groups side by side per register) and on ymm (AVX-VNNI, one
// group). q4's 4-bit weights are the unsigned operand as they are; for q8 the activations are the
// unsigned one, offset by +128 (QuantRows::u), and 128 * sum(w) is taken off after each block, so
// every block's integer sum is exact and equal to the other paths'; the float combination per
// lane is block_matmul.h's fixed order, so all paths give the same bits.
#include "block_matmul.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define KV_VNNI512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KV_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

namespace {

using kvblock::BlockWeight;
using kvblock::kBlock;
using kvblock::QuantRows;

constexpr int64_t kPrefetch = 16;  // blocks ahead (the ymm kernels), as the AVX2 kernels
// The zmm kernels stream two column groups at once, each from its own place: each stream asks for
// its weights 8 KB ahead (64 q4 / 32 q8 blocks). Against 16 blocks ahead, a decode step's matmuls
// at 8 rows on 2 threads (AVX-512 EPYC, interleaved in one process): q4 0.83x the time, q8 0.94x,
// the Q8_0 lm_head 0.88-0.94x; 16 and 32 rows 0.90-1.0x; 4 KB and 16 KB ahead in between.
constexpr int64_t kAheadBytes512 = 8192;

inline int32_t load4(const void* p) {  // 4 activation bytes as one 32-bit lane value
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rows [r0, r1) in tiles of up to RMAX rows, each tile one call of f(rows, prefetch, first row);
// the tile of row 0 streams the weights from memory (and prefetches), later tiles find them in
// cache. Tiles only decide which rows share a loaded weight vector, never a value.
template <int R, typename F>
inline void tile(int64_t n, bool first, int64_t r, F& f) {
  if constexpr (R > 1) {
    if (n < R) return tile<R - 1>(n, first, r, f);
  }
  using std::integral_constant;
  first ? f(integral_constant<int, R>{}, std::true_type{}, r)
        : f(integral_constant<int, R>{}, std::false_type{}, r);
}

template <int RMAX, typename F>
inline void row_tiles(int64_t r0, int64_t r1, F&& f) {
  for (int64_t r = r0; r < r1; r += RMAX) tile<RMAX>(std::min<int64_t>(RMAX, r1 - r), r == 0, r, f);
}

// ---------------------------------------------------------------- AVX-512 VNNI (zmm)

constexpr int kRows512 = kvblock::kPackRows;  // rows per tile: 2 x 8 accumulators fit in 32 zmm
constexpr int64_t kFewRows = 8;  // calls of fewer rows run the ymm kernels (one weight stream)

KV_VNNI512 inline void keep512(__m512i& v) { asm("" : "+v"(v)); }

KV_VNNI512 inline __m512i load_pair(const void* a, const void* b) {  // 32 bytes of each group
  const __m256i lo = _mm256_loadu_si256(static_cast<const __m256i*>(a));
  const __m256i hi = _mm256_loadu_si256(static_cast<const __m256i*>(b));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

KV_VNNI512 inline __m512 load_half_pair(const c10::Half* a, const c10::Half* b) {  // 8 + 8 fp16
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

KV_VNNI512 inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

// Two column groups a, b (b == a for a lone last group, whose upper half is then not stored).
struct Pair {
  const void* qa;
  const void* qb;
  const c10::Half *da, *db, *ma, *mb;
  bool two;
};

KV_VNNI512 inline void store_pair(float* out, __m512 v, bool two) {
  if (two)
    _mm512_storeu_ps(out, v);
  else
    _mm256_storeu_ps(out, _mm512_castps512_ps256(v));
}

// RM rows x 16 columns, q4: per block 8 vpdpbusd per row (low and high nibbles), then per lane
// acc = fma(d_w d_x, sum, acc) and acc = fma(m_w, s_x, acc); Q4_0 (Q40) starts each sum at n8 (the
// dot product with q - 8) and has no second fma.
template <int RM, bool PF, bool Q40>
KV_VNNI512 void q4_pair(const Pair& p, const QuantRows& x, int64_t r0, float* out, int64_t N) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t KB = x.KB, K = x.K;
  const uint8_t* qa = static_cast<const uint8_t*>(p.qa);
  const uint8_t* qb = static_cast<const uint8_t*>(p.qb);
  const int8_t* xt = reinterpret_cast<const int8_t*>(x.pk) + r0 * K;  // this tile, packed
  const float *dt = x.pd + r0 * KB, *st = x.ps + r0 * KB;
  const int32_t* nt = Q40 ? x.pn8 + r0 * KB : nullptr;
  __m512 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t *wa = qa + b * 128, *wb = qb + b * 128;
    if constexpr (PF) {
      constexpr int64_t ahead = kAheadBytes512 / 128;
      prefetch(wa + ahead * 128, 128), prefetch(wb + ahead * 128, 128);
      prefetch(p.da + (b + ahead) * 8, 16), prefetch(p.db + (b + ahead) * 8, 16);
      if constexpr (!Q40)
        prefetch(p.ma + (b + ahead) * 8, 16), prefetch(p.mb + (b + ahead) * 8, 16);
    }
    __m512i isum[RM];
    for (int r = 0; r < RM; ++r)
      isum[r] = Q40 ? _mm512_set1_epi32(nt[b * RM + r]) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = load_pair(wa + 32 * j, wb + 32 * j);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r) {
        const int8_t* xb = xt + (b * RM + r) * kBlock;
        isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(load4(xb + 4 * j)));
        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(load4(xb + 4 * j + 16)));
        keep512(isum[r]);
      }
    }
    const __m512 dw = load_half_pair(p.da + b * 8, p.db + b * 8);
    __m512 mw = _mm512_setzero_ps();
    if constexpr (!Q40) mw = load_half_pair(p.ma + b * 8, p.mb + b * 8);
#pragma GCC unroll 8
    for (int r = 0; r < RM; ++r) {
      const __m512 dx = _mm512_set1_ps(dt[b * RM + r]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum[r]), acc[r]);
      if constexpr (!Q40) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(st[b * RM + r]), acc[r]);
    }
  }
  for (int r = 0; r < RM; ++r) store_pair(out + (r0 + r) * N, acc[r], p.two);
}

// RM rows x 16 columns, q8: (x + 128) as u8 times w as s8, 8 vpdpbusd per row and block, minus
// 128 * sum(w) (one more vpdpbusd per vector, shared by the rows); then acc = fma(d_w d_x, sum, acc).
template <int RM, bool PF>
KV_VNNI512 void q8_pair(const Pair& p, const QuantRows& x, int64_t r0, float* out, int64_t N) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t KB = x.KB, K = x.K;
  const int8_t* qa = static_cast<const int8_t*>(p.qa);
  const int8_t* qb = static_cast<const int8_t*>(p.qb);
  const uint8_t* xt = x.pk + r0 * K;  // this tile's u, packed
  const float* dt = x.pd + r0 * KB;
  __m512 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const int8_t *wa = qa + b * 256, *wb = qb + b * 256;
    if constexpr (PF) {
      constexpr int64_t ahead = kAheadBytes512 / 256;
      prefetch(wa + ahead * 256, 256), prefetch(wb + ahead * 256, 256);
      prefetch(p.da + (b + ahead) * 8, 16), prefetch(p.db + (b + ahead) * 8, 16);
    }
    __m512i isum[RM];
    for (int r = 0; r < RM; ++r) isum[r] = _mm512_setzero_si512();
    __m512i wsum = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i w = load_pair(wa + 32 * j, wb + 32 * j);
      wsum = _mm512_dpbusd_epi32(wsum, ones, w);
#pragma GCC unroll 8
      for (int r = 0; r < RM; ++r) {
        const uint8_t* xb = xt + (b * RM + r) * kBlock;
        isum[r] = _mm512_dpbusd_epi32(isum[r], _mm512_set1_epi32(load4(xb + 4 * j)), w);
        keep512(isum[r]);
      }
    }
    const __m512i offset = _mm512_slli_epi32(wsum, 7);
    const __m512 dw = load_half_pair(p.da + b * 8, p.db + b * 8);
#pragma GCC unroll 8
    for (int r = 0; r < RM; ++r) {
      const __m512 dx = _mm512_set1_ps(dt[b * RM + r]);
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], offset));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), sum, acc[r]);
    }
  }
  for (int r = 0; r < RM; ++r) store_pair(out + (r0 + r) * N, acc[r], p.two);
}

template <bool Q4>
KV_VNNI512 void groups_512(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                           int64_t g0, int64_t g1, int64_t N, float* out) {
  const int64_t bytes = x.KB * (Q4 ? 128 : 256), scales = x.KB * 8;
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two = g + 1 < g1;
    const int64_t h = two ? g + 1 : g;
    const void* base = Q4 ? static_cast<const void*>(w.q4) : static_cast<const void*>(w.q8);
    const char* q = static_cast<const char*>(base);
    const Pair p{q + g * bytes,          q + h * bytes,
                 w.d + g * scales,       w.d + h * scales,
                 Q4 && w.m != nullptr ? w.m + g * scales : nullptr,
                 Q4 && w.m != nullptr ? w.m + h * scales : nullptr,
                 two};
    row_tiles<kRows512>(r0, r1, [&](auto rm, auto pf, int64_t r) {
      constexpr int R = decltype(rm)::value;
      constexpr bool F = decltype(pf)::value;
      if constexpr (Q4) {
        if (p.ma == nullptr)
          q4_pair<R, F, true>(p, x, r, out + 8 * g, N);
        else
          q4_pair<R, F, false>(p, x, r, out + 8 * g, N);
      } else {
        q8_pair<R, F>(p, x, r, out + 8 * g, N);
      }
    });
  }
}

// ---------------------------------------------------------------- ymm: AVX-VNNI and AVX-512 VNNI

// One column group per ymm register, written once and compiled twice: with the VEX vpdpbusd of
// AVX-VNNI, and with the EVEX one of AVX-512 VNNI + VL, which the zmm path uses for calls of few
// rows (there two groups per zmm only add a second weight stream: slower at 1 row, measured).
constexpr int kRows256 = 4;  // rows per tile: 2 x 4 accumulators + weights fit in 16 ymm

#define KV_YMM_KERNELS(ATTR, DP) \
ATTR inline void keep256(__m256i& v) { asm("" : "+x"(v)); }                                         \
                                                                                                    \
ATTR inline __m256 load_half8(const c10::Half* p) {                                                 \
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));                     \
}                                                                                                   \
                                                                                                    \
ATTR inline void prefetch256(const void* p, int64_t bytes) {                                        \
  for (int64_t off = 0; off < bytes; off += 64)                                                     \
    _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);                                   \
}                                                                                                   \
                                                                                                    \
template <int RM, bool PF, bool Q40>                                                                \
ATTR void q4_group(const uint8_t* qs, const c10::Half* wd, const c10::Half* wm,                     \
                         const QuantRows& x, int64_t r0, float* out, int64_t N) {                   \
  const __m256i low = _mm256_set1_epi8(0x0F);                                                       \
  const int64_t KB = x.KB, K = x.K;                                                                 \
  const int32_t* n8 = Q40 ? x.n8 : nullptr;                                                         \
  __m256 acc[RM];                                                                                   \
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();                                        \
  for (int64_t b = 0; b < KB; ++b) {                                                                \
    const uint8_t* wb = qs + b * 128;                                                               \
    if constexpr (PF) {                                                                             \
      prefetch256(wb + kPrefetch * 128, 128);                                                       \
      prefetch256(wd + (b + kPrefetch) * 8, 16);                                                    \
      if constexpr (!Q40) prefetch256(wm + (b + kPrefetch) * 8, 16);                                \
    }                                                                                               \
    __m256i isum[RM];                                                                               \
    for (int r = 0; r < RM; ++r)                                                                    \
      isum[r] = Q40 ? _mm256_set1_epi32(n8[(r0 + r) * KB + b]) : _mm256_setzero_si256();            \
_Pragma("GCC unroll 4")                                                                             \
    for (int j = 0; j < 4; ++j) {                                                                   \
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));          \
      const __m256i lo = _mm256_and_si256(v, low);                                                  \
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                            \
_Pragma("GCC unroll 4")                                                                             \
      for (int r = 0; r < RM; ++r) {                                                                \
        const int8_t* xb = x.q + (r0 + r) * K + b * kBlock;                                         \
        isum[r] = DP(isum[r], lo, _mm256_set1_epi32(load4(xb + 4 * j)));                            \
        isum[r] = DP(isum[r], hi, _mm256_set1_epi32(load4(xb + 4 * j + 16)));                       \
        keep256(isum[r]);                                                                           \
      }                                                                                             \
    }                                                                                               \
    const __m256 dw = load_half8(wd + b * 8);                                                       \
    __m256 mw = _mm256_setzero_ps();                                                                \
    if constexpr (!Q40) mw = load_half8(wm + b * 8);                                                \
_Pragma("GCC unroll 4")                                                                             \
    for (int r = 0; r < RM; ++r) {                                                                  \
      const __m256 dx = _mm256_set1_ps(x.d[(r0 + r) * KB + b]);                                     \
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[r]), acc[r]);         \
      if constexpr (!Q40)                                                                           \
        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[(r0 + r) * KB + b]), acc[r]);               \
    }                                                                                               \
  }                                                                                                 \
  for (int r = 0; r < RM; ++r) _mm256_storeu_ps(out + (r0 + r) * N, acc[r]);                        \
}                                                                                                   \
                                                                                                    \
template <int RM, bool PF>                                                                          \
ATTR void q8_group(const int8_t* qs, const c10::Half* wd, const QuantRows& x, int64_t r0,           \
                         float* out, int64_t N) {                                                   \
  const __m256i ones = _mm256_set1_epi8(1);                                                         \
  const int64_t KB = x.KB, K = x.K;                                                                 \
  __m256 acc[RM];                                                                                   \
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();                                        \
  for (int64_t b = 0; b < KB; ++b) {                                                                \
    const int8_t* wb = qs + b * 256;                                                                \
    if constexpr (PF) prefetch256(wb + kPrefetch * 256, 256), prefetch256(wd + (b + kPrefetch) * 8, 16); \
    __m256i isum[RM];                                                                               \
    for (int r = 0; r < RM; ++r) isum[r] = _mm256_setzero_si256();                                  \
    __m256i wsum = _mm256_setzero_si256();                                                          \
_Pragma("GCC unroll 8")                                                                             \
    for (int j = 0; j < 8; ++j) {                                                                   \
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));          \
      wsum = DP(wsum, ones, w);                                                                     \
_Pragma("GCC unroll 4")                                                                             \
      for (int r = 0; r < RM; ++r) {                                                                \
        const uint8_t* xb = x.u + (r0 + r) * K + b * kBlock;                                        \
        isum[r] = DP(isum[r], _mm256_set1_epi32(load4(xb + 4 * j)), w);                             \
        keep256(isum[r]);                                                                           \
      }                                                                                             \
    }                                                                                               \
    const __m256i offset = _mm256_slli_epi32(wsum, 7);                                              \
    const __m256 dw = load_half8(wd + b * 8);                                                       \
_Pragma("GCC unroll 4")                                                                             \
    for (int r = 0; r < RM; ++r) {                                                                  \
      const __m256 dx = _mm256_set1_ps(x.d[(r0 + r) * KB + b]);                                     \
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[r], offset));                     \
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), sum, acc[r]);                                 \
    }                                                                                               \
  }                                                                                                 \
  for (int r = 0; r < RM; ++r) _mm256_storeu_ps(out + (r0 + r) * N, acc[r]);                        \
}                                                                                                   \
                                                                                                    \
ATTR void q4_groups(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,               \
                          int64_t g0, int64_t g1, int64_t N, float* out) {                          \
  for (int64_t g = g0; g < g1; ++g) {                                                               \
    const uint8_t* qs = w.q4 + g * x.KB * 128;                                                      \
    const c10::Half *d = w.d + g * x.KB * 8, *m = w.m ? w.m + g * x.KB * 8 : nullptr;               \
    row_tiles<kRows256>(r0, r1, [&](auto rm, auto pf, int64_t r) {                                  \
      if (m == nullptr)                                                                             \
        q4_group<decltype(rm)::value, decltype(pf)::value, true>(qs, d, m, x, r, out + 8 * g, N);   \
      else                                                                                          \
        q4_group<decltype(rm)::value, decltype(pf)::value, false>(qs, d, m, x, r, out + 8 * g, N);  \
    });                                                                                             \
  }                                                                                                 \
}                                                                                                   \
                                                                                                    \
ATTR void q8_groups(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,               \
                          int64_t g0, int64_t g1, int64_t N, float* out) {                          \
  for (int64_t g = g0; g < g1; ++g) {                                                               \
    const int8_t* qs = w.q8 + g * x.KB * 256;                                                       \
    const c10::Half* d = w.d + g * x.KB * 8;                                                        \
    row_tiles<kRows256>(r0, r1, [&](auto rm, auto pf, int64_t r) {                                  \
      q8_group<decltype(rm)::value, decltype(pf)::value>(qs, d, x, r, out + 8 * g, N);              \
    });                                                                                             \
  }                                                                                                 \
}                                                                                                   \
  static_assert(true)

namespace vex {
KV_YMM_KERNELS(KV_AVXVNNI, _mm256_dpbusd_avx_epi32);
}  // namespace vex

namespace evex {
KV_YMM_KERNELS(KV_VNNI512, _mm256_dpbusd_epi32);
}  // namespace evex

}  // namespace

namespace kvblock {

void q4_groups_avx512vnni(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                          int64_t g0, int64_t g1, int64_t N, float* out) {
  // Few rows of q4 are memory-bound, where AVX2's int16 sums took 1-6% less time than vpdpbusd
  // (benchmarks/block_paths.py, 3 runs): same bits, so the faster kernel.
  if (r1 - r0 < kFewRows) return q4_groups_avx2(w, x, r0, r1, g0, g1, N, out);
  groups_512<true>(w, x, r0, r1, g0, g1, N, out);
}

void q8_groups_avx512vnni(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                          int64_t g0, int64_t g1, int64_t N, float* out) {
  if (r1 - r0 < kFewRows) return evex::q8_groups(w, x, r0, r1, g0, g1, N, out);
  groups_512<false>(w, x, r0, r1, g0, g1, N, out);
}

void q4_groups_avxvnni(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                       int64_t g0, int64_t g1, int64_t N, float* out) {
  if (r1 - r0 < kRows256) return q4_groups_avx2(w, x, r0, r1, g0, g1, N, out);  // as above
  vex::q4_groups(w, x, r0, r1, g0, g1, N, out);
}

void q8_groups_avxvnni(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                       int64_t g0, int64_t g1, int64_t N, float* out) {
  vex::q8_groups(w, x, r0, r1, g0, g1, N, out);
}

}  // namespace kvblock

#endif
