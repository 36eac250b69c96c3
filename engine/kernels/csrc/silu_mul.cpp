// SwiGLU's activation in one pass: out[r, :] = silu(x[r, :inter]) * x[r, inter:] for the fused
// gate/up output x [n, 2 * inter] of block-quantized MLPs (csrc/decode_layer.cpp and the Python
// fused layer both call it, so the two agree bitwise). silu(g) = g / (1 + exp(-g)) with the attention
// kernels' exp (attention_avx2.h: exp256); every element, in a full run of 8 or in a row's tail, goes
// through the same vector arithmetic, so its value depends on its two inputs alone: never on the
// batch, the row's position or the thread count. One read of x and one write of out, no temporaries
// (torch's silu then mul allocates and walks the strided halves twice).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "attention_avx2.h"
#include "layer_rows.h"

namespace {

using namespace kvserve_attention;

#ifdef KV_HAVE_AVX2_ATTENTION
KV_AVX2 inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

KV_AVX2 void silu_mul_row_avx2(const float* g, const float* u, int64_t inter, float* out) {
  int64_t i = 0;
  for (; i + 8 <= inter; i += 8)
    _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  for (; i < inter; ++i) {  // the tail, one element per vector: the same arithmetic
    const __m256 r = silu_mul8(_mm256_set1_ps(g[i]), _mm256_set1_ps(u[i]));
    out[i] = _mm256_cvtss_f32(r);
  }
}
#endif

void silu_mul_row(const float* g, const float* u, int64_t inter, float* out) {
  for (int64_t i = 0; i < inter; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// The CPU's one path for every row.
auto row_path() {
  auto row_fn = silu_mul_row;
#ifdef KV_HAVE_AVX2_ATTENTION
  if (cpu_has_avx2_fma()) row_fn = silu_mul_row_avx2;
#endif
  return row_fn;
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % 2 == 0, "x [n, 2 * inter]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_mul takes float32");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t n = xc.size(0), inter = xc.size(1) / 2, row = xc.stride(0);
  auto out = at::empty({n, inter}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto row_fn = row_path();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, inter));  // ~64 KiB
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * row;
      row_fn(g, g + inter, inter, op + r * inter);
    }
  });
  return out;
}

}  // namespace

void kvrows::silu_mul(const float* g, const float* u, int64_t inter, float* out) {
  row_path()(g, u, inter, out);
}

TORCH_LIBRARY_FRAGMENT(kvserve, m) { m.def("silu_mul(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("silu_mul", &silu_mul); }
