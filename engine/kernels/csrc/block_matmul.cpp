// Block-quantized linear layers, y = x W^T, on GGUF's blocks of 32 input values, with the weights
// interleaved by 8 output columns so each SIMD lane accumulates its own column (no horizontal sums,
// and products of 4-bit weights sum in int16 over a whole block before one int32 widening):
//   q4 (GGUF Q4_1): qs uint8 [N/8, K/32, 4, 32], d, m fp16 [N/8, K/32, 8]; w = d * q + m, q in 0..15.
//       In block b, byte 4c + i of vector j holds, for column c of the group, k = 32b + 4j + i in its
//       low nibble and k = 32b + 4(j + 4) + i in its high nibble.
//   q8 (GGUF Q8_0): qs int8 [N/8, K/32, 8, 32], d fp16 [N/8, K/32, 8]; w = d * q; byte 4c + i of
//       vector j holds column c's k = 32b + 4j + i.
// Activations are quantized to int8 per row and block of 32 with their own scale (as llama.cpp's
// Q8_0/Q8_1), each block's products are summed exactly in integers, and every output element is
// computed by one thread in one fixed order: a row's output is bitwise the same alone, in any batch
// and with any number of threads. AVX2+FMA+F16C kernels where the CPU has them, portable loops
// elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_X86 1
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define KV_HAVE_X86 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowTile = 4;    // activation rows sharing each unpacked weight vector
constexpr int64_t kRowPanel = 64;  // rows whose int8 activations stay in cache while columns stream

// KVSERVE_BLOCK_KERNELS=portable forces the portable loops (to test them on an AVX2 machine).
bool cpu_has_avx2() {
#if KV_HAVE_X86
  static const bool has = [] {
    const char* env = std::getenv("KVSERVE_BLOCK_KERNELS");
    if (env != nullptr && std::string_view(env) == "portable") return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return has;
#else
  return false;
#endif
}

// Activations of one call, quantized: q [M, K] int8, d [M, KB] scales, s [M, KB] = d * sum(q).
struct QuantRows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K, KB;
};

// A weight's interleaved blocks (one of q4 / q8 set) and fp16 scales (and minimums for q4).
struct BlockWeight {
  const uint8_t* q4;
  const int8_t* q8;
  const c10::Half* d;
  const c10::Half* m;
};

// ---------------------------------------------------------------- portable reference loops

void quantize_row_ref(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    bool nan = false;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    for (int64_t i = 0; i < kBlock; ++i) nan = nan || std::isnan(xb[i]);
    if (nan) amax = NAN;  // a NaN poisons only this row's outputs
    const float scale = amax / 127.f;
    const float inv = amax != 0.f && !nan ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      const float v = std::nearbyint(xb[i] * inv);
      const int32_t qi = std::isfinite(v) ? static_cast<int32_t>(v) : 0;
      q[b * kBlock + i] = static_cast<int8_t>(qi);
      sum += qi;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

// The interleaved layouts read lane by lane, for CPUs without AVX2 (the same values up to float
// summation order; one CPU always runs one path). `add(acc, g, b, c, xb, r)` adds block b's
// contribution to column c of group g for row r (xb: that row's int8 block) to acc.
template <typename Add>
void groups_ref(const QuantRows& x, int64_t r0, int64_t r1, int64_t g0, int64_t g1, int64_t N,
                float* out, Add&& add) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = r0; r < r1; ++r)
      for (int c = 0; c < 8; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < x.KB; ++b) add(acc, g, b, c, x.q + r * x.K + b * kBlock, r);
        out[r * N + 8 * g + c] = acc;
      }
}

void q4_groups_ref(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                   int64_t g1, int64_t N, float* out) {
  groups_ref(x, r0, r1, g0, g1, N, out, [&](float& acc, int64_t g, int64_t b, int c,
                                          const int8_t* xb, int64_t r) {
    const uint8_t* wb = w.q4 + (g * x.KB + b) * 128;
    int32_t isum = 0;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = wb[32 * j + 4 * c + i];
        isum += (byte & 0x0F) * xb[4 * j + i] + (byte >> 4) * xb[4 * j + 16 + i];
      }
    const int64_t at = (g * x.KB + b) * 8 + c;
    acc += static_cast<float>(w.d[at]) * x.d[r * x.KB + b] * static_cast<float>(isum);
    acc += static_cast<float>(w.m[at]) * x.s[r * x.KB + b];
  });
}

void q8_groups_ref(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1, int64_t g0,
                   int64_t g1, int64_t N, float* out) {
  groups_ref(x, r0, r1, g0, g1, N, out, [&](float& acc, int64_t g, int64_t b, int c,
                                          const int8_t* xb, int64_t r) {
    const int8_t* wb = w.q8 + (g * x.KB + b) * 256;
    int32_t isum = 0;
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 4; ++i) isum += wb[32 * j + 4 * c + i] * xb[4 * j + i];
    const float dw = static_cast<float>(w.d[(g * x.KB + b) * 8 + c]);
    acc += dw * x.d[r * x.KB + b] * static_cast<float>(isum);
  });
}

// ---------------------------------------------------------------- AVX2 + FMA + F16C

#if KV_HAVE_X86
KV_AVX2 inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

