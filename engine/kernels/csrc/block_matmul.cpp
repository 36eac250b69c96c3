// Block-quantized linear layers, y = x W^T, on GGUF's blocks of 32 input values, with the weights
// interleaved by 8 output columns so each SIMD lane accumulates its own column (no horizontal sums,
// and products of 4-bit weights sum in int16 over a whole block before one int32 widening):
//   q4 (GGUF Q4_1): qs uint8 [N/8, K/32, 4, 32], d, m fp16 [N/8, K/32, 8]; w = d * q + m, q in 0..15.
//       GGUF Q4_0 (w = d * (q - 8)) is q4 with m empty: each block's integer sum takes the weights
//       as q - 8 (isum + QuantRows::n8, exact), then one fma per block, as Q8_0 (no m term).
//       In block b, byte 4c + i of vector j holds, for column c of the group, k = 32b + 4j + i in its
//       low nibble and k = 32b + 4(j + 4) + i in its high nibble.
//   q8 (GGUF Q8_0): qs int8 [N/8, K/32, 8, 32], d fp16 [N/8, K/32, 8]; w = d * q; byte 4c + i of
//       vector j holds column c's k = 32b + 4j + i.
// Activations are quantized to int8 per row and block of 32 with their own scale (as llama.cpp's
// Q8_0/Q8_1), each block's products are summed exactly in integers, and every output element is
// computed by one thread in one fixed order: a row's output is bitwise the same alone, in any batch
// and with any number of threads. Kernel paths per ISA (block_matmul_avx2.cpp, block_matmul_vnni.cpp,
// portable loops here), chosen at run time by what runs (block_paths.cpp); all give the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "block_linear.h"
#include "block_matmul.h"

namespace kvblock {

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

// The interleaved layouts read lane by lane, for CPUs without AVX2: the same integer sums and the
// same fma sequence per output as the vector paths, so the same bits. `add(acc, g, b, c, xb, r)` adds block b's
// contribution to column c of group g for row r (xb: that row's int8 block) to acc.
namespace {

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

}  // namespace

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
    const float dd = static_cast<float>(w.d[at]) * x.d[r * x.KB + b];
    if (w.m == nullptr) {  // Q4_0: the dot product with q - 8, exact in integers
      acc = std::fma(dd, static_cast<float>(isum + x.n8[r * x.KB + b]), acc);
      return;
    }
    acc = std::fma(dd, static_cast<float>(isum), acc);
    acc = std::fma(static_cast<float>(w.m[at]), x.s[r * x.KB + b], acc);
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
    acc = std::fma(dw * x.d[r * x.KB + b], static_cast<float>(isum), acc);
  });
}

// ---------------------------------------------------------------- quantized activations

ActNeeds needs_of(const PathFns& path, const AnyWeight& w) {
  ActNeeds n;
  if (w.kind == kWeightQ4) {
    n.pack_q = path.packed;
    n.n8 = w.b.m == nullptr;  // Q4_0
  } else if (w.kind == kWeightQ8) {
    n.u = path.offset_u;
    n.pack_u = path.packed;
  } else if (w.kind == kWeightKQ) {
    n.h = true;
  } else if (w.kind == kWeightQ5) {
    n.n16 = w.q5.m == nullptr;  // Q5_0
  }
  return n;
}

void Activations::size(int64_t M, int64_t K, const ActNeeds& needs) {
  const int64_t KB = K / kBlock;
  M_ = M, K_ = K, needs_ = needs;
  q_.resize(M * K), d_.resize(M * KB), s_.resize(M * KB);
  if (needs.u || needs.pack_u) u_.resize(M * K);  // (pack_u packs u's bytes)
  if (needs.pack_q) pk_q_.resize(M * K);
  if (needs.pack_u) pk_u_.resize(M * K);
  if (needs.pack_q || needs.pack_u) pd_.resize(M * KB), ps_.resize(M * KB);
  if (needs.h) h_.resize(M * 2 * KB);
  if (needs.n8) n8_.resize(M * KB);
  if (needs.n8 && needs.pack_q) pn8_.resize(M * KB);
  if (needs.n16) n16_.resize(M * KB);
}

void Activations::quantize_row(const PathFns& path, int64_t m, const float* x) {
  quantize_blocks(path, m, 0, K_ / kBlock, x);
}

