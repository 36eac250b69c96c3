// kvserve's CPU kernels. Paged decode attention: each decode sequence's single query attends over
// its context read straight from the paged KV cache (no gathered or padded copy); one work item per
// (sequence, KV head), so a sequence's result never depends on which other sequences share the step.
// A split path for a few sequences over long contexts (each item's three steps as phases over all
// the threads: the same arithmetic in the same order, so the same bits; DecodeWork below);
// kvserve::decode_split_select(0) turns it off.
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
#include "attention_bf16.h"
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

// The split path's key tile (context tokens per score task: a multiple of the 8-token runs, so
// every run lies in one task) and the context length from which it runs; key rows a score task asks
// for ahead of use into L1 and into L2 (the paged rows are too scattered for the hardware
// prefetcher; its P.V asks for values ahead as pv_chunk does).
constexpr int64_t kSplitTile = 512;
constexpr int64_t kSplitFrom = 512;
constexpr int64_t kNearRows = 16, kFarRows = 64;

// Whether the split path runs where it applies: 1 (the default) or 0 (never; kvserve::
// decode_split_select, for tests and for measuring it against the per-item path).
std::atomic<int> split_mode{1};

bool split_on() { return split_mode.load(std::memory_order_relaxed) == 1; }

// Sets the split path's mode (0 off, 1 on where it applies); returns the one it replaces.
int64_t decode_split_select(int64_t mode) {
  TORCH_CHECK(mode == 0 || mode == 1, "decode_split_select: mode must be 0 or 1, not ", mode);
  return split_mode.exchange(static_cast<int>(mode));
}

#ifdef KV_HAVE_AVX2_ATTENTION
// The split path's score task: keys [lo, hi) of one (sequence, KV head), their K rows at kp[0..),
// scored for the group's query heads (qg [group, d] pre-scaled) into sg (head g's scores at
// sg + g * len, indexed by context position), as attend_item_avx2 scores them: up to 3 heads a pass
// sharing each key load, runs of 8 from the context's first token, the tail (the last task's
// tokens after its last full run) with score1_avx2.
template <typename KT>
KV_AVX2 void split_scores_task(const float* qg, const KT* const* kp, int64_t lo, int64_t hi,
                               int64_t len, int64_t group, int64_t d, float* sg) {
  const int64_t n_rows = hi - lo;
  prefetch_rows(kp, 0, std::min(kNearRows, n_rows), d);
  prefetch_rows<KT, _MM_HINT_T1>(kp, std::min(kNearRows, n_rows), std::min(kFarRows, n_rows), d);
  for (int64_t g = 0; g < group;) {
    const int64_t n = std::min<int64_t>(3, group - g);
    int64_t t = 0;
    for (; t + 8 <= n_rows; t += 8) {
      if (g == 0) {
        prefetch_rows(kp, std::min(t + kNearRows, n_rows), std::min(t + kNearRows + 8, n_rows), d);
        prefetch_rows<KT, _MM_HINT_T1>(kp, std::min(t + kFarRows, n_rows),
                                       std::min(t + kFarRows + 8, n_rows), d);
      }
      scores8_heads(n, qg + g * d, kp + t, d, sg + g * len + lo + t, len);
    }
    for (int64_t j = g; j < g + n; ++j)
      for (int64_t u = t; u < n_rows; ++u) sg[j * len + lo + u] = score1_avx2(qg + j * d, kp[u], d);
    g += n;
  }
}

// The split path's P.V task: values [i0, i0 + 32) of the group's query heads of one (sequence, KV
// head), probabilities of head g at p + g * len, outputs at out + g * d; 3 heads a pass (each
// value load shared by them).
template <typename KT>
KV_AVX2 void split_pv_task(const float* p, const KT* const* vp, int64_t len, int64_t group,
                           int64_t d, int64_t i0, float* out) {
  for (int64_t g = 0; g < group;) {  // pv_chunk with its values asked for ahead (PF)
    const int64_t n = std::min<int64_t>(3, group - g);
    if (n == 3)
      pv_chunk<3, KT, true>(p + g * len, vp, len, d, i0, out + g * d);
    else if (n == 2)
      pv_chunk<2, KT, true>(p + g * len, vp, len, d, i0, out + g * d);
    else
      pv_chunk<1, KT, true>(p + g * len, vp, len, d, i0, out + g * d);
    g += n;
  }
}
#endif

