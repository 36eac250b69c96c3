// Greedy sampling's reduction in one op: each float32 row's maximum and the index of its first
// occurrence, exactly what torch's `x.max(dim=-1)` returns (a NaN counts as the maximum, so a row
// with one gives NaN and its first NaN's index; equal values, -0.0 and 0.0 too, keep the first).
// torch's CPU max(dim) walks a row one element at a time (80-140 us for 49152 logits on the AVX2
// EPYC, where one vectorized pass takes about 10), and the chunked torch version costs more than the
// walk after a forward, when each of its ops starts cache-cold. Each AVX2 lane keeps its own
// running maximum over the indices it sees (index = lane mod 32), so the first occurrence in each
// lane wins (4 sets of 8 lanes, so 4 compare-blend chains run side by side); the lanes are then
// merged by value, ties by the smaller index.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "attention_avx2.h"

namespace {

using namespace kvserve_attention;

// The reference: max(dim)'s rule, element by element (NaN wins and ends the search).
void first_argmax_row(const float* x, int64_t n, float* value, int64_t* index) {
  float best = x[0];
  int64_t at = 0;
  for (int64_t i = 1; i < n && !std::isnan(best); ++i)
    if (x[i] > best || std::isnan(x[i])) best = x[i], at = i;
  *value = best, *index = at;
}

#ifdef KV_HAVE_AVX2_ATTENTION
// kSets independent (max, index) vectors: lane l of set s sees the indices i with
// i mod kWidth = 8 s + l, so the kSets compare-blend chains run side by side.
constexpr int kSets = 4, kWidth = 8 * kSets;

KV_AVX2 void first_argmax_row_avx2(const float* x, int64_t n, float* value, int64_t* index) {
  if (n < 2 * kWidth) return first_argmax_row(x, n, value, index);
  __m256 best[kSets];
  __m256i at[kSets];
  for (int s = 0; s < kSets; ++s) {
    best[s] = _mm256_loadu_ps(x + 8 * s);
    at[s] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * s));
  }
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(kWidth), eight = _mm256_set1_epi32(8);
  int64_t i = kWidth;
  // int32 lane indices: rows of up to 2^31 - kWidth elements (checked by the caller).
  for (; i + kWidth <= n; i += kWidth) {
    idx = _mm256_add_epi32(idx, step);
    __m256i lane_idx = idx;
    for (int s = 0; s < kSets; ++s, lane_idx = _mm256_add_epi32(lane_idx, eight)) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * s);
      // take v where v > best, or v is NaN and best is not (a lane's first NaN stays)
      const __m256 take = _mm256_or_ps(
          _mm256_cmp_ps(v, best[s], _CMP_GT_OQ),
          _mm256_andnot_ps(_mm256_cmp_ps(best[s], best[s], _CMP_UNORD_Q),
                           _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
      best[s] = _mm256_blendv_ps(best[s], v, take);
      at[s] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(at[s]), _mm256_castsi256_ps(lane_idx), take));
    }
  }
  alignas(32) float lane_best[kWidth];
  alignas(32) int32_t lane_at[kWidth];
  for (int s = 0; s < kSets; ++s) {
    _mm256_store_ps(lane_best + 8 * s, best[s]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at + 8 * s), at[s]);
  }
  // Merge the lanes: the first NaN if any lane holds one, else the largest value at its smallest
  // index (a lane's value is its first occurrence; another lane may hold the same value earlier).
  float b = lane_best[0];
  int64_t a = lane_at[0];
  for (int u = 1; u < kWidth; ++u) {
    const float v = lane_best[u];
    const bool v_nan = std::isnan(v), b_nan = std::isnan(b);
    if (v_nan ? (!b_nan || lane_at[u] < a) : (!b_nan && (v > b || (v == b && lane_at[u] < a))))
      b = v, a = lane_at[u];
  }
  for (; i < n && !std::isnan(b); ++i)  // the tail comes after every lane's indices
    if (x[i] > b || std::isnan(x[i])) b = x[i], a = i;
  *value = b, *index = a;
}
#endif

// x [rows, n] float32 -> (values [rows] float32, indices [rows] int64). portable: the
// element-by-element path even where AVX2 runs (the tests compare the two).
std::tuple<at::Tensor, at::Tensor> first_argmax(const at::Tensor& x, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "first_argmax: x [rows, n] float32 on CPU");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31) - 64, "first_argmax: 1 <= n < 2^31 - 64");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  auto values = at::empty({rows}, xc.options());
  auto indices = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  auto row_fn = first_argmax_row;
#ifdef KV_HAVE_AVX2_ATTENTION
  if (!portable && cpu_has_avx2_fma()) row_fn = first_argmax_row_avx2;
#endif
  const int64_t stride = xc.stride(0);
  const int64_t grain = std::max<int64_t>(1, 65536 / n);  // a thread only for >= ~64K logits
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_fn(xp + r * stride, n, vp + r, ip + r);
  });
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("first_argmax(Tensor x, bool portable=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("first_argmax", &first_argmax); }
