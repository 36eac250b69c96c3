// kvserve's CPU kernels. Paged decode attention: each decode sequence's single query attends over
// its context read straight from the paged KV cache (no gathered or padded copy); one work item per
// (sequence, KV head), so a sequence's result never depends on which other sequences share the step.
// A split path for a few sequences over long contexts (each item's three phases over the threads,
// attend_split_avx2: the same arithmetic in the same order, so the same bits) is off by default:
// slower than the per-item path where measured (split_on below); kvserve::decode_split_select(1)
// turns it on.
// A sliding window starts the context at max(0, len - window) (nothing before it is read); a logit
// softcap maps each scaled score s to softcap * tanh(s / softcap) before the softmax.
// Fused per-row layer ops (RMSNorm; rotary + KV-cache write) that round like the torch ops they
// replace (products rounded to the model dtype; built with -ffp-contract=off), one pass each.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_avx2.h"
#include "layer_rows.h"

namespace {

using namespace kvserve_attention;

constexpr int kLanes = 16;  // independent accumulators: lets the compiler vectorize the dot

// Compiled twice (AVX2+FMA and baseline x86-64); the loader picks the one the CPU runs.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KV_TARGETS __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KV_TARGETS
#endif

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// q [group, d] (float, pre-scaled), k [d] -> scores[g] for one context token
template <typename T>
KV_TARGETS void dot_group(const float* q, const T* k, int64_t group, int64_t d, float* out) {
  float kf[512];
  for (int64_t i = 0; i < d; ++i) kf[i] = to_f(k[i]);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    float acc[kLanes] = {0};
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += qg[i + j] * kf[i + j];
    float s = 0.f;
    for (; i < d; ++i) s += qg[i] * kf[i];
    for (int j = 0; j < kLanes; ++j) s += acc[j];
    out[g] = s;
  }
}

// acc[g, :] += p[g] * v[:] for one context token
template <typename T>
KV_TARGETS void axpy_group(const float* p, const T* v, int64_t group, int64_t d, float* acc) {
  float vf[512];
  for (int64_t i = 0; i < d; ++i) vf[i] = to_f(v[i]);
  for (int64_t g = 0; g < group; ++g) {
    float* a = acc + g * d;
    const float w = p[g];
    for (int64_t i = 0; i < d; ++i) a[i] += w * vf[i];
  }
}

#ifdef KV_HAVE_AVX2_ATTENTION
// ------------------------------------------------ float32 decode attention, AVX2 + FMA
// One (sequence, KV head) item: scores for 8 context tokens at a time (8 dot products reduced
// together; up to 3 of the group's query heads per pass sharing each K load: 0.87-0.98x the time of
// one head a pass on the AVX2 EPYC), a vectorized softmax, then P.V with the group's query heads
// sharing each V load. The arithmetic depends only on the sequence (its length and values), never
// on the batch.

// qf [group, d] pre-scaled; kp/vp: per context token, its K/V row; out [group, d]; d % 32 == 0.
template <typename KT>
KV_AVX2 void attend_item_avx2(const float* qf, const KT* const* kp, const KT* const* vp,
                              int64_t len, int64_t group, int64_t d, float softcap, float* scores,
                              float* out) {
  // Keys asked for into L1 kAhead tokens ahead of their scores and into L2 4 kAhead ahead; values
  // into L2 as the first pass of scores passes them (P.V reads them after every head's softmax).
  constexpr int64_t kAhead = 16;
  prefetch_rows(kp, 0, std::min(kAhead, len), d);
  prefetch_rows<KT, _MM_HINT_T1>(kp, std::min(kAhead, len), std::min(4 * kAhead, len), d);
  for (int64_t g = 0; g < group;) {  // scores, g-major: scores[g * len + t]; heads 3, 2 or 1 a pass
    const int64_t n = std::min<int64_t>(3, group - g);
    const float* qg = qf + g * d;
    float* sg = scores + g * len;
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
      if (g == 0) {
        prefetch_rows(kp, std::min(t + kAhead, len), std::min(t + kAhead + 8, len), d);
        prefetch_rows<KT, _MM_HINT_T1>(kp, std::min(t + 4 * kAhead, len),
                                       std::min(t + 4 * kAhead + 8, len), d);
        prefetch_rows<KT, _MM_HINT_T1>(vp, t, t + 8, d);
      }
      scores8_heads(n, qg, kp + t, d, sg + t, len);
    }
    if (g == 0) prefetch_rows<KT, _MM_HINT_T1>(vp, t, len, d);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t u = t; u < len; ++u) sg[j * len + u] = score1_avx2(qg + j * d, kp[u], d);
      softmax_row_avx2(sg + j * len, len, softcap);
    }
    g += n;
  }
  for (int64_t g0 = 0; g0 < group; g0 += 2) {  // out = P V: two heads x 32 values per pass
    if (group - g0 >= 2)
      pv_pass<2>(scores + g0 * len, vp, len, d, out + g0 * d);
    else
      pv_pass<1>(scores + g0 * len, vp, len, d, out + g0 * d);
  }
}
#endif