// One layer's decode attention as work items (q and out in T, the KV cache in KT: T, or float16
// under float32 queries), run in phases (each after every thread finished the one before) whose
// items any thread runs in any share: one phase of items per (sequence, KV head), or pieces of its
// query heads on the AVX2 path (run); or, over long contexts, the split path's three (run_split).
// The op runs each phase over at::parallel_for, the decode layer's team in its own shares.
//
// The split path (AVX2 path, more than one thread, some sequence attending to kSplitFrom keys or
// more): each item's three steps become phases over all the threads: 0, scores per (sequence, KV
// head, tile of kSplitTile keys), each key row read once for the group's query heads; 1, each
// (sequence, query head)'s softmax whole; 2, P.V per (sequence, KV head, 32 output values), each
// value load shared by the group's heads. Every value is computed as attend_item_avx2 computes it
// (the same scores8 runs and tail, softmax and fma chains over the keys in increasing order), so
// the same bits. The scores live in a scratch the caller provides (scratch_floats(), set_scratch).
// Where per-item work streams one item's scattered rows on one thread (3 KV heads on 2 threads:
// one thread reads two heads' rows), the phases spread every item's rows over the threads, tiles
// asked for ahead. Whole decode steps in the engine (AVX-512 EPYC, 2 threads, SmolLM2 Q4_0, float16
// cache, the two paths alternated, medians): one sequence 0.91x the per-item step at 768 keys,
// 0.72-0.77x at 2048-4000, no difference at 384-512; two sequences 0.75x at 4000 keys; 4 to 16
// sequences 0.83-1.00x at 512-3000 keys.
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
  bool bf16_hw = false;  // a bfloat16 cache: the hardware compilation of its kernels runs
  int64_t per = 1, pieces = 1, items = 0;
  // The split path: per sequence, where its scores start in the scratch and its first score task
  // (batch + 1 entries each); the scratch.
  std::vector<int64_t> score_at, task_at;
  float* scratch = nullptr;

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
      // (Here, not in a parallel region: the first call runs the probe.)
      if constexpr (std::is_same_v<KT, bf16>) bf16_hw = vector && bf16_use_hw();
      if (vector) {
        int64_t longest = 0;
        for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, context(b));
        split = threads > 1 && longest >= kSplitFrom && split_on();
        if (split) {
          score_at.assign(batch + 1, 0), task_at.assign(batch + 1, 0);
          for (int64_t b = 0; b < batch; ++b) {
            score_at[b + 1] = score_at[b] + heads * context(b);
            task_at[b + 1] = task_at[b] + kv_heads * tiles(b);
          }
          return;
        }
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
  // Sequence b's attended context length, and its split path's key tiles.
  int64_t context(int64_t b) const { return lens[b] - first_pos(lens[b]); }
  int64_t tiles(int64_t b) const { return (context(b) + kSplitTile - 1) / kSplitTile; }

  // Context position pos's key row of KV head h in a sequence's block table (its value row is
  // s_kv further).
  const KT* key_row(const int32_t* table, int64_t pos, int64_t h) const {
    return cache + table[pos / block_size] * s_block + (pos % block_size) * s_tok + h * d;
  }

  // The K rows (V rows: plane 1) of KV head h for sequence b's attended tokens [lo, hi) into
  // out[0, hi - lo), block by block (no division per row).
  void rows(int64_t b, int64_t h, int64_t lo, int64_t hi, int plane, const KT** out) const {
    const int32_t* table = tables + b * table_width;
    const int64_t start = first_pos(lens[b]);
    for (int64_t t = lo; t < hi;) {
      const int64_t pos = start + t, off = pos % block_size;
      const int64_t run = std::min(block_size - off, hi - t);
      const KT* row =
          cache + table[pos / block_size] * s_block + off * s_tok + h * d + plane * s_kv;
      for (int64_t i = 0; i < run; ++i, ++t, row += s_tok) out[t - lo] = row;
    }
  }

  int phases() const { return split ? 3 : 1; }
  int64_t phase_items(int phase) const {
    if (!split) return items;
    return phase == 0 ? task_at[batch] : phase == 1 ? batch * heads : batch * kv_heads * (d / 32);
  }
  // A split-path task of phase 0 (sequence b, KV head h, keys [lo, hi) of its len) or phase 2
  // (sequence b, KV head h, output values [lo, lo + 32)).
  struct SplitTask {
    int64_t b, h, len, lo, hi;
  };
  SplitTask split_task(int phase, int64_t task) const {
    if (phase == 0) {  // the tiles of a head together
      const int64_t b = std::upper_bound(task_at.begin(), task_at.end(), task) - task_at.begin() - 1;
      const int64_t n_tiles = tiles(b), local = task - task_at[b], len = context(b);
      const int64_t lo = local % n_tiles * kSplitTile;
      return {b, local / n_tiles, len, lo, std::min(len, lo + kSplitTile)};
    }
    const int64_t chunks = d / 32, item = task / chunks, i0 = task % chunks * 32;
    const int64_t b = item / kv_heads;
    return {b, item % kv_heads, context(b), i0, i0 + 32};
  }

  // Floats of scratch the split path's scores take (0: none needed).
  int64_t scratch_floats() const { return split ? score_at[batch] : 0; }

  void run_phase(int phase, int64_t begin, int64_t end) const {
    if (split)
      run_split(phase, begin, end);
    else
      run(begin, end);
  }

  void run_split(int phase, int64_t begin, int64_t end) const {
#ifdef KV_HAVE_AVX2_ATTENTION
    if constexpr (std::is_same_v<T, float> && std::is_same_v<KT, bf16>) {
      if (bf16_hw)
        run_split_bf16<true>(phase, begin, end);
      else
        run_split_bf16<false>(phase, begin, end);
    } else if constexpr (std::is_same_v<T, float>) {
      thread_local std::vector<const KT*> row_buf;
      thread_local std::vector<float> qf;
      for (int64_t task = begin; task < end; ++task) {
        if (phase == 0) {  // scores: (sequence, KV head, key tile)
          const auto [b, h, len, lo, hi] = split_task(phase, task);
          qf.resize(group * d);
          for (int64_t g = 0; g < group; ++g) {
            const T* qh = qp + b * q_row + (h * group + g) * q_head;
            for (int64_t i = 0; i < d; ++i) qf[g * d + i] = qh[i] * fscale;
          }
          row_buf.resize(hi - lo);
          rows(b, h, lo, hi, 0, row_buf.data());
          split_scores_task<KT>(qf.data(), row_buf.data(), lo, hi, len, group, d,
                                scratch + score_at[b] + h * group * len);
        } else if (phase == 1) {  // softmax: (sequence, query head)
          const int64_t b = task / heads, head = task % heads, len = context(b);
          softmax_row_avx2(scratch + score_at[b] + head * len, len, fsoftcap);
        } else {  // P.V: (sequence, KV head, 32 output values)
          const auto [b, h, len, i0, i1] = split_task(phase, task);
          row_buf.resize(len);
          rows(b, h, 0, len, 1, row_buf.data());
          split_pv_task<KT>(scratch + score_at[b] + h * group * len, row_buf.data(), len, group, d,
                            i0, op + (b * heads + h * group) * d);
        }
      }
    }
#endif
  }

