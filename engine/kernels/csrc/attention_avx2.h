// The float32 AVX2 + FMA attention primitives the paged decode kernel (paged_decode.cpp) and the
// prefill kernel (paged_prefill.cpp) share, so a query's scores, softmax and P.V round the same in
// both: an exp, the softcap, the two horizontal sums, a head's softmax and the P.V pass.
// Keys and values are read from a float32 or a float16 KV cache (KT = float or c10::Half): a
// float16 row is widened to float32 on load (F16C, exact), so the arithmetic after the load is the
// same for both and every kernel stays bitwise equal to the others on the same cache.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <c10/core/ScalarType.h>
#include <c10/util/Half.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_AVX2_ATTENTION 1
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace kvserve_attention {

// The KV cache dtypes the kernels read: the queries' own, or float16 or bfloat16 under float32
// queries (bfloat16: bf16 arithmetic in the dot products, attention_bf16.h).
inline bool kv_dtype_ok(c10::ScalarType q, c10::ScalarType kv) {
  return kv == q || (q == c10::kFloat && (kv == c10::kHalf || kv == c10::kBFloat16));
}
inline constexpr const char* kKVDtypeError =
    "the KV cache must have the queries' dtype, or float16 or bfloat16 under float32 queries";

// Gemma's attention logit softcapping, in place on n scores (softcap <= 0: off).
inline void softcap_scores(float* s, int64_t n, float softcap) {
  if (softcap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) s[i] = softcap * std::tanh(s[i] / softcap);
}

#ifdef KV_HAVE_AVX2_ATTENTION
inline bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// 8 consecutive keys' or values' elements as float32: as stored, or widened from float16 (exact).
KV_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KV_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KV_AVX2 inline __m256 exp256(__m256 x) {  // Cephes-style expf, relative error ~1e-7
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// softcap * tanh(s / softcap) on n scores, 8 at a time: tanh(x) = sign(x) (1 - e) / (1 + e),
// e = exp(-2|x|) (no overflow); the tail uses std::tanh. Which of the two a score gets depends
// only on its index, so on the sequence's length and window, never on the batch.
KV_AVX2 inline void softcap_scores_avx2(float* s, int64_t n, float softcap) {
  if (softcap <= 0.f) return;
  const __m256 cap = _mm256_set1_ps(softcap), one = _mm256_set1_ps(1.f);
  const __m256 sign_bit = _mm256_set1_ps(-0.f), minus_two = _mm256_set1_ps(-2.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(s + i), cap);
    const __m256 e = exp256(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign_bit, x)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 signed_t = _mm256_or_ps(t, _mm256_and_ps(sign_bit, x));
    _mm256_storeu_ps(s + i, _mm256_mul_ps(cap, signed_t));
  }
  softcap_scores(s + i, n - i, softcap);
}

KV_AVX2 inline __m256 hsum8(const __m256* a) {  // lane u = sum of a[u]'s lanes
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

KV_AVX2 inline float hsum1(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Asks for context rows [from, to) of `rows` (d values each) into the cache ahead of their use: a
// decode step's keys and values were evicted by the layer's weights streaming through, and the
// rows of a paged cache are too scattered for the hardware prefetcher, so without this the
// attention waits on one row's latency after another. HINT: _MM_HINT_T0 into L1, _MM_HINT_T1 into
// L2 (more misses in flight, no L1 taken from the rows in use). No value changes.
template <typename KT, int HINT = _MM_HINT_T0>
KV_AVX2 inline void prefetch_rows(const KT* const* rows, int64_t from, int64_t to, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(KT));
  for (int64_t t = from; t < to; ++t)
    for (int64_t o = 0; o < bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[t]) + o, (_mm_hint)HINT);
}

// The scores of one (pre-scaled) query against 8 context tokens: 8 lane-wise dot products over d
// reduced together (lane u of hsum8), the decode kernel's unit for each full run of 8 tokens.
template <typename KT>
KV_AVX2 inline void scores8_avx2(const float* q, const KT* const* kp, int64_t d, float* out) {
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(load8(kp[u] + i), qv, acc[u]);
  }
  _mm256_storeu_ps(out, hsum8(acc));
}

