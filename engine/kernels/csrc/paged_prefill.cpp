// Paged prefill attention: every query token of a step (prefill chunks and decodes alike) attends over
// its own causal context read in place from the paged KV cache, bitwise as the decode kernel
// (paged_decode.cpp) computes that token alone: a token's result is the same whether its prompt was
// prefilled whole, in chunks, after a prefix-cache hit or decoded token by token.
//
// Instead of one pass over the whole context per query (the decode kernel run per token), one work
// item takes a block of a chunk's rows with all query heads of one KV head (kRows x group query
// vectors) and walks the context in key tiles of kKeyTile tokens, so each tile of K and V is read
// from memory once and reused from L1 by every query vector of the block. Each vector's arithmetic
// is the decode kernel's, in its order: its scores in runs of 8 tokens counted from its own first
// visible key (scores8_avx2; hsum1 for the tail), a run belonging to the tile where it starts; then
// the decode softmax over its whole row (softmax_row_avx2); then P.V as one fma chain per output
// value over its keys in increasing position, the running sums kept in the output between tiles.
// The threads take work items one at a time, the costliest first (a causal chunk's late rows read
// more keys than its first): a thread slowed by a neighbour takes fewer, and none waits long for
// the last. Which thread runs an item changes nothing in its result.
//
// Over a bfloat16 cache the item runs attention_bf16_kernels.inc's prefill_item, the same order in
// bf16 dot steps; where AVX-512 BF16 runs, its scores come from each key tile transposed (16 keys a
// register, no horizontal sums), the same bits.
//
// The AVX2 + FMA float32 path with head_dim % 32 == 0 (over a float32 or float16 cache) is the decode
// kernel's fast path; anything else runs the decode kernel itself per token (each token given its
// own table row and length).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_avx2.h"
#include "attention_bf16.h"

