// What block_matmul.cpp shares with its per-ISA kernel files (block_matmul_avx2.cpp,
// block_matmul_vnni.cpp): the quantized activations, the interleaved weights and the signature of
// a kernel path. Each path's helpers stay in its own file's anonymous namespace (the same inline
// helper compiled for two ISAs must never be merged by the linker).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace kvblock {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowPanel = 64;  // rows whose int8 activations stay in cache while columns stream

// Activations of one call, quantized: q [M, K] int8, u [M, K] = q + 128 as uint8 (for the
// u8 x s8 dot products of VNNI; only set for those paths), d [M, KB] scales, s [M, KB] =
// d * sum(q).
struct QuantRows {
  const int8_t* q;
  const uint8_t* u;
  const float* d;
  const float* s;
  int64_t K, KB;
  // For the zmm kernels only (else null): the bytes they read (q for q4, u for q8) and d, s again,
  // rows in tiles of kPackRows from row 0, each tile block-major so that one pointer walks it:
  // row r's block b at pk[t K + (b n + i) 32], pd/ps[t KB + b n + i], t = r - i the tile's first
  // row, i = r % kPackRows, n = the tile's rows.
  const uint8_t* pk = nullptr;
  const float* pd = nullptr;
  const float* ps = nullptr;
  // For the K-quant kernels only (else null): each row's integer sums of its int8 activations per
  // half block of 16, h [M, 2 KB].
  const int32_t* h = nullptr;
  // For Q4_0 weights (q4 with no m; else null): -8 times each block's sum of int8 activations,
  // n8 [M, KB], and tile-packed as pd (pn8, for the zmm kernels): the block's integer dot product
  // with the weights' q - 8 is isum + n8.
  const int32_t* n8 = nullptr;
  const int32_t* pn8 = nullptr;
  // For Q5_0 weights (else null): -16 times each block's sum, n16 [M, KB] (the dot product with
  // the weights' q - 16 is isum + n16).
  const int32_t* n16 = nullptr;
};

constexpr int64_t kPackRows = 8;

// Writes row m's blocks [b0, b1) (bytes src [K], scales d, s [KB], and n8 [KB] when given; b1 < 0:
// to the last) into the tile-packed arrays of M rows.
inline void pack_row(int64_t m, int64_t M, int64_t K, const uint8_t* src, const float* d,
                     const float* s, uint8_t* pk, float* pd, float* ps,
                     const int32_t* n8 = nullptr, int32_t* pn8 = nullptr, int64_t b0 = 0,
                     int64_t b1 = -1) {
  const int64_t KB = K / kBlock, i = m % kPackRows, t = m - i;
  const int64_t n = M - t < kPackRows ? M - t : kPackRows;
  for (int64_t b = b0; b < (b1 < 0 ? KB : b1); ++b) {
    for (int64_t k = 0; k < kBlock; ++k) pk[t * K + (b * n + i) * kBlock + k] = src[b * kBlock + k];
    pd[t * KB + b * n + i] = d[b];
    ps[t * KB + b * n + i] = s[b];
    if (n8 != nullptr) pn8[t * KB + b * n + i] = n8[b];
  }
}

// out [KB] of one row's int8 activations q [K]: -offset times each block's sum (QuantRows::n8 with
// offset 8, n16 with 16).
inline void offset_sums(const int8_t* q, int64_t K, int32_t offset, int32_t* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) sum += q[b * kBlock + k];
    out[b] = -offset * sum;
  }
}

// A weight's interleaved blocks (one of q4 / q8 set) and fp16 scales (and minimums for q4).
struct BlockWeight {
  const uint8_t* q4;
  const int8_t* q8;
  const c10::Half* d;
  const c10::Half* m;
};

// A K-quant weight (block_kquants.cpp), per group of 8 columns: qs uint8 [KB, bits, 32] (4 vectors
// of low nibbles as q4's, then 1 (Q5_K) or 2 (Q6_K) vectors of higher bits), sc uint8 [KB, 2, 8]
// (Q4_K/Q5_K: the block's 6-bit scale, then its 6-bit min, per column; Q6_K: the int8 scales of
// its two halves), dm fp16 [KB / 8, 2, 8] (per super-block of 256: d, then dmin (0 for Q6_K)).
struct KWeight {
  const uint8_t* qs;
  const uint8_t* sc;
  const c10::Half* dm;
  int bits;  // 4 (Q4_K), 5 (Q5_K), 6 (Q6_K)
};

using KGroupsFn = void (*)(const KWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                           int64_t g0, int64_t g1, int64_t N, float* out);

// A Q5_0 / Q5_1 weight (block_q5.cpp), per group of 8 columns: qs uint8 [KB, 5, 32] (4 vectors of
// low nibbles as q4's, then the fifth bits as Q5_K's), d and m fp16 [KB, 8] as q4's (m null for
// Q5_0: m = -16 d).
struct Q5Weight {
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
};

using Q5GroupsFn = void (*)(const Q5Weight& w, const QuantRows& x, int64_t r0, int64_t r1,
                            int64_t g0, int64_t g1, int64_t N, float* out);