// scores8_avx2 for two query vectors at once, 4 keys at a time (8 accumulators + 2 queries + 1 key
// fit in 16 ymm; each key vector is loaded once for both queries): every score the same fma chain
// over d and the same tree of hsum8's lane u, ((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7)), so the same bits.
template <typename KT>
KV_AVX2 inline void scores8x2_avx2(const float* qa, const float* qb, const KT* const* kp,
                                   int64_t d, float* outa, float* outb) {
  for (int h = 0; h < 8; h += 4) {
    __m256 a[4], b[4];
    for (int u = 0; u < 4; ++u) a[u] = _mm256_setzero_ps(), b[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 va = _mm256_loadu_ps(qa + i), vb = _mm256_loadu_ps(qb + i);
      for (int u = 0; u < 4; ++u) {
        const __m256 k = load8(kp[h + u] + i);
        a[u] = _mm256_fmadd_ps(k, va, a[u]);
        b[u] = _mm256_fmadd_ps(k, vb, b[u]);
      }
    }
    const __m256 ta = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 tb = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    _mm_storeu_ps(outa + h, _mm_add_ps(_mm256_castps256_ps128(ta), _mm256_extractf128_ps(ta, 1)));
    _mm_storeu_ps(outb + h, _mm_add_ps(_mm256_castps256_ps128(tb), _mm256_extractf128_ps(tb, 1)));
  }
}

// scores8x2_avx2 for three query vectors (12 accumulators, 3 queries and 1 key in 16 ymm: each key
// vector loaded once for the three), the same chains and tree, so the same bits.
template <typename KT>
KV_AVX2 inline void scores8x3_avx2(const float* qa, const float* qb, const float* qc,
                                   const KT* const* kp, int64_t d, float* outa, float* outb,
                                   float* outc) {
  for (int h = 0; h < 8; h += 4) {
    __m256 a[4], b[4], c[4];
    for (int u = 0; u < 4; ++u)
      a[u] = _mm256_setzero_ps(), b[u] = _mm256_setzero_ps(), c[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 va = _mm256_loadu_ps(qa + i), vb = _mm256_loadu_ps(qb + i),
                   vc = _mm256_loadu_ps(qc + i);
      for (int u = 0; u < 4; ++u) {
        const __m256 k = load8(kp[h + u] + i);
        a[u] = _mm256_fmadd_ps(k, va, a[u]);
        b[u] = _mm256_fmadd_ps(k, vb, b[u]);
        c[u] = _mm256_fmadd_ps(k, vc, c[u]);
      }
    }
    const __m256 ta = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 tb = _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
    const __m256 tc = _mm256_hadd_ps(_mm256_hadd_ps(c[0], c[1]), _mm256_hadd_ps(c[2], c[3]));
    _mm_storeu_ps(outa + h, _mm_add_ps(_mm256_castps256_ps128(ta), _mm256_extractf128_ps(ta, 1)));
    _mm_storeu_ps(outb + h, _mm_add_ps(_mm256_castps256_ps128(tb), _mm256_extractf128_ps(tb, 1)));
    _mm_storeu_ps(outc + h, _mm_add_ps(_mm256_castps256_ps128(tc), _mm256_extractf128_ps(tc, 1)));
  }
}

// The scores of n (1..3) query vectors (d apart, from q) against the run of 8 keys at kp, written
// to out, out + stride, out + 2 stride: the vectors share each key load, every score the bits of
// scores8_avx2.
template <typename KT>
KV_AVX2 inline void scores8_heads(int64_t n, const float* q, const KT* const* kp, int64_t d,
                                  float* out, int64_t stride) {
  if (n == 3)
    scores8x3_avx2(q, q + d, q + 2 * d, kp, d, out, out + stride, out + 2 * stride);
  else if (n == 2)
    scores8x2_avx2(q, q + d, kp, d, out, out + stride);
  else
    scores8_avx2(q, kp, d, out);
}

// One score (the tail tokens after the last full run of 8): the same lane-wise dot, hsum1.
template <typename KT>
KV_AVX2 inline float score1_avx2(const float* q, const KT* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(load8(k + i), _mm256_loadu_ps(q + i), acc);
  return hsum1(acc);
}