#ifdef KV_HAVE_AVX2_ATTENTION
  // The split path's phases over a bfloat16 cache (attention_bf16.h): the same tasks, the bf16
  // kernels (HW: the hardware compilation), denormals flushed.
  template <bool HW>
  void run_split_bf16(int phase, int64_t begin, int64_t end) const {
    FlushDenormals flush;
    thread_local std::vector<const bf16*> row_buf;
    thread_local std::vector<uint16_t> qb;
    for (int64_t task = begin; task < end; ++task) {
      if (phase == 0) {
        const auto [b, h, len, lo, hi] = split_task(phase, task);
        qb.resize(group * d);
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = qp + b * q_row + (h * group + g) * q_head;
          if constexpr (HW)
            bf16_hw::round_query(qh, fscale, d, qb.data() + g * d);
          else
            bf16_emu::round_query(qh, fscale, d, qb.data() + g * d);
        }
        row_buf.resize(hi - lo);
        rows(b, h, lo, hi, 0, row_buf.data());
        float* sg = scratch + score_at[b] + h * group * len;
        if constexpr (HW)
          bf16_hw::split_scores(qb.data(), row_buf.data(), lo, hi, len, group, d, sg);
        else
          bf16_emu::split_scores(qb.data(), row_buf.data(), lo, hi, len, group, d, sg);
      } else if (phase == 1) {
        const int64_t b = task / heads, head = task % heads, len = context(b);
        float* p = scratch + score_at[b] + head * len;
        if constexpr (HW)
          bf16_hw::softmax_probs(p, len, fsoftcap);
        else
          bf16_emu::softmax_probs(p, len, fsoftcap);
      } else {
        const auto [b, h, len, i0, i1] = split_task(phase, task);
        row_buf.resize(len + 1);
        rows(b, h, 0, len, 1, row_buf.data());
        row_buf[len] = zero_row();
        const float* p = scratch + score_at[b] + h * group * len;
        float* o = op + (b * heads + h * group) * d;
        if constexpr (HW)
          bf16_hw::split_pv(p, row_buf.data(), len, group, d, i0, o);
        else
          bf16_emu::split_pv(p, row_buf.data(), len, group, d, i0, o);
      }
    }
  }

  // run's items over a bfloat16 cache.
  template <bool HW>
  void run_bf16(int64_t begin, int64_t end) const {
    FlushDenormals flush;
    std::vector<uint16_t> qb(per * d);
    std::vector<float> scores;
    std::vector<const bf16*> kp, vp;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (kv_heads * pieces), h = item / pieces % kv_heads;
      const int64_t first = h * group + item % pieces * per;
      const int64_t count = std::min(per, (h + 1) * group - first);
      const int64_t len = lens[b] - first_pos(lens[b]);
      for (int64_t g = 0; g < count; ++g) {
        const float* qh = qp + b * q_row + (first + g) * q_head;
        if constexpr (HW)
          bf16_hw::round_query(qh, fscale, d, qb.data() + g * d);
        else
          bf16_emu::round_query(qh, fscale, d, qb.data() + g * d);
      }
      kp.resize(len), vp.resize(len + 1), scores.resize(count * len);
      rows(b, h, 0, len, 0, kp.data());
      for (int64_t t = 0; t < len; ++t) vp[t] = kp[t] + s_kv;
      vp[len] = zero_row();
      float* o = op + (b * heads + first) * d;
      if constexpr (HW)
        bf16_hw::attend_item(qb.data(), kp.data(), vp.data(), len, count, d, fsoftcap,
                             scores.data(), o);
      else
        bf16_emu::attend_item(qb.data(), kp.data(), vp.data(), len, count, d, fsoftcap,
                              scores.data(), o);
    }
  }