// Context tokens per score task of the split path (a multiple of the 8-token runs, so every run
// lies in one task), and the context length from which the split path runs.
constexpr int64_t kSplitTile = 256;
constexpr int64_t kSplitAhead = 16;  // context rows the split path asks for ahead of use
constexpr int64_t kSplitFrom = 768;

// Whether the split path runs: 0 never (the default), 1 where it applies (kvserve::
// decode_split_select, for tests and for measuring it on other machines). It was measured faster
// when it landed (AVX-512 EPYC, float32 KV cache, one token over 4096 keys of SmolLM2: 16.1 vs
// 19.9 ms), against the per-item path of then. Against today's per-item path, on the same machine
// kind, a whole decode step of one sequence (in situ, the paths alternated in one process, medians
// of 6 rounds) took longer with it: float16 cache 9.4 vs 7.5 ms at 1024 keys, 18.1 vs 13.0 ms at
// 4000; float32 cache 8.9 vs 8.6 ms and 20.3 vs 19.4 ms. Either way the same bits.
std::atomic<int> split_mode{0};

bool split_on() { return split_mode.load(std::memory_order_relaxed) == 1; }

// Sets the split path's mode (0 off, 1 on); returns the one it replaces.
int64_t decode_split_select(int64_t mode) {
  TORCH_CHECK(mode == 0 || mode == 1, "decode_split_select: mode must be 0 or 1, not ", mode);
  return split_mode.exchange(static_cast<int>(mode));
}