// Rows [r0, r1) x column groups [g0, g1) of out [M, N]: every element computed as
//   acc = 0; for b in 0..KB: acc = fma(d_w * d_x, float(isum_b), acc) [; acc = fma(m_w, s_x, acc)]
// with isum_b the exact integer dot product of block b (the second fma for q4 with m, Q4_1; for
// Q4_0, isum_b is the dot product with q - 8, isum + n8, and there is no second fma), so every path
// gives the same bits.
using GroupsFn = void (*)(const BlockWeight& w, const QuantRows& x, int64_t r0, int64_t r1,
                          int64_t g0, int64_t g1, int64_t N, float* out);

using QuantizeRowFn = void (*)(const float* x, int64_t K, int8_t* q, float* d, float* s);

// The portable loops (block_matmul.cpp): the reference every other path must equal bit for bit.
void quantize_row_ref(const float* x, int64_t K, int8_t* q, float* d, float* s);
void q4_groups_ref(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                   int64_t, float*);
void q8_groups_ref(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                   int64_t, float*);
void kq_groups_ref(const KWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t, int64_t,
                   float*);
void q5_groups_ref(const Q5Weight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t, int64_t,
                   float*);

// One kernel path: its name (KVSERVE_BLOCK_KERNELS), its functions, whether its q8 kernel reads
// QuantRows::u, and whether its kernels read the tile-packed arrays.
struct PathFns {
  const char* name;
  QuantizeRowFn quantize_row;
  GroupsFn q4, q8;
  bool offset_u;
  bool packed;
  KGroupsFn kq;
  Q5GroupsFn q5;
};

// The path matmuls run on now (block_paths.cpp): chosen once from KVSERVE_BLOCK_KERNELS and what
// the CPU runs, changed only by the block_kernels_select op (tests, benchmarks).
const PathFns& current_path();

// One block weight of any format (the kinds of csrc/decode_layer.cpp), for callers that quantize
// the activations once and run the weight's column groups in their own ranges (the decode layer's
// thread team): the same kernels, so the same bits, as the q4/q8/kq/q5 ops.
enum WeightKind : int { kWeightQ4 = 1, kWeightQ8 = 2, kWeightKQ = 3, kWeightQ5 = 5 };

struct AnyWeight {
  int kind = 0;
  BlockWeight b{};  // kWeightQ4 (m null: Q4_0), kWeightQ8
  KWeight k{};      // kWeightKQ
  Q5Weight q5{};    // kWeightQ5 (m null: Q5_0)
  int64_t groups = 0, K = 0;
};

// What a weight's kernels on a path read of the activations beyond q, d and s.
struct ActNeeds {
  bool u = false, pack_q = false, pack_u = false, h = false, n8 = false, n16 = false;
  void add(const ActNeeds& o) {
    u |= o.u, pack_q |= o.pack_q, pack_u |= o.pack_u, h |= o.h, n8 |= o.n8, n16 |= o.n16;
  }
};
ActNeeds needs_of(const PathFns& path, const AnyWeight& w);

// Quantized activations in buffers kept across calls: size() for M rows of K and what the weights
// need, then quantize_row() for every row (rows are independent: any thread, any order), then
// rows_for(w) is the view w's kernels read. Every path quantizes to the same bytes.
class Activations {
 public:
  void size(int64_t M, int64_t K, const ActNeeds& needs);
  void quantize_row(const PathFns& path, int64_t m, const float* x);
  // Blocks [b0, b1) of row m (x: the row's start): what quantize_row writes of them.
  void quantize_blocks(const PathFns& path, int64_t m, int64_t b0, int64_t b1, const float* x);
  QuantRows rows_for(const PathFns& path, const AnyWeight& w) const;

 private:
  int64_t M_ = 0, K_ = 0;
  ActNeeds needs_;
  std::vector<int8_t> q_;
  std::vector<uint8_t> u_, pk_q_, pk_u_;
  std::vector<float> d_, s_, pd_, ps_;
  std::vector<int32_t> h_, n8_, pn8_, n16_;
};

// x [M, K] quantized for w into the calling thread's buffers (reused across calls; rows over the
// threads), valid until its next call: the block ops' activations.
QuantRows quantize_rows(const PathFns& path, const AnyWeight& w, const float* x, int64_t M,
                        int64_t K);

// Rows [r0, r1) x column groups [g0, g1) of w into out (row stride N), on the path's kernel for w.
void run_weight(const PathFns& path, const AnyWeight& w, const QuantRows& x, int64_t r0,
                int64_t r1, int64_t g0, int64_t g1, int64_t N, float* out);

#if defined(__x86_64__) && defined(__GNUC__)
void quantize_row_avx2(const float* x, int64_t K, int8_t* q, float* d, float* s);
void q4_groups_avx2(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                    int64_t, float*);
void q8_groups_avx2(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                    int64_t, float*);
void q4_groups_avxvnni(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float*);
void q8_groups_avxvnni(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float*);
void q4_groups_avx512vnni(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float*);
void q8_groups_avx512vnni(const BlockWeight&, const QuantRows&, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float*);
void kq_groups_avx2(const KWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t, int64_t,
                    float*);
void kq_groups_avxvnni(const KWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float*);
void kq_groups_avx512vnni(const KWeight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float*);
void q5_groups_avx2(const Q5Weight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t, int64_t,
                    float*);
void q5_groups_avxvnni(const Q5Weight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float*);
void q5_groups_avx512vnni(const Q5Weight&, const QuantRows&, int64_t, int64_t, int64_t, int64_t,
                          int64_t, float*);
#endif

}  // namespace kvblock
