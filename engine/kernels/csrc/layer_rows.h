// One row of the decoder layer's small ops on raw pointers, for the decode layer's thread team
// (csrc/decode_layer.cpp): the functions the rms_norm, rope_write_kv and silu_mul ops run on each
// row, so a row computed either way has the same bits. float32 activations only.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

namespace kvrows {

// out [h] = w * (x * rsqrt(mean(x^2) + eps)), as the rms_norm op (csrc/paged_decode.cpp).
void rms_norm(const float* x, const float* w, int64_t h, float eps, float* out);

// One token's rotary in place on x [(heads + kv_heads) * d] (cos, sin [d / 2]), then its k and v
// written at `slot` of the KV cache (float32: cache32; float16: cache16), as rope_write_kv.
void rope_write_kv(float* x, const float* cos, const float* sin, float* cache32,
                   c10::Half* cache16, int64_t slot, int64_t kv_plane, int64_t heads,
                   int64_t kv_heads, int64_t d);

// out [inter] = silu(g) * u, as the silu_mul op (csrc/silu_mul.cpp).
void silu_mul(const float* g, const float* u, int64_t inter, float* out);

}  // namespace kvrows