// The split path: for (sequence, KV head) items too few to keep the threads busy with long contexts,
// where one item per thread would read its keys and values alone (and query heads as items would
// read them once per head). Three parallel phases, each value computed as attend_item_avx2 does:
// the scores in key tiles (each tile's keys read once for the item's query heads, runs of 8 from
// the context's first token, the tail with score1_avx2), then each head's softmax whole, then P.V
// per 32 output values (pairs of heads sharing each value load, as attend_item_avx2).
// qf [batch, heads, d] pre-scaled; kp/vp per (sequence, KV head): its context's K/V rows, the
// item's rows at ctx[b] * kv_heads + h * len[b]; scores per (sequence, head) at sc[b] + head * len.
template <typename KT>
KV_AVX2 void attend_split_avx2(const float* qf, const KT* const* kp, const KT* const* vp,
                               const int64_t* len, const int64_t* ctx, const int64_t* sc,
                               int64_t batch, int64_t heads, int64_t kv_heads, int64_t d,
                               float softcap, float* scores, float* out) {
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> tiles(batch + 1, 0);  // score tasks before sequence b, per KV head
  for (int64_t b = 0; b < batch; ++b) tiles[b + 1] = tiles[b] + (len[b] + kSplitTile - 1) / kSplitTile;
  auto rows = [&](int64_t b, int64_t h) { return ctx[b] * kv_heads + h * len[b]; };
  at::parallel_for(0, tiles[batch] * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task % kv_heads, tile = task / kv_heads;
      const int64_t b = std::upper_bound(tiles.begin(), tiles.end(), tile) - tiles.begin() - 1;
      const int64_t lo = (tile - tiles[b]) * kSplitTile, hi = std::min(len[b], lo + kSplitTile);
      const KT* const* k = kp + rows(b, h);
      const int64_t n_len = len[b];
      // As attend_item_avx2: up to 3 query heads a pass share each key load; keys asked for into
      // L1 kSplitAhead tokens ahead and into L2 8 kSplitAhead ahead (without it the tile's rows
      // arrive one latency after another).
      prefetch_rows(k, lo, std::min(lo + kSplitAhead, hi), d);
      prefetch_rows<KT, _MM_HINT_T1>(k, std::min(lo + kSplitAhead, hi),
                                     std::min(lo + 8 * kSplitAhead, hi), d);
      for (int64_t g = 0; g < group;) {
        const int64_t n = std::min<int64_t>(3, group - g), head = h * group + g;
        const float* qg = qf + (b * heads + head) * d;
        float* sg = scores + sc[b] + head * n_len;
        int64_t t = lo;
        for (; t + 8 <= hi; t += 8) {
          if (g == 0) {
            prefetch_rows(k, std::min(t + kSplitAhead, hi), std::min(t + kSplitAhead + 8, hi), d);
            prefetch_rows<KT, _MM_HINT_T1>(k, std::min(t + 8 * kSplitAhead, hi),
                                           std::min(t + 8 * kSplitAhead + 8, hi), d);
          }
          scores8_heads(n, qg, k + t, d, sg + t, n_len);
        }
        for (int64_t j = 0; j < n; ++j)
          for (int64_t u = t; u < hi; ++u) sg[j * n_len + u] = score1_avx2(qg + j * d, k[u], d);
        g += n;
      }
    }
  });
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / heads, head = item % heads;
      softmax_row_avx2(scores + sc[b] + head * len[b], len[b], softcap);
    }
  });
  const int64_t chunks = d / 32;
  at::parallel_for(0, batch * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i0 = (task % chunks) * 32, item = task / chunks;
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const KT* const* v = vp + rows(b, h);
      for (int64_t g0 = 0; g0 < group; g0 += 2) {
        const int64_t head = h * group + g0;
        const float* p = scores + sc[b] + head * len[b];
        float* o = out + (b * heads + head) * d;
        if (group - g0 >= 2)
          pv_chunk<2, KT, true>(p, v, len[b], d, i0, o);
        else
          pv_chunk<1, KT, true>(p, v, len[b], d, i0, o);
      }
    }
  });
}

// One layer's decode attention as work items (q and out in T, the KV cache in KT: T, or float16
// under float32 queries): the split path's phases (split: run_split), or items [0, items) that
// any thread runs in any share (run): per (sequence, KV head), or pieces of its query heads on the
// AVX2 path. The op runs them over at::parallel_for, the decode layer's team in its own shares.
template <typename T, typename KT>
struct DecodeWork {
  int64_t batch, heads, d, block_size, kv_heads, group;
  int64_t s_kv, s_block, s_tok, table_width;  // strides in elements of the contiguous cache
  const KT* cache;
  const T* qp;
  int64_t q_row, q_head;  // q may be a view into fused qkv
  T* op;
  const int32_t* tables;
  const int32_t* lens;
  float fscale, fsoftcap;
  int64_t window;
  bool vector = false, split = false;
  int64_t per = 1, pieces = 1, items = 0;