KV_AVX2 void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, float* s) {
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
// column group, which follows in memory), and for their scales.
constexpr int64_t kPrefetch = 16;

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
// acc = fma(d_w d_x, sum, acc) and acc = fma(m_w, s_x, acc). Same instructions for every lane and
// every row, whatever RM is, so tiling and batching never change a value.
template <int RM, bool PF>
KV_AVX2 void q4_group(const uint8_t* __restrict qs, const c10::Half* __restrict wd,
                      const c10::Half* __restrict wm, const QuantRows& x, int64_t r0,
                      float* __restrict out, int64_t N) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t KB = x.KB, K = x.K;
  const int8_t* xq[RM];
  const float *xd[RM], *xs[RM];
  for (int r = 0; r < RM; ++r)
    xq[r] = x.q + (r0 + r) * K, xd[r] = x.d + (r0 + r) * KB, xs[r] = x.s + (r0 + r) * KB;
  __m256 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* wb = qs + b * 128;
    if constexpr (PF) prefetch_ahead(wb, 128, wd + b * 8, wm + b * 8);
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
    const __m256 dw = load_half8(wd + b * 8), mw = load_half8(wm + b * 8);
#pragma GCC unroll 4
    for (int r = 0; r < RM; ++r) {
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[r], ones));
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(xd[r] + b)), sum, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs[r] + b), acc[r]);
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

KV_AVX2 void q4_groups_avx2(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                            int64_t g0, int64_t g1, int64_t N, float* out) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* qs = w.q4 + g * x.KB * 128;
    const c10::Half *d = w.d + g * x.KB * 8, *m = w.m + g * x.KB * 8;
    row_tiles(r0, r1, [&](auto rm, auto pf, int64_t r) {
      q4_group<decltype(rm)::value, decltype(pf)::value>(qs, d, m, x, r, out + 8 * g, N);
    });
  }
}

KV_AVX2 void q8_groups_avx2(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                            int64_t g0, int64_t g1, int64_t N, float* out) {
  for (int64_t g = g0; g < g1; ++g) {
    const int8_t* qs = w.q8 + g * x.KB * 256;
    const c10::Half* d = w.d + g * x.KB * 8;
    row_tiles(r0, r1, [&](auto rm, auto pf, int64_t r) {
      q8_group<decltype(rm)::value, decltype(pf)::value>(qs, d, x, r, out + 8 * g, N);
    });
  }
}
#endif

// ---------------------------------------------------------------- ops

// The calling thread's scratch for quantized activations (reused across calls: no allocation per
// matmul); the workers of one call only read it.
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

QuantRows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock;
  thread_local Scratch scratch;
  scratch.q.resize(M * K), scratch.d.resize(M * KB), scratch.s.resize(M * KB);
  const float* xp = x.data_ptr<float>();
  int8_t* q = scratch.q.data();
  float *d = scratch.d.data(), *s = scratch.s.data();
  const bool avx2 = cpu_has_avx2();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#if KV_HAVE_X86
      if (avx2) {
        quantize_row_avx2(xp + m * K, K, q + m * K, d + m * KB, s + m * KB);
        continue;
      }
#endif
      quantize_row_ref(xp + m * K, K, q + m * K, d + m * KB, s + m * KB);
    }
  });
  return {q, d, s, K, KB};
}

// Column groups split across threads (each output element wholly on one thread); rows in panels so
// a panel's int8 activations stay in cache while the thread's weight groups stream past.
template <typename Groups>
at::Tensor run_groups(const at::Tensor& x, const BlockWeight& w, int64_t groups,
                      const std::optional<at::Tensor>& bias, Groups&& run) {
  const QuantRows rows = quantize_rows(x);
  const int64_t M = x.size(0), N = 8 * groups;
  at::Tensor out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(2, groups / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowPanel)
      run(w, rows, r0, std::min(M, r0 + kRowPanel), g0, g1, N, o);
  });
  if (bias.has_value()) out.add_(*bias);
  return out;
}

at::Tensor check_input(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "block matmul: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) == K, "block matmul: x has ", x.size(1), " features, the weight ", K);
  return x.contiguous();
}

void check_scales(const at::Tensor& d, const at::Tensor& qs, const char* what) {
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 3 &&
                  d.size(0) == qs.size(0) && d.size(1) == qs.size(1) && d.size(2) == 8,
              what, ": scales must be float16 [N/8, K/32, 8]");
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const at::Tensor& m, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == 4 && qs.size(3) == 32 &&
                  qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "q4_linear: qs must be uint8 [N/8, K/32, 4, 32]");
  check_scales(d, qs, "q4_linear");
  check_scales(m, qs, "q4_linear");
  const at::Tensor xc = check_input(x, qs.size(1) * kBlock);
  const BlockWeight w{qs.data_ptr<uint8_t>(), nullptr, d.data_ptr<c10::Half>(),
                      m.data_ptr<c10::Half>()};
#if KV_HAVE_X86
  if (cpu_has_avx2()) return run_groups(xc, w, qs.size(0), bias, q4_groups_avx2);
#endif
  return run_groups(xc, w, qs.size(0), bias, q4_groups_ref);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == 8 && qs.size(3) == 32 &&
                  qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "q8_linear: qs must be int8 [N/8, K/32, 8, 32]");
  check_scales(d, qs, "q8_linear");
  const at::Tensor xc = check_input(x, qs.size(1) * kBlock);
  const BlockWeight w{nullptr, qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), nullptr};
#if KV_HAVE_X86
  if (cpu_has_avx2()) return run_groups(xc, w, qs.size(0), bias, q8_groups_avx2);
#endif
  return run_groups(xc, w, qs.size(0), bias, q8_groups_ref);
}

bool block_kernels_vectorized() { return cpu_has_avx2(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor d, Tensor? bias) -> Tensor");
  m.def("block_kernels_vectorized", &block_kernels_vectorized);
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("q4_linear", q4_linear);
  m.impl("q8_linear", q8_linear);
}