void Activations::quantize_blocks(const PathFns& path, int64_t m, int64_t b0, int64_t b1,
                                  const float* x) {
  if (b0 >= b1) return;
  const int64_t K = K_, KB = K / kBlock, k0 = b0 * kBlock, k1 = b1 * kBlock;
  int8_t* q = q_.data() + m * K;  // the row's; blocks are independent, each written alone
  float *d = d_.data() + m * KB, *s = s_.data() + m * KB;
  path.quantize_row(x + k0, k1 - k0, q + k0, d + b0, s + b0);
  if (needs_.u || needs_.pack_u) {  // q + 128 in 0..255, as two's complement bytes xor 0x80
    uint8_t* u = u_.data() + m * K;
    for (int64_t k = k0; k < k1; ++k) u[k] = static_cast<uint8_t>(q[k]) ^ 0x80;
  }
  int32_t* n8 = needs_.n8 ? n8_.data() + m * KB : nullptr;
  if (n8 != nullptr) offset_sums(q + k0, k1 - k0, 8, n8 + b0);
  if (needs_.n16) offset_sums(q + k0, k1 - k0, 16, n16_.data() + m * KB + b0);
  if (needs_.pack_q)
    pack_row(m, M_, K, reinterpret_cast<const uint8_t*>(q), d, s, pk_q_.data(), pd_.data(),
             ps_.data(), n8, n8 != nullptr ? pn8_.data() : nullptr, b0, b1);
  if (needs_.pack_u)
    pack_row(m, M_, K, u_.data() + m * K, d, s, pk_u_.data(), pd_.data(), ps_.data(), nullptr,
             nullptr, b0, b1);
  if (needs_.h)
    for (int64_t i = 2 * (m * KB + b0); i < 2 * (m * KB + b1); ++i) {
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock / 2; ++k) sum += q_[i * (kBlock / 2) + k];
      h_[i] = sum;
    }
}

QuantRows Activations::rows_for(const PathFns& path, const AnyWeight& w) const {
  const ActNeeds n = needs_of(path, w);
  QuantRows rows{q_.data(), n.u ? u_.data() : nullptr, d_.data(), s_.data(), K_, K_ / kBlock};
  if (n.pack_q || n.pack_u) {
    rows.pk = n.pack_q ? pk_q_.data() : pk_u_.data();
    rows.pd = pd_.data(), rows.ps = ps_.data();
  }
  if (n.n8) rows.n8 = n8_.data(), rows.pn8 = n.pack_q ? pn8_.data() : nullptr;
  if (n.h) rows.h = h_.data();
  if (n.n16) rows.n16 = n16_.data();
  return rows;
}

QuantRows quantize_rows(const PathFns& path, const AnyWeight& w, const float* x, int64_t M,
                        int64_t K) {
  thread_local Activations act;
  act.size(M, K, needs_of(path, w));
  Activations* a = &act;  // (inside the workers, `act` names each worker's own)
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) a->quantize_row(path, m, x + m * K);
  });
  return act.rows_for(path, w);
}

void run_weight(const PathFns& path, const AnyWeight& w, const QuantRows& x, int64_t r0,
                int64_t r1, int64_t g0, int64_t g1, int64_t N, float* out) {
  if (w.kind == kWeightQ4) path.q4(w.b, x, r0, r1, g0, g1, N, out);
  else if (w.kind == kWeightQ8) path.q8(w.b, x, r0, r1, g0, g1, N, out);
  else if (w.kind == kWeightKQ) path.kq(w.k, x, r0, r1, g0, g1, N, out);
  else path.q5(w.q5, x, r0, r1, g0, g1, N, out);
}

}  // namespace kvblock

// ---------------------------------------------------------------- ops

namespace {

using kvblock::BlockWeight;
using kvblock::kBlock;
using kvblock::kRowPanel;
using kvblock::QuantRows;

}  // namespace

// Column groups split across threads (each output element wholly on one thread); rows in panels so
// a panel's int8 activations stay in cache while the thread's weight groups stream past.
at::Tensor kvblock::block_linear(const at::Tensor& x, const kvblock::AnyWeight& w,
                                 const std::optional<at::Tensor>& bias) {
  const kvblock::PathFns& path = kvblock::current_path();
  const QuantRows rows = kvblock::quantize_rows(path, w, x.data_ptr<float>(), x.size(0), x.size(1));
  const int64_t M = x.size(0), groups = w.groups, N = 8 * groups;
  at::Tensor out = at::empty({M, N}, x.options());
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(2, groups / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowPanel)
      kvblock::run_weight(path, w, rows, r0, std::min(M, r0 + kRowPanel), g0, g1, N, o);
  });
  if (bias.has_value()) out.add_(*bias);
  return out;
}