  DecodeWork(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
             const at::Tensor& seq_lens, double scale, int64_t window_, double softcap,
             at::Tensor& out, int64_t threads)
      : batch(q.size(0)), heads(q.size(1)), d(q.size(2)), block_size(kv_cache.size(2)),
        kv_heads(kv_cache.size(3)), group(heads / kv_heads), s_kv(kv_cache.stride(0)),
        s_block(kv_cache.stride(1)), s_tok(kv_cache.stride(2)), table_width(block_tables.size(1)),
        cache(kv_cache.data_ptr<KT>()), qp(q.data_ptr<T>()), q_row(q.stride(0)),
        q_head(q.stride(1)), op(out.data_ptr<T>()), tables(block_tables.data_ptr<int32_t>()),
        lens(seq_lens.data_ptr<int32_t>()), fscale(static_cast<float>(scale)),
        fsoftcap(static_cast<float>(softcap)), window(window_) {
    items = batch * kv_heads;
#ifdef KV_HAVE_AVX2_ATTENTION
    if constexpr (std::is_same_v<T, float>) {
      vector = cpu_has_avx2_fma() && d % 32 == 0;
      if (vector) {
        const bool few = batch * kv_heads < 2 * threads;
        int64_t longest = 0;
        for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b] - first_pos(lens[b]));
        split = few && longest >= kSplitFrom && split_on();
        // Work items: (sequence, KV head) with its query heads, whose K/V rows are then read and
        // widened once for the group; pieces of it when the items would share the threads unevenly.
        // Single query heads when there are fewer items than threads; pairs of query heads when a
        // few items do not divide among the threads (3 KV heads of 3 query heads on 2 threads: 6
        // items of 2 and 1 heads, 4.5 heads a thread rather than 6 and 3; measured 0.91-0.93x the
        // time of whole groups for one sequence); otherwise whole groups (3 KV heads on 2 threads
        // run 1.3-1.6x faster grouped than as 9 single heads). A head's values are the same however
        // its group is cut (attend_item_avx2's pairs of heads share value loads only).
        const int64_t grouped = batch * kv_heads;
        per = grouped < threads                                          ? 1
              : group > 2 && grouped % threads && grouped < 4 * threads ? 2
                                                                         : group;
        pieces = (group + per - 1) / per;  // items per (sequence, KV head)
        items = grouped * pieces;
      }
    }
#endif
  }

  // First context position a query of context length len attends to (its sliding window).
  int64_t first_pos(int64_t len) const { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

  // Context position pos's key row of KV head h in a sequence's block table (its value row is
  // s_kv further).
  const KT* key_row(const int32_t* table, int64_t pos, int64_t h) const {
    return cache + table[pos / block_size] * s_block + (pos % block_size) * s_tok + h * d;
  }

  void run_split() const {
#ifdef KV_HAVE_AVX2_ATTENTION
    if constexpr (std::is_same_v<T, float>) {
      std::vector<int64_t> len(batch), ctx(batch + 1, 0), sc(batch + 1, 0);
      for (int64_t b = 0; b < batch; ++b) {
        len[b] = lens[b] - first_pos(lens[b]);
        ctx[b + 1] = ctx[b] + len[b];
        sc[b + 1] = sc[b] + heads * len[b];
      }
      std::vector<float> qf(batch * heads * d), scores(sc[batch]);
      std::vector<const KT*> kp(ctx[batch] * kv_heads), vp(ctx[batch] * kv_heads);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < heads * d; ++i)
          qf[b * heads * d + i] = qp[b * q_row + (i / d) * q_head + i % d] * fscale;
      // The row pointers, per (sequence, KV head) on the threads (serial, they took a quarter of
      // the time at 4096 keys), block by block (no division per row).
      at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t b = item / kv_heads, h = item % kv_heads;
          const int32_t* table = tables + b * table_width;
          const int64_t start = first_pos(lens[b]), at = ctx[b] * kv_heads + h * len[b];
          for (int64_t t = 0; t < len[b];) {
            const int64_t pos = start + t, off = pos % block_size;
            const int64_t run = std::min(block_size - off, len[b] - t);
            const KT* row = cache + table[pos / block_size] * s_block + off * s_tok + h * d;
            for (int64_t i = 0; i < run; ++i, ++t, row += s_tok) {
              kp[at + t] = row;
              vp[at + t] = row + s_kv;
            }
          }
        }
      });
      attend_split_avx2(qf.data(), kp.data(), vp.data(), len.data(), ctx.data(), sc.data(),
                        batch, heads, kv_heads, d, fsoftcap, scores.data(), op);
    }