namespace {

using namespace kvserve_attention;

constexpr int64_t kRows = 16;     // chunk rows per work item (x group query vectors)
constexpr int64_t kKeyTile = 64;   // context tokens per K/V tile

#ifdef KV_HAVE_AVX2_ATTENTION
// acc_a[:] += sum_{t in [lo, hi)} p_a[t] v[t, :] for GN query vectors, the running sums in acc_a:
// one fma per key in increasing t, as the decode kernel's pv_pass (32 values of d per pass).
template <int GN, typename KT>
KV_AVX2 void pv_segment(const float* const* p, const KT* const* vp, int64_t lo, int64_t hi,
                        int64_t d, float* const* acc_out) {
  for (int64_t i0 = 0; i0 < d; i0 += 32) {
    __m256 acc[GN][4];
    for (int a = 0; a < GN; ++a)
      for (int b = 0; b < 4; ++b) acc[a][b] = _mm256_loadu_ps(acc_out[a] + i0 + 8 * b);
    for (int64_t t = lo; t < hi; ++t) {
      __m256 v[4];
      for (int b = 0; b < 4; ++b) v[b] = load8(vp[t] + i0 + 8 * b);
      for (int a = 0; a < GN; ++a) {
        const __m256 w = _mm256_broadcast_ss(p[a] + t);
        for (int b = 0; b < 4; ++b) acc[a][b] = _mm256_fmadd_ps(w, v[b], acc[a][b]);
      }
    }
    for (int a = 0; a < GN; ++a)
      for (int b = 0; b < 4; ++b) _mm256_storeu_ps(acc_out[a] + i0 + 8 * b, acc[a][b]);
  }
}

// One query vector of a work item: its first visible key and its causal end (absolute positions),
// its scores (then probabilities) indexed by absolute position, its output row.
struct QueryVec {
  int64_t start, end;
  const float* q;
  float* p;  // p[t] for t in [start, end)
  float* out;
};

// Where a vector's full runs of 8 end (runs are counted from its first visible key; the tokens
// after the last full run are its tail, scored one by one with hsum1).
inline int64_t run_end(const QueryVec& x) {
  const int64_t len = x.end - x.start;
  return x.start + (len - len % 8);
}

// The tail scores of x in [lo, hi) (the part of this tile at or after run_end).
template <typename KT>
KV_AVX2 inline void tail_scores(QueryVec& x, int64_t lo, int64_t hi, const KT* const* kp,
                                int64_t d) {
  for (int64_t t = std::max(lo, run_end(x)); t < hi; ++t) x.p[t] = score1_avx2(x.q, kp[t], d);
}

// The work item's vectors over key tiles. kp / vp index absolute positions.
template <typename KT>
KV_AVX2 void prefill_item_avx2(std::vector<QueryVec>& vecs, const KT* const* kp,
                               const KT* const* vp, int64_t first, int64_t last, int64_t d,
                               float softcap) {
  for (int64_t t0 = first; t0 < last; t0 += kKeyTile) {  // scores, tile by tile
    const int64_t t1 = std::min(last, t0 + kKeyTile);
    for (size_t i = 0; i < vecs.size(); ++i) {
      QueryVec& x = vecs[i];
      const int64_t lo = std::max(t0, x.start), hi = std::min(t1, x.end);
      if (lo >= hi) continue;
      int64_t t = x.start + (lo - x.start + 7) / 8 * 8;  // the first run starting in this tile
      const int64_t stop = std::min(hi, run_end(x));     // runs starting before it are full
      if (i + 1 < vecs.size() && vecs[i + 1].start == x.start) {
        // The next vector's runs start at the same positions: the runs both have, together.
        QueryVec& y = vecs[i + 1];
        const int64_t both = std::min(stop, std::min(std::min(t1, y.end), run_end(y)));
        for (; t < both; t += 8) scores8x2_avx2(x.q, y.q, kp + t, d, x.p + t, y.p + t);
        int64_t ty = t;
        for (; ty < std::min(std::min(t1, y.end), run_end(y)); ty += 8)
          scores8_avx2(y.q, kp + ty, d, y.p + ty);
        tail_scores(y, lo, std::min(t1, y.end), kp, d);
        ++i;
      }
      for (; t < stop; t += 8) scores8_avx2(x.q, kp + t, d, x.p + t);
      tail_scores(x, lo, hi, kp, d);
    }
  }
  for (QueryVec& x : vecs) softmax_row_avx2(x.p + x.start, x.end - x.start, softcap);
  for (int64_t t0 = first; t0 < last; t0 += kKeyTile) {  // out = P V, tile by tile, 2 vectors a pass
    const int64_t t1 = std::min(last, t0 + kKeyTile);
    for (size_t i = 0; i < vecs.size(); i += 2) {
      QueryVec& a = vecs[i];
      const int64_t alo = std::max(t0, a.start), ahi = std::min(t1, a.end);
      if (i + 1 == vecs.size()) {
        const float* pa[1] = {a.p};
        float* oa[1] = {a.out};
        if (alo < ahi) pv_segment<1>(pa, vp, alo, ahi, d, oa);
        continue;
      }
      QueryVec& b = vecs[i + 1];
      const int64_t blo = std::max(t0, b.start), bhi = std::min(t1, b.end);
      const float* pab[2] = {a.p, b.p};
      float* oab[2] = {a.out, b.out};
      const int64_t lo = std::max(alo, blo), hi = std::min(ahi, bhi);
      if (lo >= hi) {  // no keys in common in this tile: each alone
        if (alo < ahi) pv_segment<1>(pab, vp, alo, ahi, d, oab);
        if (blo < bhi) pv_segment<1>(pab + 1, vp, blo, bhi, d, oab + 1);
        continue;
      }
      // Each vector's keys stay in increasing order: its part before the common range, the
      // common range together, its part after.
      if (alo < lo) pv_segment<1>(pab, vp, alo, lo, d, oab);
      if (blo < lo) pv_segment<1>(pab + 1, vp, blo, lo, d, oab + 1);
      pv_segment<2>(pab, vp, lo, hi, d, oab);
      if (hi < ahi) pv_segment<1>(pab, vp, hi, ahi, d, oab);
      if (hi < bhi) pv_segment<1>(pab + 1, vp, hi, bhi, d, oab + 1);
    }
  }
}

// A bfloat16 cache's work item (attention_bf16.h): its vectors' queries rounded to bf16, the bf16
// kernels of the hardware (HW) or the emulated compilation.
template <bool HW>
void prefill_item_bf16(std::vector<QueryVec>& vecs, std::vector<uint16_t>& qb,
                       std::vector<QueryVecB>& vb, const bf16* const* kp, const bf16* const* vp,
                       int64_t first, int64_t last, int64_t d, float softcap) {
  qb.resize(vecs.size() * d);
  vb.clear();
  for (size_t i = 0; i < vecs.size(); ++i) {
    const QueryVec& x = vecs[i];
    uint16_t* q = qb.data() + i * d;
    if constexpr (HW)
      bf16_hw::round_query(x.q, 1.f, d, q);
    else
      bf16_emu::round_query(x.q, 1.f, d, q);
    vb.push_back({x.start, x.end, q, x.p, x.out});
  }
  if constexpr (HW)
    bf16_hw::prefill_item(vb, kp, vp, first, last, d, softcap, kKeyTile);
  else
    bf16_emu::prefill_item(vb, kp, vp, first, last, d, softcap, kKeyTile);
}

template <typename KT>  // the KV cache's element: float, float16 (widened on load) or bfloat16
void prefill_avx2(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables_t,
                  const at::Tensor& starts_t, const at::Tensor& lens_t, double scale,
                  int64_t window, double softcap, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3), group = heads / kv_heads;
  const int64_t s_kv = kv_cache.stride(0), s_block = kv_cache.stride(1), s_tok = kv_cache.stride(2);
  const int64_t width = tables_t.size(1), num_seqs = lens_t.size(0);
  const KT* cache = kv_cache.data_ptr<KT>();
  const float* qp = q.data_ptr<float>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  float* op = out.data_ptr<float>();
  const int32_t* tables = tables_t.data_ptr<int32_t>();
  const int32_t* starts = starts_t.data_ptr<int32_t>();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), fsoftcap = static_cast<float>(softcap);
  auto first_pos = [window](int64_t len) -> int64_t {  // as the decode kernel
    return window > 0 ? std::max<int64_t>(0, len - window) : 0;
  };
  struct Item {
    int64_t seq, head, row0, row1;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = starts[s + 1] - starts[s];
    for (int64_t r = 0; r < n; r += kRows)
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({s, h, r, std::min(n, r + kRows)});
  }
  // Costliest first: the keys an item's last row reads (ties keep their order).
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lens[a.seq] - (starts[a.seq + 1] - starts[a.seq]) + a.row1 >
           lens[b.seq] - (starts[b.seq + 1] - starts[b.seq]) + b.row1;
  });
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  // Which bf16 kernels run (outside the parallel region: the first call runs the probe).
  const bool hw = std::is_same_v<KT, bf16> && bf16_use_hw();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    constexpr bool kBf16 = std::is_same_v<KT, bf16>;
    std::optional<FlushDenormals> flush;  // the bf16 kernels' rounding (attention_bf16.h)
    if (kBf16) flush.emplace();
    std::vector<uint16_t> qb;
    std::vector<QueryVecB> vb;
    std::vector<float> qf, scores;
    std::vector<const KT*> kp, vp;
    std::vector<QueryVec> vecs;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
        const Item& item = items[it];
        const int64_t n = starts[item.seq + 1] - starts[item.seq];
        const int64_t ctx0 = lens[item.seq] - n;  // position of the chunk's first row
        const int64_t nv = (item.row1 - item.row0) * group;
        const int64_t first = first_pos(ctx0 + item.row0 + 1), last = ctx0 + item.row1;
        const int32_t* table = tables + item.seq * width;
        kp.resize(last), vp.resize(last);  // indexed by absolute position; [first, last) set
        for (int64_t pos = first; pos < last;) {  // block by block: no division per row
          const int64_t off = pos % block_size, run = std::min(block_size - off, last - pos);
          const KT* row = cache + table[pos / block_size] * s_block + off * s_tok + item.head * d;
          for (int64_t i = 0; i < run; ++i, ++pos, row += s_tok) kp[pos] = row, vp[pos] = row + s_kv;
        }
        qf.resize(nv * d);
        scores.resize(nv * (last - first));
        vecs.clear();
        for (int64_t r = item.row0; r < item.row1; ++r)
          for (int64_t g = 0; g < group; ++g) {
            const int64_t v = (r - item.row0) * group + g, head = item.head * group + g;
            const int64_t token = starts[item.seq] + r, end_pos = ctx0 + r + 1;
            const float* qh = qp + token * q_row + head * q_head;
            for (int64_t i = 0; i < d; ++i) qf[v * d + i] = qh[i] * fscale;
            float* o = op + (token * heads + head) * d;
            std::fill(o, o + d, 0.f);
            vecs.push_back({first_pos(end_pos), end_pos, qf.data() + v * d,
                            scores.data() + v * (last - first) - first, o});
          }
        if constexpr (kBf16) {
          if (hw)
            prefill_item_bf16<true>(vecs, qb, vb, kp.data(), vp.data(), first, last, d, fsoftcap);
          else
            prefill_item_bf16<false>(vecs, qb, vb, kp.data(), vp.data(), first, last, d, fsoftcap);
        } else {
          prefill_item_avx2(vecs, kp.data(), vp.data(), first, last, d, fsoftcap);
        }
      }
  });
}
#endif

