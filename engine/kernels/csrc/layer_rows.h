// One row of the decoder layer's small ops on raw pointers, for the decode layer's thread team
// (csrc/decode_layer.cpp): the functions the rms_norm, rope_write_kv and silu_mul ops run on each
// row, so a row computed either way has the same bits. float32 activations only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <memory>

namespace kvrows {

// out [h] = w * (x * rsqrt(mean(x^2) + eps)), as the rms_norm op (csrc/paged_decode.cpp); only its
// columns [c0, c1) when given (c1 < 0: to the end).
void rms_norm(const float* x, const float* w, int64_t h, float eps, float* out, int64_t c0 = 0,
              int64_t c1 = -1);

// One token's rotary in place on x [(heads + 2 kv_heads) * d] (cos, sin [d / 2]), then its k and
// v written at `slot` of the KV cache (float32: cache32; float16: cache16; bfloat16: cache_bf16; the
// others null), as rope_write_kv; only heads [h0, h1) of x when given (h1 < 0: to the last).
void rope_write_kv(float* x, const float* cos, const float* sin, float* cache32,
                   c10::Half* cache16, c10::BFloat16* cache_bf16, int64_t slot, int64_t kv_plane,
                   int64_t heads, int64_t kv_heads, int64_t d, int64_t h0 = 0, int64_t h1 = -1);

// out [inter] = silu(g) * u, as the silu_mul op (csrc/silu_mul.cpp).
void silu_mul(const float* g, const float* u, int64_t inter, float* out);

// One layer's paged decode attention as work items for the team: built (with the op's checks)
// outside a parallel region, given a scratch of scratch_floats() floats (set_scratch; layers that
// run one after another may share one), then for each phase in order, every thread done with the
// one before, run(phase, begin, end) over [0, items(phase)) in any shares; writes out [n, heads, d]
// float32 as the paged_decode_attention op does (the same paths, the same bits).
class DecodeAttention {
 public:
  virtual ~DecodeAttention() = default;
  virtual int phases() const = 0;
  virtual int64_t items(int phase) const = 0;
  virtual void run(int phase, int64_t begin, int64_t end) const = 0;
  virtual int64_t scratch_floats() const = 0;
  virtual void set_scratch(float* scratch) = 0;
};

// threads: how many will share the items.
std::unique_ptr<DecodeAttention> decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                                  const at::Tensor& block_tables,
                                                  const at::Tensor& seq_lens, double scale,
                                                  int64_t window, double softcap,
                                                  const at::Tensor& out, int64_t threads);

}  // namespace kvrows