#endif
  }

  void run(int64_t begin, int64_t end) const {
#ifdef KV_HAVE_AVX2_ATTENTION
    if constexpr (std::is_same_v<T, float>) {
      if (vector) {
        std::vector<float> qf(per * d), scores;
        std::vector<const KT*> kp, vp;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t b = item / (kv_heads * pieces), h = item / pieces % kv_heads;
          const int64_t first = h * group + item % pieces * per;
          const int64_t count = std::min(per, (h + 1) * group - first);
          const int64_t start = first_pos(lens[b]), len = lens[b] - start;
          const int32_t* table = tables + b * table_width;
          for (int64_t g = 0; g < count; ++g) {
            const T* qh = qp + b * q_row + (first + g) * q_head;
            for (int64_t i = 0; i < d; ++i) qf[g * d + i] = qh[i] * fscale;
          }
          kp.resize(len), vp.resize(len), scores.resize(count * len);
          for (int64_t t = 0; t < len; ++t) {
            const int64_t pos = start + t;
            kp[t] = key_row(table, pos, h);
            vp[t] = kp[t] + s_kv;
          }
          attend_item_avx2(qf.data(), kp.data(), vp.data(), len, count, d, fsoftcap,
                           scores.data(), op + (b * heads + first) * d);
        }
        return;
      }
    }
#endif
    std::vector<float> qf(group * d), acc(group * d), scores, tmp(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t start = first_pos(lens[b]), len = lens[b] - start;
      const int32_t* table = tables + b * table_width;
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = qp + b * q_row + (h * group + g) * q_head;
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(qh[i]) * fscale;
      }
      scores.assign(group * len, 0.f);  // [len, group]
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = start + t;
        const KT* k = key_row(table, pos, h);
        dot_group<KT>(qf.data(), k, group, d, scores.data() + t * group);
      }
      softcap_scores(scores.data(), group * len, fsoftcap);
      std::vector<float> mx(group, -std::numeric_limits<float>::infinity()), sum(group, 0.f);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t g = 0; g < group; ++g) mx[g] = std::max(mx[g], scores[t * group + g]);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const float e = std::exp(scores[t * group + g] - mx[g]);
          scores[t * group + g] = e;
          sum[g] += e;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = start + t;
        const KT* v = key_row(table, pos, h) + s_kv;
        axpy_group<KT>(scores.data() + t * group, v, group, d, acc.data());
      }
      T* ob = op + (b * heads + h * group) * d;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = len > 0 ? 1.f / sum[g] : 0.f;
        for (int64_t i = 0; i < d; ++i) ob[g * d + i] = static_cast<T>(acc[g * d + i] * inv);
      }
    }
  }
};

template <typename T, typename KT>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                   at::Tensor& out) {
  const DecodeWork<T, KT> work(q, kv_cache, block_tables, seq_lens, scale, window, softcap, out,
                               at::get_num_threads());
  if (work.split) {
    work.run_split();
    return;
  }
  at::parallel_for(0, work.items, 1, [&](int64_t begin, int64_t end) { work.run(begin, end); });
}

// The op's tensors as the kernels read them, after its checks.
struct DecodeArgs {
  at::Tensor q, tables, lens;
};

DecodeArgs decode_args(const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window,
                       double softcap) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad shapes");
  TORCH_CHECK(kv_dtype_ok(q.scalar_type(), kv_cache.scalar_type()), kKVDtypeError);
  TORCH_CHECK(kv_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block tables and seq lens must be int32");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(2) <= 512, "head_dim mismatch or > 512");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  DecodeArgs a{q.stride(2) == 1 ? q : q.contiguous(), block_tables.contiguous(),
               seq_lens.contiguous()};
  TORCH_CHECK(a.tables.size(0) >= a.q.size(0) && a.lens.size(0) >= a.q.size(0),
              "too few sequences");
  return a;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window, double softcap) {
  const DecodeArgs a = decode_args(q, kv_cache, block_tables, seq_lens, window, softcap);
  const at::Tensor& qc = a.q;
  auto out = at::empty({qc.size(0), qc.size(1), qc.size(2)}, qc.options());
  if (qc.scalar_type() != kv_cache.scalar_type()) {  // float32 queries over a float16 cache
    decode_kernel<float, c10::Half>(qc, kv_cache, a.tables, a.lens, scale, window, softcap, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t, scalar_t>(qc, kv_cache, a.tables, a.lens, scale, window, softcap,
                                      out);
  });
  return out;
}