#endif

  void run(int64_t begin, int64_t end) const {
#ifdef KV_HAVE_AVX2_ATTENTION
    if constexpr (std::is_same_v<T, float> && std::is_same_v<KT, bf16>) {
      if (vector) {
        if (bf16_hw)
          run_bf16<true>(begin, end);
        else
          run_bf16<false>(begin, end);
        return;
      }
    } else if constexpr (std::is_same_v<T, float>) {
      if (vector) {
        std::vector<float> qf(per * d), scores;
        std::vector<const KT*> kp, vp;
        for (int64_t item = begin; item < end; ++item) {
          const int64_t b = item / (kv_heads * pieces), h = item / pieces % kv_heads;
          const int64_t first = h * group + item % pieces * per;
          const int64_t count = std::min(per, (h + 1) * group - first);
          const int64_t len = lens[b] - first_pos(lens[b]);
          for (int64_t g = 0; g < count; ++g) {
            const T* qh = qp + b * q_row + (first + g) * q_head;
            for (int64_t i = 0; i < d; ++i) qf[g * d + i] = qh[i] * fscale;
          }
          kp.resize(len), vp.resize(len), scores.resize(count * len);
          rows(b, h, 0, len, 0, kp.data());
          for (int64_t t = 0; t < len; ++t) vp[t] = kp[t] + s_kv;
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
  DecodeWork<T, KT> work(q, kv_cache, block_tables, seq_lens, scale, window, softcap, out,
                         at::get_num_threads());
  thread_local std::vector<float> scratch;  // the split path's scores, kept across calls
  scratch.resize(work.scratch_floats());
  work.scratch = scratch.data();
  for (int phase = 0; phase < work.phases(); ++phase)
    at::parallel_for(0, work.phase_items(phase), 1,
                     [&](int64_t begin, int64_t end) { work.run_phase(phase, begin, end); });
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
  if (qc.scalar_type() != kv_cache.scalar_type()) {  // float32 queries, a 16-bit cache
    if (kv_cache.scalar_type() == at::kBFloat16)
      decode_kernel<float, c10::BFloat16>(qc, kv_cache, a.tables, a.lens, scale, window, softcap,
                                          out);
    else
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
  int phases() const override { return work.phases(); }
  int64_t items(int phase) const override { return work.phase_items(phase); }
  void run(int phase, int64_t begin, int64_t end) const override {
    work.run_phase(phase, begin, end);
  }
  int64_t scratch_floats() const override { return work.scratch_floats(); }
  void set_scratch(float* scratch) override { work.scratch = scratch; }
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
    if (kv_cache.scalar_type() == at::kBFloat16)
      rope_write_kv_kernel<float, c10::BFloat16>(qkv, cos, sin, kv_cache, slot_mapping, heads,
                                                 kv_heads);
    else
      rope_write_kv_kernel<float, c10::Half>(qkv, cos, sin, kv_cache, slot_mapping, heads,
                                             kv_heads);
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
  if (kv_cache.scalar_type() == at::kHalf)
    return std::make_unique<TeamAttention<c10::Half>>(std::move(a), kv_cache, scale, window,
                                                      softcap, out, threads);
  if (kv_cache.scalar_type() == at::kBFloat16)
    return std::make_unique<TeamAttention<c10::BFloat16>>(std::move(a), kv_cache, scale, window,
                                                          softcap, out, threads);
  return std::make_unique<TeamAttention<float>>(std::move(a), kv_cache, scale, window, softcap,
                                                out, threads);
}

void kvrows::rms_norm(const float* x, const float* w, int64_t h, float eps, float* out,
                      int64_t c0, int64_t c1) {
  rms_norm_row<float>(x, w, h, eps, out, c0, c1);
}

void kvrows::rope_write_kv(float* x, const float* cos, const float* sin, float* cache32,
                           c10::Half* cache16, c10::BFloat16* cache_bf16, int64_t slot,
                           int64_t kv_plane, int64_t heads, int64_t kv_heads, int64_t d, int64_t h0,
                           int64_t h1) {
  const int64_t at = slot * kv_heads * d;
  if (cache16 != nullptr)
    rope_write_kv_row<float, c10::Half>(x, cos, sin, cache16 + at, kv_plane, heads, kv_heads, d,
                                        h0, h1);
  else if (cache_bf16 != nullptr)
    rope_write_kv_row<float, c10::BFloat16>(x, cos, sin, cache_bf16 + at, kv_plane, heads,
                                            kv_heads, d, h0, h1);
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
