// Attention over a bfloat16 KV cache under float32 queries: bf16 arithmetic in the two dot
// products (the softmax stays float32). A query's scores are dot products of the query rounded to
// bf16 with the bf16 keys, and its output sums the probabilities rounded to bf16 times the bf16
// values, each product exact and accumulated in float32 in the order AVX-512 BF16's vdpbf16ps
// defines (per 32-bit lane, the pair's high element, then its low one, round to nearest even,
// denormals flushed): twice the multiply-adds per instruction of float32 FMAs, and no widening of
// the cache's elements. The decode kernel (paged_decode.cpp) and the prefill kernel
// (paged_prefill.cpp) share these kernels, so a token's result is the same bits whether its prompt
// was prefilled whole, in chunks or decoded; attention_bf16_kernels.inc has the exact order.
//
// Two compilations of the same kernels: bf16_hw (vdpbf16ps, where a probe in a child process shows
// it runs and gives bf16_emu's bits) and bf16_emu (AVX2 + FMA: the two FMAs per step that
// vdpbf16ps defines, under flush-to-zero). Both run with the calling thread's MXCSR set to flush
// denormals (FlushDenormals), so the float32 steps around the dot products (sums, softmax) round
// alike in both. kvserve::attention_bf16_select picks one (tests and benchmarks), the default the
// hardware one where it runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <c10/util/BFloat16.h>

#include "attention_avx2.h"

#ifdef KV_HAVE_AVX2_ATTENTION
#define KV_BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512bf16")))

namespace kvserve_attention {

using bf16 = c10::BFloat16;

// Sets MXCSR's flush-to-zero and denormals-are-zero for its scope (restored after).
struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// A row of zeros (d <= 512): the high key of a context's last pair when its length is odd.
inline const bf16* zero_row() {
  alignas(64) static const uint16_t zeros[512] = {0};
  return reinterpret_cast<const bf16*>(zeros);
}

// One query vector of a prefill work item over a bfloat16 cache (paged_prefill.cpp's QueryVec).
struct QueryVecB {
  int64_t start, end;  // its first visible key and its causal end (absolute positions)
  const uint16_t* q;   // the query, scaled and rounded to bf16
  float* p;            // its scores at p[t], t in [start, end); then probs()
  float* out;
  // Where its full runs of 8 keys end (runs counted from start; the rest is its tail).
  int64_t run_end() const { return start + ((end - start) - (end - start) % 8); }
  // Its probabilities in bf16 after the softmax (softmax_probs), key start + j at j.
  const uint16_t* probs() const { return reinterpret_cast<const uint16_t*>(p + start); }
};

namespace bf16_emu {
#define KVB_TARGET KV_AVX2
#define KVB_HW 0
#include "attention_bf16_kernels.inc"
#undef KVB_HW
#undef KVB_TARGET
}  // namespace bf16_emu

namespace bf16_hw {
#define KVB_TARGET KV_BF16
#define KVB_HW 1
#include "attention_bf16_kernels.inc"
#undef KVB_HW
#undef KVB_TARGET
}  // namespace bf16_hw

// Whether the hardware kernels run here and give the emulated kernels' bits: "" if so, else why
// not (the CPU lacks a flag; the probe, run in a child process, died or differed).
std::string bf16_hw_probe();

// 1: the hardware kernels where they run (the default), 0: the emulated ones.
inline std::atomic<int> bf16_mode{1};

// Whether this call runs the hardware kernels.
inline bool bf16_use_hw() {
  static const bool runs = bf16_hw_probe().empty();
  return runs && bf16_mode.load(std::memory_order_relaxed) == 1;
}

}  // namespace kvserve_attention
#endif