// The decode layer's team view of one layer's attention (layer_rows.h): float32 queries.
template <typename KT>
struct TeamAttention final : kvrows::DecodeAttention {
  DecodeArgs args;
  at::Tensor cache, out;
  DecodeWork<float, KT> work;

  TeamAttention(DecodeArgs a, const at::Tensor& kv_cache, double scale, int64_t window,
                double softcap, const at::Tensor& o, int64_t threads)
      : args(std::move(a)), cache(kv_cache), out(o),
        work(args.q, cache, args.tables, args.lens, scale, window, softcap, out, threads) {}
  int64_t items() const override { return work.items; }
  void run(int64_t begin, int64_t end) const override { work.run(begin, end); }
};

// -------------------------------------------------------------------------------- RMSNorm

// out = weight * T(x * rsqrt(mean(x^2) + eps)), the float32 statistics of torch's rms_norm.
// (Columns [c0, c1) of out only, when given: the same values, the sum always of the whole row.)
template <typename T>
KV_TARGETS void rms_norm_row(const T* x, const T* w, int64_t h, float eps, T* out, int64_t c0 = 0,
                             int64_t c1 = -1) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_f(x[i + j]);
      acc[j] += v * v;
    }
  float s = 0.f;
  for (; i < h; ++i) s += to_f(x[i]) * to_f(x[i]);
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  const float inv = 1.f / std::sqrt(s / static_cast<float>(h) + eps);
  for (int64_t k = c0; k < (c1 < 0 ? h : c1); ++k) {
    const T normed = static_cast<T>(to_f(x[k]) * inv);
    out[k] = static_cast<T>(to_f(w[k]) * to_f(normed));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && weight.dim() == 1, "x [n, h], weight [h]");
  TORCH_CHECK(x.size(1) == weight.size(0) && x.scalar_type() == weight.scalar_type(), "shapes");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = xc.size(0), h = xc.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row<scalar_t>(xp + r * h, wp, h, static_cast<float>(eps), op + r * h);
    });
  });
  return out;
}

// ------------------------------------------------------------ rotary + KV-cache write

// In place on qkv [n, (heads + 2 * kv_heads) * d]: rotate the q and k heads ("rotate half":
// x1 * cos - x2 * sin, x2 * cos + x1 * sin, each product rounded to T), then store k and v at
// their cache slots (rounded to the cache's KT: T, or float16 under float32). cos, sin: [n, d / 2].
// (Heads [h0, h1) of the heads + 2 kv_heads of x only, when given: q and k heads rotated, k and v
// heads written to the cache.)
template <typename T, typename KT>
void rope_write_kv_row(T* x, const T* c, const T* s, KT* kd, int64_t kv_plane, int64_t heads,
                       int64_t kv_heads, int64_t d, int64_t h0 = 0, int64_t h1 = -1) {
  const int64_t half = d / 2, all = heads + 2 * kv_heads, end = h1 < 0 ? all : h1;
  for (int64_t hd = h0; hd < std::min(end, heads + kv_heads); ++hd) {
    T* x1 = x + hd * d;
    T* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = to_f(x1[i]), b = to_f(x2[i]), ci = to_f(c[i]), si = to_f(s[i]);
      const T ac = static_cast<T>(a * ci), bs = static_cast<T>(b * si);
      const T bc = static_cast<T>(b * ci), as = static_cast<T>(a * si);
      x1[i] = static_cast<T>(to_f(ac) - to_f(bs));
      x2[i] = static_cast<T>(to_f(bc) + to_f(as));
    }
  }
  // float -> half: c10's round-to-nearest-even; k heads to the K plane, v heads to the V plane
  for (int64_t hd = std::max(h0, heads); hd < end; ++hd) {
    const bool v = hd >= heads + kv_heads;
    const T* src = x + hd * d;
    KT* dst = kd + (v ? kv_plane + (hd - heads - kv_heads) * d : (hd - heads) * d);
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<KT>(src[i]);
  }
}