// The decode kernel per token: each query row gets its sequence's table row and its own length.
at::Tensor prefill_by_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& tables, const at::Tensor& starts,
                             const at::Tensor& lens, double scale, int64_t window,
                             double softcap) {
  static const auto decode =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvserve::paged_decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, int64_t, double)>();
  const at::Tensor counts = (starts.narrow(0, 1, lens.size(0)) - starts.narrow(0, 0, lens.size(0)))
                                .to(at::kLong);
  const at::Tensor token_tables = tables.narrow(0, 0, lens.size(0)).repeat_interleave(counts, 0);
  // Row j of a chunk of n tokens ending at len sits at position len - n + j: context len - n + j + 1.
  const at::Tensor seq_of = at::repeat_interleave(counts);
  const at::Tensor row =
      at::arange(q.size(0), counts.options()) - starts.to(at::kLong).index_select(0, seq_of);
  const at::Tensor token_lens =
      (lens.to(at::kLong).index_select(0, seq_of) - counts.index_select(0, seq_of) + row + 1)
          .to(at::kInt);
  return decode.call(q, kv_cache, token_tables, token_lens, scale, window, softcap);
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                   const at::Tensor& block_tables,
                                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                   double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad shapes");
  TORCH_CHECK(kv_dtype_ok(q.scalar_type(), kv_cache.scalar_type()), kKVDtypeError);
  TORCH_CHECK(kv_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "block tables, query starts and seq lens must be int32");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(2) <= 512, "head_dim mismatch or > 512");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) >= num_seqs,
              "query_start_loc [num_seqs + 1] and a block table per sequence expected");
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto tables = block_tables.contiguous();
  auto starts = query_start_loc.contiguous();
  auto lens = seq_lens.contiguous();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  TORCH_CHECK(sp[0] == 0 && sp[num_seqs] == qc.size(0), "query_start_loc must cover every token");
  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(sp[s + 1] >= sp[s] && lp[s] >= sp[s + 1] - sp[s] &&
                    (lp[s] + kv_cache.size(2) - 1) / kv_cache.size(2) <= tables.size(1),
                "a sequence's new tokens exceed its context or its block table");
#ifdef KV_HAVE_AVX2_ATTENTION
  if (qc.scalar_type() == at::kFloat && cpu_has_avx2_fma() && qc.size(2) % 32 == 0) {
    auto out = at::empty({qc.size(0), qc.size(1), qc.size(2)}, qc.options());
    if (kv_cache.scalar_type() == at::kHalf)
      prefill_avx2<c10::Half>(qc, kv_cache, tables, starts, lens, scale, window, softcap, out);
    else if (kv_cache.scalar_type() == at::kBFloat16)
      prefill_avx2<c10::BFloat16>(qc, kv_cache, tables, starts, lens, scale, window, softcap,
                                  out);
    else
      prefill_avx2<float>(qc, kv_cache, tables, starts, lens, scale, window, softcap, out);
    return out;
  }
#endif
  return prefill_by_decode(qc, kv_cache, tables, starts, lens, scale, window, softcap);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, int window=0, float softcap=0.0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