// Softcap, then the unnormalized softmax of one head's n scores in place: max, exp and sum 8 at a
// time (the tail one by one); returns 1 / sum (softmax_row_avx2 multiplies each score by it).
KV_AVX2 inline float softmax_exp_avx2(float* sg, int64_t len, float softcap) {
  softcap_scores_avx2(sg, len, softcap);
  // The max over this head's scores, 8 lanes at a time (a scalar max chain was 12% of a prefill's
  // attention): max is exact, so any order gives the same value, and a NaN score is skipped as
  // std::max(mx, s) skips it (vmaxps returns its second operand, the running max, on a NaN).
  __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t m = 0;
  for (; m + 8 <= len; m += 8) mx8 = _mm256_max_ps(_mm256_loadu_ps(sg + m), mx8);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx8);
  float mx = lanes[0];
  for (int u = 1; u < 8; ++u) mx = std::max(mx, lanes[u]);
  for (; m < len; ++m) mx = std::max(mx, sg[m]);
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sumv = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mxv));
    _mm256_storeu_ps(sg + j, e);
    sumv = _mm256_add_ps(sumv, e);
  }
  float sum = hsum1(sumv);
  for (; j < len; ++j) {
    alignas(32) float tmp[8] = {sg[j] - mx};
    const float e = _mm256_cvtss_f32(exp256(_mm256_load_ps(tmp)));
    sg[j] = e;
    sum += e;
  }
  return len > 0 ? 1.f / sum : 0.f;
}

// Softcap, then the softmax of one head's n scores in place: softmax_exp_avx2, then each score
// times 1 / sum.
KV_AVX2 inline void softmax_row_avx2(float* sg, int64_t len, float softcap) {
  const float inv = softmax_exp_avx2(sg, len, softcap);
  for (int64_t k = 0; k < len; ++k) sg[k] *= inv;
}

// out[a, i0:i0+32] = sum_t p[a, t] v[t, i0:i0+32] for GN heads (p rows `len` apart, out rows d
// apart): one fma chain per output value over the keys in increasing t. PF: asks for the values
// 16 rows ahead into L1 (for callers whose rows nobody prefetched; no value changes).
template <int GN, typename KT, bool PF = false>
KV_AVX2 inline void pv_chunk(const float* p, const KT* const* vp, int64_t len, int64_t d,
                             int64_t i0, float* out) {
  __m256 acc[GN][4];
  for (int a = 0; a < GN; ++a)
    for (int b = 0; b < 4; ++b) acc[a][b] = _mm256_setzero_ps();
  constexpr int64_t kNear = 16, kFar = 128;  // rows ahead into L1, into L2
  constexpr int64_t kBytes = 32 * static_cast<int64_t>(sizeof(KT));
  if (PF)
    for (int64_t t = 0; t < std::min(kFar, len); ++t)
      for (int64_t o = 0; o < kBytes; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vp[t] + i0) + o,
                     t < kNear ? _MM_HINT_T0 : _MM_HINT_T1);
  for (int64_t t = 0; t < len; ++t) {
    if (PF) {
      for (int64_t o = 0; o < kBytes && t + kNear < len; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vp[t + kNear] + i0) + o, _MM_HINT_T0);
      for (int64_t o = 0; o < kBytes && t + kFar < len; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vp[t + kFar] + i0) + o, _MM_HINT_T1);
    }
    __m256 v[4];
    for (int b = 0; b < 4; ++b) v[b] = load8(vp[t] + i0 + 8 * b);
    for (int a = 0; a < GN; ++a) {
      const __m256 w = _mm256_broadcast_ss(p + a * len + t);
      for (int b = 0; b < 4; ++b) acc[a][b] = _mm256_fmadd_ps(w, v[b], acc[a][b]);
    }
  }
  for (int a = 0; a < GN; ++a)
    for (int b = 0; b < 4; ++b) _mm256_storeu_ps(out + a * d + i0 + 8 * b, acc[a][b]);
}

// out[a, :] = sum_t p[a, t] v[t, :] for GN heads, 32 values of d per pass.
template <int GN, typename KT>
KV_AVX2 inline void pv_pass(const float* p, const KT* const* vp, int64_t len, int64_t d, float* out) {
  for (int64_t i0 = 0; i0 < d; i0 += 32) pv_chunk<GN>(p, vp, len, d, i0, out);
}

#endif

}  // namespace kvserve_attention