template <typename T, typename KT>
void rope_write_kv_kernel(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& kv_cache, const at::Tensor& slots, int64_t heads,
                          int64_t kv_heads) {
  const int64_t n = qkv.size(0), d = kv_cache.size(4);
  const int64_t row = qkv.stride(0), kv_plane = kv_cache.stride(0);
  T* base = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t cos_row = cos.stride(0);
  KT* cache = kv_cache.data_ptr<KT>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t slot_stride = kv_heads * d;  // one token of one plane (K or V)
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rope_write_kv_row<T, KT>(base + t * row, cp + t * cos_row, sp + t * cos_row,
                               cache + slot[t] * slot_stride, kv_plane, heads, kv_heads, d);
  });
}

void rope_write_kv(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor kv_cache, const at::Tensor& slot_mapping, int64_t heads,
                   int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv [n, width] with unit column stride");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "contiguous KV cache expected");
  const int64_t d = kv_cache.size(4);
  TORCH_CHECK(d % 2 == 0 && kv_cache.size(3) == kv_heads, "head_dim even, kv heads match");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * d, "qkv width != (heads + 2 kv) * d");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == d / 2 && cos.stride(1) == 1, "cos [n, d / 2]");
  TORCH_CHECK(sin.sizes() == cos.sizes() && sin.strides() == cos.strides(), "sin like cos");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && slot_mapping.size(0) == qkv.size(0), "token counts");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slots");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "qkv, cos and sin must share a dtype");
  TORCH_CHECK(kv_dtype_ok(qkv.scalar_type(), kv_cache.scalar_type()), kKVDtypeError);
  if (qkv.scalar_type() != kv_cache.scalar_type()) {
    rope_write_kv_kernel<float, c10::Half>(qkv, cos, sin, kv_cache, slot_mapping, heads, kv_heads);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_kv", [&] {
    rope_write_kv_kernel<scalar_t, scalar_t>(qkv, cos, sin, kv_cache, slot_mapping, heads,
                                             kv_heads);
  });
}

}  // namespace

std::unique_ptr<kvrows::DecodeAttention> kvrows::decode_attention(
    const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, double scale, int64_t window, double softcap, const at::Tensor& out,
    int64_t threads) {
  DecodeArgs a = decode_args(q, kv_cache, block_tables, seq_lens, window, softcap);
  TORCH_CHECK(a.q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  out.is_contiguous() && out.sizes() == a.q.sizes(),
              "decode_attention: float32 queries and a contiguous output of their shape");
  std::unique_ptr<kvrows::DecodeAttention> work;
  if (kv_cache.scalar_type() == at::kHalf) {
    auto w = std::make_unique<TeamAttention<c10::Half>>(std::move(a), kv_cache, scale, window,
                                                        softcap, out, threads);
    if (!w->work.split) work = std::move(w);
  } else {
    auto w = std::make_unique<TeamAttention<float>>(std::move(a), kv_cache, scale, window,
                                                    softcap, out, threads);
    if (!w->work.split) work = std::move(w);
  }
  return work;
}

void kvrows::rms_norm(const float* x, const float* w, int64_t h, float eps, float* out,
                      int64_t c0, int64_t c1) {
  rms_norm_row<float>(x, w, h, eps, out, c0, c1);
}

void kvrows::rope_write_kv(float* x, const float* cos, const float* sin, float* cache32,
                           c10::Half* cache16, int64_t slot, int64_t kv_plane, int64_t heads,
                           int64_t kv_heads, int64_t d, int64_t h0, int64_t h1) {
  const int64_t at = slot * kv_heads * d;
  if (cache16 != nullptr)
    rope_write_kv_row<float, c10::Half>(x, cos, sin, cache16 + at, kv_plane, heads, kv_heads, d,
                                        h0, h1);
  else
    rope_write_kv_row<float, float>(x, cos, sin, cache32 + at, kv_plane, heads, kv_heads, d, h0,
                                    h1);
}

TORCH_LIBRARY(kvserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("decode_split_select", &decode_split_select);
  m.def(
      "rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, "
      "Tensor slot_mapping, int heads, int kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
}