namespace {

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
  const bool q4_0 = m.numel() == 0;  // Q4_0: no m (the weights taken as q - 8 in the sums)
  if (!q4_0) check_scales(m, qs, "q4_linear");
  const at::Tensor xc = check_input(x, qs.size(1) * kBlock);
  kvblock::AnyWeight w;
  w.kind = kvblock::kWeightQ4, w.groups = qs.size(0), w.K = xc.size(1);
  w.b = BlockWeight{qs.data_ptr<uint8_t>(), nullptr, d.data_ptr<c10::Half>(),
                    q4_0 ? nullptr : m.data_ptr<c10::Half>()};
  return kvblock::block_linear(xc, w, bias);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == 8 && qs.size(3) == 32 &&
                  qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "q8_linear: qs must be int8 [N/8, K/32, 8, 32]");
  check_scales(d, qs, "q8_linear");
  const at::Tensor xc = check_input(x, qs.size(1) * kBlock);
  kvblock::AnyWeight w;
  w.kind = kvblock::kWeightQ8, w.groups = qs.size(0), w.K = xc.size(1);
  w.b = BlockWeight{nullptr, qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), nullptr};
  return kvblock::block_linear(xc, w, bias);
}

// K-quants (block_matmul.h's KWeight): qs uint8 [N/8, K/32, bits, 32], sc uint8 [N/8, K/32, 2, 8],
// dm fp16 [N/8, K/256, 2, 8]; bits = qs.size(2): 4 Q4_K, 5 Q5_K, 6 Q6_K.
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& sc,
                     const at::Tensor& dm, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) >= 4 && qs.size(2) <= 6 && qs.size(3) == 32 &&
                  qs.size(1) % 8 == 0 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "kq_linear: qs must be uint8 [N/8, K/32, 4..6, 32] with K a multiple of 256");
  TORCH_CHECK(sc.scalar_type() == at::kByte && sc.is_contiguous() && sc.dim() == 4 &&
                  sc.size(0) == qs.size(0) && sc.size(1) == qs.size(1) && sc.size(2) == 2 &&
                  sc.size(3) == 8,
              "kq_linear: sc must be uint8 [N/8, K/32, 2, 8]");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.dim() == 4 &&
                  dm.size(0) == qs.size(0) && dm.size(1) * 8 == qs.size(1) && dm.size(2) == 2 &&
                  dm.size(3) == 8,
              "kq_linear: dm must be float16 [N/8, K/256, 2, 8]");
  const at::Tensor xc = check_input(x, qs.size(1) * kBlock);
  kvblock::AnyWeight w;
  w.kind = kvblock::kWeightKQ, w.groups = qs.size(0), w.K = xc.size(1);
  w.k = kvblock::KWeight{qs.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), dm.data_ptr<c10::Half>(),
                         static_cast<int>(qs.size(2))};
  return kvblock::block_linear(xc, w, bias);
}

// Rows `ids` of a Q8_0 weight (the embedding tied to a Q8_0 head), dequantized: [n, K] float32,
// each value float(q) * float(d) as the Python lookup computed it (one rounding), so the same bits;
// one op instead of ~8 dispatched ones a step.
at::Tensor q8_rows(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& ids) {
  TORCH_CHECK(qs.dim() == 4 && qs.size(2) == 8 && qs.size(3) == 32 &&
                  qs.scalar_type() == at::kChar && qs.is_contiguous(),
              "q8_rows: qs must be int8 [N/8, K/32, 8, 32]");
  check_scales(d, qs, "q8_rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(),
              "q8_rows: ids must be a 1-D int64 CPU tensor");
  const int64_t G = qs.size(0), KB = qs.size(1), n = ids.size(0);
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < 8 * G, "q8_rows: row ", id[r], " out of range [0, ", 8 * G,
                ")");
  at::Tensor out = at::empty({n, KB * kBlock}, qs.options().dtype(at::kFloat));
  const int8_t* q = qs.data_ptr<int8_t>();
  const c10::Half* sc = d.data_ptr<c10::Half>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t g = id[r] / 8, c = id[r] % 8;
    for (int64_t b = 0; b < KB; ++b) {
      const float scale = static_cast<float>(sc[(g * KB + b) * 8 + c]);
      const int8_t* blk = q + (g * KB + b) * 256 + 4 * c;  // vector j: bytes 32 j + 4 c .. + 3
      float* ob = o + r * KB * kBlock + b * kBlock;
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 4; ++i) ob[4 * j + i] = static_cast<float>(blk[32 * j + i]) * scale;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def("q8_rows(Tensor qs, Tensor d, Tensor ids) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor m, Tensor? bias) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qs, Tensor d, Tensor? bias) -> Tensor");
  m.def("kq_linear(Tensor x, Tensor qs, Tensor sc, Tensor dm, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("q4_linear", q4_linear);
  m.impl("q8_linear", q8_linear);
  m.impl("q8_rows", q8_rows);
  m.impl("kq_linear", kq_linear);
}
