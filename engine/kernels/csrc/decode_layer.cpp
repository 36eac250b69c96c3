// One Llama decoder layer of a pure decode step (every sequence adds one token) in a single call: the
// same ATen ops and kvserve kernels, in the same order, as the Python fused layer
// (engine/models/decoder_cpu.py, fused_layer), so its values are bitwise the same; only the Python
// dispatch between ~20 small ops per layer is gone. window / softcap (0: off) go to the attention.
// decode_layers runs every layer of a step in one call: block-quantized float32 layers as a thread
// team (below: one parallel region for the whole step, no dispatch), others op by op.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <sched.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "block_matmul.h"
#include "layer_rows.h"

namespace {

// kinds[i] for each of the 4 matmuls (qkv, o, gate_up, down): 0 float [N, K] weight, 1 q4 blocks
// (qs, d, m), 2 q8 blocks (qs, d), 3 K-quant blocks (qs, sc, dm), 4 parts of those (see linear),
// 5 Q5 blocks (qs, d, m);
// then has_bias, then the true output width (block weights are padded to a multiple of 8 columns).
// kinds[12] (optional): 1 when q/k norm weights follow the two block norms; after it, the parts.
enum Kind : int64_t { kFloat = 0, kQ4 = 1, kQ8 = 2, kKQ = 3, kParts = 4, kQ5 = 5 };

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const std::optional<at::Tensor>&)>
      q4;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&)>
      q8;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const std::optional<at::Tensor>&)>
      kq;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const std::optional<at::Tensor>&)>
      q5;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor,
                                const at::Tensor&, int64_t, int64_t)>
      rope;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, int64_t, double)>
      attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul;
};

const Ops& ops() {
  static const Ops o = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{
        d.findSchemaOrThrow("kvserve::q4_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const std::optional<at::Tensor>&)>(),
        d.findSchemaOrThrow("kvserve::q8_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&)>(),
        d.findSchemaOrThrow("kvserve::kq_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const std::optional<at::Tensor>&)>(),
        d.findSchemaOrThrow("kvserve::q5_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const std::optional<at::Tensor>&)>(),
        d.findSchemaOrThrow("kvserve::rms_norm", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("kvserve::rope_write_kv", "")
            .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, at::Tensor,
                        const at::Tensor&, int64_t, int64_t)>(),
        d.findSchemaOrThrow("kvserve::paged_decode_attention", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, double, int64_t, double)>(),
        d.findSchemaOrThrow("kvserve::silu_mul", "").typed<at::Tensor(const at::Tensor&)>(),
    };
  }();
  return o;
}

// One block weight's matmul (kind 1, 2, 3 or 5): reads its tensors from `w` at `next`, advancing it.
at::Tensor block_matmul(int64_t kind, const at::Tensor& xf, const std::vector<at::Tensor>& w,
                        size_t& next) {
  at::Tensor out;
  if (kind == kQ4) {
    out = ops().q4.call(xf, w[next], w[next + 1], w[next + 2], std::nullopt);
    next += 3;
  } else if (kind == kKQ) {
    out = ops().kq.call(xf, w[next], w[next + 1], w[next + 2], std::nullopt);
    next += 3;
  } else if (kind == kQ5) {
    out = ops().q5.call(xf, w[next], w[next + 1], w[next + 2], std::nullopt);
    next += 3;
  } else {
    TORCH_CHECK(kind == kQ8, "decode_layer: unknown weight kind ", kind);
    out = ops().q8.call(xf, w[next], w[next + 1], std::nullopt);
    next += 2;
  }
  return out;
}

// The i-th matmul of the layer: reads its tensors from `w` at `next` (advancing it), as
// engine.models.quantization.linear computes it (bias added after the kernel). Kind 4: a fused
// weight whose parts use different block formats (engine/models/block_parts.py), described in the
// kinds after index 12 from `tail` on: the part count, then each part's kind and width; the parts'
// outputs side by side.
at::Tensor linear(const at::Tensor& x, const std::vector<at::Tensor>& w, size_t& next,
                  const std::vector<int64_t>& kinds, int i, size_t& tail) {
  const int64_t kind = kinds[3 * i], has_bias = kinds[3 * i + 1], width = kinds[3 * i + 2];
  at::Tensor out;
  if (kind == kFloat) {
    const at::Tensor& weight = w[next++];
    if (has_bias) return at::linear(x, weight, w[next++]);
    return at::linear(x, weight);
  }
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  if (kind == kParts) {
    TORCH_CHECK(tail < kinds.size(), "decode_layer: parts without their description");
    const int64_t parts = kinds[tail++];
    std::vector<at::Tensor> outs;
    for (int64_t p = 0; p < parts; ++p) {
      TORCH_CHECK(tail + 1 < kinds.size(), "decode_layer: parts without their description");
      const int64_t part_kind = kinds[tail], part_width = kinds[tail + 1];
      tail += 2;
      at::Tensor part = block_matmul(part_kind, xf, w, next);
      outs.push_back(part.size(1) != part_width ? part.narrow(1, 0, part_width) : part);
    }
    out = at::cat(outs, 1);
  } else {
    out = block_matmul(kind, xf, w, next);
  }
  if (out.size(1) != width) out = out.narrow(1, 0, width);
  if (has_bias) out = out + w[next++];
  return out;
}

// Per-head RMSNorm of `size` columns of qkv from `start` (Qwen3's q_norm / k_norm), in place: the
// Python fused layer's ops (engine/models/decoder_cpu.py, _qk_norm_in_place).
void head_norm(at::Tensor& qkv, int64_t start, int64_t size, int64_t d, const at::Tensor& weight,
               double eps) {
  at::Tensor part = qkv.narrow(1, start, size);
  part.copy_(ops().rms_norm.call(part.reshape({-1, d}), weight, eps).view({qkv.size(0), size}));
}

// x [n, in] @ w^T in float32 as engine/models/lora_apply.py's low_rank: a batch of GEMMs of exactly
// kLoRARows rows each (the last padded with zeros), so a row's bits never depend on the row count.
constexpr int64_t kLoRARows = 8;  // lora_apply.LORA_ROWS

at::Tensor low_rank(const at::Tensor& x, const at::Tensor& w) {
  const int64_t n = x.size(0), m = (n + kLoRARows - 1) / kLoRARows * kLoRARows;
  at::Tensor xp = x.contiguous();
  if (m != n) xp = at::constant_pad_nd(xp, {0, 0, 0, m - n}, 0);
  const at::Tensor wt = w.t();
  const int64_t chunks = m / kLoRARows;
  const at::Tensor out = at::bmm(xp.view({chunks, kLoRARows, xp.size(1)}),
                                 wt.unsqueeze(0).expand({chunks, wt.size(0), wt.size(1)}));
  return out.view({m, w.size(0)}).narrow(0, 0, n);
}

// LoRA adapters' deltas on matmul i's output y (input x), as engine/models/lora_apply.py adds
// them: per segment of rows, t = low_rank(x[rows], a), then y[rows, piece] += low_rank(t[:, piece],
// b) per piece. segments: per segment [start, end, matmuls], per matmul [index, pieces], per piece
// [col_start, rank, out_start]; tensors in the same order (a matmul's a, then its pieces' b).
struct LoRA {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& segments;

  void add(at::Tensor& y, const at::Tensor& x, int64_t i) const {
    size_t s = 0, next = 0;
    while (s < segments.size()) {
      const int64_t start = segments[s], rows = segments[s + 1] - start, count = segments[s + 2];
      s += 3;
      for (int64_t m = 0; m < count; ++m) {
        const int64_t index = segments[s], pieces = segments[s + 1];
        s += 2;
        if (index != i) {
          s += 3 * pieces;
          next += 1 + pieces;
          continue;
        }
        const at::Tensor xs = x.narrow(0, start, rows);
        const at::Tensor t = low_rank(xs.scalar_type() == at::kFloat ? xs : xs.to(at::kFloat),
                                      tensors[next++]);
        for (int64_t p = 0; p < pieces; ++p, s += 3) {
          const at::Tensor& b = tensors[next++];
          const at::Tensor tp = pieces == 1 ? t : t.narrow(1, segments[s], segments[s + 1]);
          at::Tensor dest = y.narrow(0, start, rows).narrow(1, segments[s + 2], b.size(0));
          const at::Tensor delta = low_rank(tp, b);
          // float32: added as is; a 16-bit model: the delta in float32, added once rounded
          dest.add_(y.scalar_type() == at::kFloat ? delta : delta.to(y.scalar_type()));
        }
      }
    }
  }
};

// w: [input_layernorm.weight, post_attention_layernorm.weight, (q_norm.weight, k_norm.weight when
// kinds[12] is 1), then the 4 matmuls' tensors].
at::Tensor layer(const at::Tensor& h, const std::vector<at::Tensor>& w,
                 const std::vector<int64_t>& kinds, double eps, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads,
                 int64_t kv_heads, double scale, int64_t window, double softcap,
                 const LoRA* lora) {
  TORCH_CHECK(kinds.size() >= 12 && w.size() >= 6, "decode_layer: 4 matmuls expected");
  const bool qk_norm = kinds.size() >= 13 && kinds[12] != 0;
  size_t tail = 13;  // where the parts' descriptions start
  const Ops& o = ops();
  const int64_t n = h.size(0), d = kv_cache.size(4), q_size = heads * d;
  size_t next = qk_norm ? 4 : 2;
  const at::Tensor x0 = o.rms_norm.call(h, w[0], eps);
  at::Tensor qkv = linear(x0, w, next, kinds, 0, tail);
  if (lora) lora->add(qkv, x0, 0);
  if (qk_norm) {
    head_norm(qkv, 0, q_size, d, w[2], eps);
    head_norm(qkv, q_size, kv_heads * d, d, w[3], eps);
  }
  o.rope.call(qkv, cos, sin, kv_cache, slots, heads, kv_heads);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, heads, d});
  const at::Tensor att =
      o.attention.call(q, kv_cache, block_tables, seq_lens, scale, window, softcap);
  const at::Tensor x1 = att.reshape({n, q_size});
  at::Tensor attended = linear(x1, w, next, kinds, 1, tail);
  if (lora) lora->add(attended, x1, 1);
  at::Tensor out = h + attended;
  const at::Tensor x2 = o.rms_norm.call(out, w[1], eps);
  at::Tensor gate_up = linear(x2, w, next, kinds, 2, tail);
  if (lora) lora->add(gate_up, x2, 2);
  // Block-quantized MLPs take the one-pass activation (csrc/silu_mul.cpp), float ones torch's ops,
  // as engine.models.layers.GatedMLP does.
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor act =
      kinds[6] != kFloat && gate_up.scalar_type() == at::kFloat
          ? o.silu_mul.call(gate_up)
          : at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
  at::Tensor down = linear(act, w, next, kinds, 3, tail);
  if (lora) lora->add(down, act, 3);
  return out + down;
}
at::Tensor decode_layer(const at::Tensor& h, const std::vector<at::Tensor>& w,
                        const std::vector<int64_t>& kinds, double eps, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& kv_cache, const at::Tensor& slots,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t heads,
                        int64_t kv_heads, double scale, int64_t window, double softcap) {
  return layer(h, w, kinds, eps, cos, sin, kv_cache, slots, block_tables, seq_lens, heads,
               kv_heads, scale, window, softcap, nullptr);
}

// ------------------------------------------------------------------ the thread team path
//
// decode_layers for block-quantized float32 layers without the per-op dispatch: every layer of the
// step in one parallel region, each thread taking its share of every phase (rows of the row-wise
// ops, or their columns when there are fewer rows than threads; column groups of the matmuls; the
// attention's work items), the phases separated by a barrier. Every value is computed by the same
// function as on the per-op path (layer_rows.h, the block kernels on their column groups, float
// adds), so the bits are the same; what goes is ~20 dispatched ops, 4 allocations and 5 fork/joins
// of the thread pool per layer. KVSERVE_DECODE_TEAM=0 or decode_team_select(0) turns it off.

// The starting mode: KVSERVE_DECODE_TEAM=0 turns the team path off for the process.
int initial_team_mode() {
  const char* env = std::getenv("KVSERVE_DECODE_TEAM");
  return env != nullptr && std::string(env) == "0" ? 0 : 1;
}

std::atomic<int> team_mode{initial_team_mode()};

// Why the calling thread's last decode_layers call did not run as a team ("" when it did).
std::string& last_reason() {
  thread_local std::string why;
  return why;
}

std::string decode_team_last() { return last_reason(); }

// Sets the team path's mode (0 off; 1 where it can run; 2 required, for tests: a step it cannot run
// raises, and more threads than CPUs do not stop it); returns the one it replaces.
int64_t decode_team_select(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "decode_team_select: mode must be 0, 1 or 2, not ", mode);
  return team_mode.exchange(static_cast<int>(mode));
}

// Bytes of its share of the next matmul's weights each thread asks into L2 while it waits at the
// barriers before that matmul (0: none); kvserve::decode_team_prefetch sets it.
constexpr int64_t kDefaultPrefetch = 64 << 10;
std::atomic<int64_t> prefetch_budget{kDefaultPrefetch};

int64_t decode_team_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "decode_team_prefetch: bytes must be >= 0, not ", bytes);
  return prefetch_budget.exchange(bytes);
}

// The most values (rows x MLP width) a thread computes the row-wise phases of whole for itself when
// a step has fewer rows than threads (TeamScratch::Own): 8192, ~10 us of SwiGLU on one core.
// kvserve::decode_team_whole_max sets it (0: always share them, with a barrier after each; tests).
std::atomic<int64_t> whole_max{8192};

int64_t decode_team_whole_max(int64_t values) {
  TORCH_CHECK(values >= 0, "decode_team_whole_max: values must be >= 0, not ", values);
  return whole_max.exchange(values);
}

// Byte ranges a thread asks into L2, a few lines at a time, while it waits at a barrier: the start
// of its share of the next matmul's weights (while the threads meet and run the small ops between
// matmuls, nothing streams the weights). Only a hint: no value changes.
struct Prefetch {
  static constexpr int kMax = 8;
  const char* at[kMax] = {};
  int64_t left[kMax] = {};
  int count = 0, next = 0;

  void clear() { count = next = 0; }
  void add(const void* p, int64_t bytes) {
    if (count < kMax && bytes > 0) at[count] = static_cast<const char*>(p), left[count++] = bytes;
  }
  // Asks for up to `lines` more cache lines; false when nothing is left.
  bool step(int lines) {
    while (next < count && left[next] <= 0) ++next;
    if (next >= count) return false;
    for (int j = 0; j < lines && left[next] > 0; ++j) {
      __builtin_prefetch(at[next], 0, 2);  // into L2 (and L3), as _MM_HINT_T1
      at[next] += 64, left[next] -= 64;
    }
    return true;
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waits until `a` no longer holds `old`: spinning first (a phase of a step lasts microseconds),
// then asleep on a futex, so a thread waiting for one that lost its core to a neighbour gives its
// own core up instead of holding it. ~0.1 ms of spin, as kvserve's GOMP_SPINCOUNT=1000
// (engine/openmp_policy.py); with two busy processes beside the server (benchmarks/neighbours.py,
// 3 rounds) 2048 kept 0.43x of the quiet tokens/s, 1024 0.50x.
constexpr int kSpins = 1024;

// The sleeping half is our own futex handshake, not std::atomic::wait: libstdc++ 12's notify skips
// the system call when its waiter count reads 0, and after a release store (a plain mov on x86) that
// read can pass the store, so a waiter that had just read the old value slept through the change
// (a server hung mid-step on an Intel Xeon until a debugger's attach interrupted the futex). Here
// a sleeper counts itself in (a full fence) before it looks at the value a last time, the waker
// publishes with a seq_cst store or read-modify-write (a full fence) before it reads the count, so
// one of them sees the other; and a sleep still ends after kSleepNs to look again, whatever happens.
constexpr long kSleepNs = 1000000;  // 1 ms

struct Sleepers {
  std::atomic<int> count{0};
};

inline void futex_sleep(const std::atomic<int>& a, int old) {
#if defined(__linux__)
  static_assert(sizeof(std::atomic<int>) == sizeof(int));
  timespec limit{0, kSleepNs};
  syscall(SYS_futex, reinterpret_cast<const int*>(&a), FUTEX_WAIT_PRIVATE, old, &limit, nullptr, 0);
#else
  (void)a, (void)old;
  std::this_thread::sleep_for(std::chrono::nanoseconds(kSleepNs / 10));
#endif
}

// Wakes the threads asleep on `a` (call after changing it with a seq_cst store or RMW).
inline void wake_all(std::atomic<int>& a, const Sleepers& sleepers) {
  if (sleepers.count.load(std::memory_order_seq_cst) == 0) return;  // no system call
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<int*>(&a), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#endif
}

inline void wait_while(const std::atomic<int>& a, int old, Sleepers& sleepers,
                       Prefetch* pf = nullptr) {
  if (pf != nullptr)  // first the prefetches, 4 lines between looks at the barrier
    while (a.load(std::memory_order_acquire) == old)
      if (!pf->step(4)) break;
  for (int i = 0; i < kSpins; ++i) {
    if (a.load(std::memory_order_acquire) != old) return;
    cpu_relax();
  }
  while (true) {
    sleepers.count.fetch_add(1, std::memory_order_seq_cst);
    if (a.load(std::memory_order_seq_cst) != old) {
      sleepers.count.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
    futex_sleep(a, old);  // returns at once if `a` changed meanwhile (the kernel compares)
    sleepers.count.fetch_sub(1, std::memory_order_relaxed);
  }
}

// The CPUs this process may run on (its affinity mask; unknown: no limit).
int64_t usable_cpus() {
  static const int64_t n = [] {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max<int64_t>(1, CPU_COUNT(&set));
#endif
    return int64_t{1} << 20;
  }();
  return n;
}

struct TeamState {
  std::atomic<int> covered{0};
  std::atomic<int> joined{0};
  Sleepers sleepers;
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> phase{0};
};

// One thread's place in a region: its rank among `size` threads and the shared barrier.
struct Team {
  int rank, size;
  TeamState* state;
  Prefetch* prefetch = nullptr;  // this thread's, asked for while it waits (null: none)

  void sync() const {
    if (size == 1) return;
    const int ph = state->phase.load(std::memory_order_acquire);
    if (state->arrived.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      state->arrived.store(0, std::memory_order_relaxed);
      state->phase.store(ph + 1, std::memory_order_seq_cst);
      wake_all(state->phase, state->sleepers);
    } else {
      wait_while(state->phase, ph, state->sleepers, prefetch);
    }
  }

  // This thread's share [first, second) of n items.
  std::pair<int64_t, int64_t> share(int64_t n) const {
    return {n * rank / size, n * (rank + 1) / size};
  }
};

// Runs body(team) on every thread of one at::parallel_for region. The threads first count
// themselves (the region may have fewer threads than asked for, or run inline as one), so the
// barrier waits for exactly the threads there are. body must not throw.
template <typename Body>
void run_team(Body&& body) {
  TeamState state;
  const int want = std::max(1, at::get_num_threads());
  at::parallel_for(0, want, 1, [&](int64_t begin, int64_t end) {
    const int rank = state.joined.fetch_add(1);
    const int n = static_cast<int>(end - begin);
    const int got = state.covered.fetch_add(n, std::memory_order_seq_cst) + n;
    if (got == want) wake_all(state.covered, state.sleepers);
    for (int now = got; now != want; now = state.covered.load())
      wait_while(state.covered, now, state.sleepers);
    Prefetch prefetch;
    body(Team{rank, state.joined.load(), &state, &prefetch});
  });
}

// One matmul of a layer as the team runs it: its weights (parts of one format each, side by side
// in the output), each writing 8 * groups columns from its first column.
struct TeamLinear {
  std::vector<kvblock::AnyWeight> parts;
  std::vector<int64_t> cols;
  int64_t width = 0, K = 0, groups = 0;
  const float* bias = nullptr;  // [width] or none
};

// A layer as the team runs it (raw pointers into the plan's tensors); ok false when the layer has
// what the team path does not run (a float matmul, padded widths, other dtypes): the plan then
// takes the per-op path, which also reports what is wrong with bad tensors.
struct TeamLayer {
  bool ok = false;
  TeamLinear lin[4];
  const float *norm0 = nullptr, *norm1 = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  int64_t q_norm_size = 0, k_norm_size = 0;
};

bool is_half_scales(const at::Tensor& t, const at::Tensor& qs, int64_t last = 8) {
  return t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 &&
         t.size(0) == qs.size(0) && t.size(1) == qs.size(1) && t.size(2) == last;
}

bool is_floats(const at::Tensor& t, int64_t n) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 &&
         t.is_contiguous() && t.size(0) == n;
}

// The block weight of `kind` at w[next] (advancing next), with the checks of its op; false if not.
bool team_weight(int64_t kind, const std::vector<at::Tensor>& w, size_t& next,
                 kvblock::AnyWeight& out) {
  const size_t count = kind == kQ8 ? 2 : 3;
  if (next + count > w.size()) return false;
  const at::Tensor& qs = w[next];
  if (!qs.device().is_cpu() || !qs.is_contiguous() || qs.dim() != 4 || qs.size(3) != 32)
    return false;
  out.kind = static_cast<int>(kind), out.groups = qs.size(0), out.K = qs.size(1) * kvblock::kBlock;
  if (kind == kQ4 || kind == kQ5) {
    const at::Tensor &d = w[next + 1], &m = w[next + 2];
    const bool no_m = m.numel() == 0;
    if (qs.scalar_type() != at::kByte || qs.size(2) != (kind == kQ4 ? 4 : 5) ||
        !is_half_scales(d, qs) || (!no_m && !is_half_scales(m, qs)))
      return false;
    const auto* mp = no_m ? nullptr : m.data_ptr<c10::Half>();
    if (kind == kQ4)
      out.b = kvblock::BlockWeight{qs.data_ptr<uint8_t>(), nullptr, d.data_ptr<c10::Half>(), mp};
    else
      out.q5 = kvblock::Q5Weight{qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), mp};
  } else if (kind == kQ8) {
    const at::Tensor& d = w[next + 1];
    if (qs.scalar_type() != at::kChar || qs.size(2) != 8 || !is_half_scales(d, qs)) return false;
    out.b = kvblock::BlockWeight{nullptr, qs.data_ptr<int8_t>(), d.data_ptr<c10::Half>(), nullptr};
  } else if (kind == kKQ) {
    const at::Tensor &sc = w[next + 1], &dm = w[next + 2];
    if (qs.scalar_type() != at::kByte || qs.size(2) < 4 || qs.size(2) > 6 || qs.size(1) % 8 ||
        sc.scalar_type() != at::kByte || !sc.is_contiguous() || sc.dim() != 4 ||
        sc.size(0) != qs.size(0) || sc.size(1) != qs.size(1) || sc.size(2) != 2 ||
        sc.size(3) != 8 || dm.scalar_type() != at::kHalf || !dm.is_contiguous() ||
        dm.dim() != 4 || dm.size(0) != qs.size(0) || dm.size(1) * 8 != qs.size(1) ||
        dm.size(2) != 2 || dm.size(3) != 8)
      return false;
    out.k = kvblock::KWeight{qs.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(),
                             dm.data_ptr<c10::Half>(), static_cast<int>(qs.size(2))};
  } else {
    return false;
  }
  next += count;
  return true;
}

// Matmul i of the layer (as `linear` reads it), or false.
bool team_linear(const std::vector<at::Tensor>& w, size_t& next, const std::vector<int64_t>& kinds,
                 int i, size_t& tail, TeamLinear& out) {
  const int64_t kind = kinds[3 * i], has_bias = kinds[3 * i + 1], width = kinds[3 * i + 2];
  std::vector<std::pair<int64_t, int64_t>> parts;  // (kind, width)
  if (kind == kParts) {
    if (tail >= kinds.size()) return false;
    const int64_t count = kinds[tail++];
    for (int64_t p = 0; p < count; ++p, tail += 2) {
      if (tail + 1 >= kinds.size()) return false;
      parts.emplace_back(kinds[tail], kinds[tail + 1]);
    }
  } else {
    parts.emplace_back(kind, width);
  }
  for (const auto& [part_kind, part_width] : parts) {
    kvblock::AnyWeight weight;
    if (!team_weight(part_kind, w, next, weight) || 8 * weight.groups != part_width) return false;
    if (out.K != 0 && weight.K != out.K) return false;
    out.K = weight.K;
    out.cols.push_back(out.width);
    out.width += part_width, out.groups += weight.groups;
    out.parts.push_back(weight);
  }
  if (out.width != width) return false;
  if (has_bias) {
    if (next >= w.size() || !is_floats(w[next], width)) return false;
    out.bias = w[next++].data_ptr<float>();
  }
  return true;
}

TeamLayer team_layer(const std::vector<at::Tensor>& w, const std::vector<int64_t>& kinds) {
  TeamLayer l;
  if (kinds.size() < 12 || w.size() < 6) return l;
  const bool qk_norm = kinds.size() >= 13 && kinds[12] != 0;
  size_t next = qk_norm ? 4 : 2, tail = 13;
  for (int i = 0; i < 4; ++i)
    if (!team_linear(w, next, kinds, i, tail, l.lin[i])) return l;
  const int64_t H = l.lin[0].K;
  if (next != w.size() || !is_floats(w[0], H) || !is_floats(w[1], H) || l.lin[1].width != H ||
      l.lin[2].K != H || l.lin[2].width % 2 || l.lin[3].K != l.lin[2].width / 2 ||
      l.lin[3].width != H)
    return l;
  if (qk_norm) {
    if (w[2].scalar_type() != at::kFloat || !w[2].is_contiguous() || w[2].dim() != 1 ||
        w[3].scalar_type() != at::kFloat || !w[3].is_contiguous() || w[3].dim() != 1)
      return l;
    l.q_norm = w[2].data_ptr<float>(), l.k_norm = w[3].data_ptr<float>();
    l.q_norm_size = w[2].size(0), l.k_norm_size = w[3].size(0);
  }
  l.norm0 = w[0].data_ptr<float>(), l.norm1 = w[1].data_ptr<float>();
  l.ok = true;
  return l;
}

// decode_layers' per-model arguments, built once per model (engine/models/decoder.py, _decode_plan)
// and kept here, so that a step converts only its own few tensors: per layer i, counts[2i] of
// `weights` and counts[2i + 1] of `kinds` (what decode_layer takes, in layer order), floats[3i..]
// eps, scale, softcap, ints[3i..] heads, kv_heads, window.
struct DecodePlan : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> w;
    std::vector<int64_t> kinds;
    double eps, scale, softcap;
    int64_t heads, kv_heads, window;
  };
  std::vector<Layer> layers;
  std::vector<TeamLayer> team;  // the same layers as the team path runs them

  DecodePlan(std::vector<at::Tensor> weights, std::vector<int64_t> counts,
             std::vector<int64_t> kinds, std::vector<double> floats, std::vector<int64_t> ints) {
    const size_t n = counts.size() / 2;
    TORCH_CHECK(counts.size() == 2 * n && floats.size() == 3 * n && ints.size() == 3 * n,
                "DecodePlan: per-layer arguments of different lengths");
    size_t w0 = 0, k0 = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto nw = static_cast<size_t>(counts[2 * i]), nk = static_cast<size_t>(counts[2 * i + 1]);
      TORCH_CHECK(w0 + nw <= weights.size() && k0 + nk <= kinds.size(),
                  "DecodePlan: counts run past the weights or kinds");
      layers.push_back(Layer{{weights.begin() + w0, weights.begin() + w0 + nw},
                             {kinds.begin() + k0, kinds.begin() + k0 + nk}, floats[3 * i],
                             floats[3 * i + 1], floats[3 * i + 2], ints[3 * i], ints[3 * i + 1],
                             ints[3 * i + 2]});
      w0 += nw, k0 += nk;
    }
    TORCH_CHECK(w0 == weights.size() && k0 == kinds.size(), "DecodePlan: weights or kinds left over");
    for (const Layer& l : layers) team.push_back(team_layer(l.w, l.kinds));
  }
};
// The team path's buffers, kept by the calling thread across steps (the team's threads write into
// them through pointers).
struct TeamScratch {
  std::vector<float> x, mid, y, act;  // normed rows [M, H]; h + attention [M, H]; matmul outputs;
                                      // the MLP activation [M, inter]
  kvblock::Activations a[4];          // each matmul's quantized input
  std::vector<float> att;             // the attention's scratch (its split path's scores)
  // Fewer rows than threads (decode of one or a few sequences): every thread computes the small
  // row-wise phases between matmuls (norms, quantizing, SwiGLU) whole, into buffers of its own,
  // instead of its share of them and a barrier after each; 4 barriers a layer fewer (of ~10). The
  // same functions on the same values, so the same bits.
  struct Own {
    std::vector<float> x, act, down;  // normed rows [M, H]; the MLP activation; down's output
    kvblock::Activations a[4];
  };
  std::vector<Own> own;  // per rank
};

// One step of the team path over the plan's layers; see decode_layers for the arguments.
class TeamStep {
 public:
  TeamStep(const DecodePlan& plan, const std::vector<at::Tensor>& kv_caches,
           const std::vector<at::Tensor>& shared, const std::vector<int64_t>& where, int64_t M,
           int64_t H)
      : plan_(plan), kv_(kv_caches), shared_(shared), where_(where), M_(M), H_(H),
        path_(kvblock::current_path()), s_(scratch()) {}

  // "" when every layer can run here, else why not (the per-op path then runs the step, and
  // reports what is wrong with bad tensors). Then makes the step's buffers and attention work.
  // required: run even with more threads than CPUs (tests).
  std::string prepare(bool required) {
    // More threads than CPUs: a barrier would wait for descheduled threads at every phase (the
    // per-op path's thread pool copes better: 3 threads on 2 CPUs measured 3x slower in the team).
    const int64_t threads = at::get_num_threads();
    if (threads > usable_cpus() && !required)
      return std::to_string(threads) + " threads on " + std::to_string(usable_cpus()) + " CPUs";
    for (size_t i = 0; i < plan_.layers.size(); ++i) {
      const DecodePlan::Layer& l = plan_.layers[i];
      const TeamLayer& t = plan_.team[i];
      const auto layer = [i] { return "layer " + std::to_string(i) + ": "; };  // (on failure only)
      if (!t.ok) return layer() + "a float matmul, padded widths or other dtypes";
      if (t.lin[0].K != H_) return layer() + "the hidden size differs from the input's";
      if (where_[i] < 0 || static_cast<size_t>(5 * where_[i] + 5) > shared_.size())
        return layer() + "step index out of range";
      const at::Tensor& kv = kv_[i];
      if (!kv.device().is_cpu() || kv.dim() != 5 || !kv.is_contiguous() || kv.size(0) != 2 ||
          (kv.scalar_type() != at::kFloat && kv.scalar_type() != at::kHalf &&
           kv.scalar_type() != at::kBFloat16) ||
          kv.size(3) != l.kv_heads || l.kv_heads <= 0 || l.heads % l.kv_heads)
        return layer() + "not a contiguous float32, float16 or bfloat16 KV cache of its KV heads";
      const int64_t d = kv.size(4);
      if (d % 2 || d > 512 || t.lin[0].width != (l.heads + 2 * l.kv_heads) * d ||
          t.lin[1].K != l.heads * d)
        return layer() + "head size and matmul widths do not agree";
      if (t.q_norm != nullptr && (t.q_norm_size != d || t.k_norm_size != d))
        return layer() + "q/k norm weights are not of the head size";
      const at::Tensor* s = shared_.data() + 5 * where_[i];
      const at::Tensor &cos = s[0], &sin = s[1], &slots = s[2];
      if (cos.scalar_type() != at::kFloat || cos.dim() != 2 || cos.stride(1) != 1 ||
          cos.size(0) != M_ || cos.size(1) != d / 2 || sin.sizes() != cos.sizes() ||
          sin.strides() != cos.strides() || sin.scalar_type() != at::kFloat ||
          slots.scalar_type() != at::kLong || !slots.is_contiguous() || slots.dim() != 1 ||
          slots.size(0) != M_)
        return layer() + "cos, sin or slot mapping not float32 [n, d / 2] and int64 [n]";
    }
    return buffers();
  }

  // The step, every layer in one parallel region (after prepare() gave "").
  at::Tensor run(const at::Tensor& h) {
    const size_t L = plan_.layers.size();
    const at::Tensor input = h.contiguous();
    const at::Tensor outs[2] = {at::empty({M_, H_}, input.options()),
                                at::empty({M_, H_}, input.options())};
    for (int slot = 0; slot < 4; ++slot)
      if (uniform_[slot]) size(0, slot);
    // (read once: every thread must take the same barriers even if the limit changes meanwhile)
    small_rows_ = M_ * inter_ <= whole_max.load(std::memory_order_relaxed);
    if (M_ < at::get_num_threads() && static_cast<int64_t>(s_.own.size()) < at::get_num_threads())
      s_.own.resize(at::get_num_threads());  // (before the region: its threads index it)
    run_team([&](const Team& t) {
      if (whole(t)) {  // this thread's own buffers, written (so first touched) by it
        TeamScratch::Own& o = s_.own[t.rank];
        o.x.resize(M_ * H_), o.act.resize(M_ * inter_), o.down.resize(M_ * H_);
        for (int slot = 0; slot < 4; ++slot)
          if (uniform_[slot]) o.a[slot].size(M_, plan_.team[0].lin[slot].K, needs_[slot]);
      }
      aim(t, 0, 0);
      for (size_t i = 0; i < L; ++i) {
        const float* hin = i == 0 ? input.data_ptr<float>() : outs[(i - 1) % 2].data_ptr<float>();
        pre_attention(t, i, hin);
        t.sync();
        const kvrows::DecodeAttention& att = *attention_[i];
        for (int phase = 0; phase < att.phases(); ++phase) {
          if (phase > 0) t.sync();
          const auto [a0, a1] = t.share(att.items(phase));
          att.run(phase, a0, a1);
        }
        t.sync();
        post_attention(t, i, att_[i].data_ptr<float>(), hin, outs[i % 2].data_ptr<float>());
        t.sync();
      }
    });
    return outs[(L - 1) % 2];
  }

 private:
  static TeamScratch& scratch() {
    thread_local TeamScratch s;
    return s;
  }

  // Sizes matmul `slot`'s quantized input for layer i.
  void size(size_t i, int slot) const {
    const TeamLinear& lin = plan_.team[i].lin[slot];
    s_.a[slot].size(M_, lin.K, needs_[slot]);
  }

  // Whether this thread computes the row-wise phases whole (fewer rows than threads; see Own),
  // while they are small beside a barrier: SwiGLU, the largest (an exp a value), up to
  // whole_max values (rows x MLP width); wider (7B-class MLPs, 14336) share it as with more rows.
  bool whole(const Team& t) const { return t.size > 1 && M_ < t.size && small_rows_; }

  // Matmul `slot`'s quantized input as this thread reads (and, computing whole, writes) it.
  kvblock::Activations& acts(const Team& t, int slot) const {
    return whole(t) ? s_.own[t.rank].a[slot] : s_.a[slot];
  }

  // Sizes matmul `slot`'s quantized input for layer i inside the region when its input width
  // differs between layers (else it was sized once before).
  void size_in_team(const Team& t, size_t i, int slot) const {
    if (uniform_[slot]) return;
    if (whole(t)) {  // its own: no other thread reads it
      acts(t, slot).size(M_, plan_.team[i].lin[slot].K, needs_[slot]);
      return;
    }
    t.sync();  // the previous layer's readers are done
    if (t.rank == 0) size(i, slot);
    t.sync();
  }

  // The barrier after a row-wise phase, unless each thread computed it whole for itself.
  void sync_shared(const Team& t) const {
    if (!whole(t)) t.sync();
  }

  // The step's buffers and each layer's attention work; "" or why the team cannot run it.
  std::string buffers() {
    const size_t L = plan_.layers.size();
    int64_t y_width = H_, inter = 0;
    for (int slot = 0; slot < 4; ++slot) {
      needs_[slot] = kvblock::ActNeeds{};
      uniform_[slot] = true;
      for (size_t i = 0; i < L; ++i) {
        const TeamLinear& lin = plan_.team[i].lin[slot];
        for (const kvblock::AnyWeight& w : lin.parts) needs_[slot].add(kvblock::needs_of(path_, w));
        uniform_[slot] = uniform_[slot] && lin.K == plan_.team[0].lin[slot].K;
      }
    }
    for (const TeamLayer& t : plan_.team)
      y_width = std::max(y_width, t.lin[2].width), inter = std::max(inter, t.lin[3].K);
    inter_ = inter;
    s_.x.resize(M_ * H_), s_.mid.resize(M_ * H_);
    s_.y.resize(M_ * y_width), s_.act.resize(M_ * inter);
    const auto floats = at::TensorOptions().dtype(at::kFloat);
    const int64_t threads = std::max(1, at::get_num_threads());
    for (size_t i = 0; i < L; ++i) {
      const DecodePlan::Layer& l = plan_.layers[i];
      const int64_t d = kv_[i].size(4), width = plan_.team[i].lin[0].width;
      // one buffer for the layers of one shape (each is read before the next layer writes it)
      qkv_.push_back(i > 0 && qkv_[i - 1].size(1) == width ? qkv_[i - 1]
                                                           : at::empty({M_, width}, floats));
      att_.push_back(i > 0 && att_[i - 1].size(1) == l.heads && att_[i - 1].size(2) == d
                         ? att_[i - 1]
                         : at::empty({M_, l.heads, d}, floats));
      const at::Tensor q = qkv_[i].narrow(1, 0, l.heads * d).view({M_, l.heads, d});
      const at::Tensor* st = step_tensors(i);
      attention_.push_back(kvrows::decode_attention(q, kv_[i], st[3], st[4], l.scale, l.window,
                                                    l.softcap, att_[i], threads));
    }
    int64_t scratch = 0;  // the layers run one after another: one scratch for their attention
    for (const auto& att : attention_) scratch = std::max(scratch, att->scratch_floats());
    s_.att.resize(scratch);
    for (const auto& att : attention_) att->set_scratch(s_.att.data());
    return "";
  }

  const at::Tensor* step_tensors(size_t i) const { return shared_.data() + 5 * where_[i]; }

  // Points this thread's barrier-time prefetch at its share of matmul `slot` of layer i: the first
  // bytes of each part's blocks (and their scales, in proportion), prefetch_budget in all.
  void aim(const Team& t, size_t i, int slot) const {
    if (t.prefetch == nullptr) return;
    Prefetch& pf = *t.prefetch;
    pf.clear();
    const int64_t budget = prefetch_budget.load(std::memory_order_relaxed);
    if (budget <= 0 || t.size == 1 || i >= plan_.team.size()) return;
    const TeamLinear& lin = plan_.team[i].lin[slot];
    const auto [g0, g1] = t.share(lin.groups);
    struct Range {
      const void* p;
      int64_t bytes;
    };
    Range ranges[Prefetch::kMax];
    int n = 0;
    int64_t total = 0, base = 0;
    for (const kvblock::AnyWeight& w : lin.parts) {
      const int64_t lo = std::max(g0, base) - base, hi = std::min(g1, base + w.groups) - base;
      base += w.groups;
      if (lo >= hi || n + 2 > Prefetch::kMax) continue;
      const int64_t KB = w.K / kvblock::kBlock, groups = hi - lo;
      const void* data = nullptr;
      int64_t per_group = 0;  // bytes of one group of 8 columns, blocks and scales
      const c10::Half* scales = nullptr;
      if (w.kind == kvblock::kWeightQ4)
        data = w.b.q4 + lo * KB * 128, per_group = KB * 128, scales = w.b.d + lo * KB * 8;
      else if (w.kind == kvblock::kWeightQ8)
        data = w.b.q8 + lo * KB * 256, per_group = KB * 256, scales = w.b.d + lo * KB * 8;
      else if (w.kind == kvblock::kWeightKQ)
        data = w.k.qs + lo * KB * w.k.bits * 32, per_group = KB * w.k.bits * 32;
      else if (w.kind == kvblock::kWeightQ5)
        data = w.q5.qs + lo * KB * 160, per_group = KB * 160, scales = w.q5.d + lo * KB * 8;
      if (data == nullptr) continue;
      ranges[n++] = {data, groups * per_group}, total += groups * per_group;
      if (scales != nullptr) ranges[n++] = {scales, groups * KB * 16}, total += groups * KB * 16;
    }
    for (int r = 0; r < n; ++r)  // each range's share of the budget, in proportion to its size
      pf.add(ranges[r].p, total <= budget ? ranges[r].bytes : ranges[r].bytes * budget / total);
  }

  // Matmul `slot` of layer i on this thread's share of its column groups into out (row stride N);
  // then after(c0, c1) for each run of columns done; then the prefetch aimed at the matmul after it.
  template <typename After>
  void matmul(const Team& t, size_t i, int slot, float* out, int64_t N, After&& after) const {
    const TeamLinear& lin = plan_.team[i].lin[slot];
    const kvblock::Activations& act = acts(t, slot);
    const auto [g0, g1] = t.share(lin.groups);
    int64_t base = 0;
    for (size_t p = 0; p < lin.parts.size(); ++p) {
      const kvblock::AnyWeight& w = lin.parts[p];
      const int64_t lo = std::max(g0, base) - base, hi = std::min(g1, base + w.groups) - base;
      base += w.groups;
      if (lo >= hi) continue;
      const kvblock::QuantRows rows = act.rows_for(path_, w);
      for (int64_t r0 = 0; r0 < M_; r0 += kvblock::kRowPanel)
        kvblock::run_weight(path_, w, rows, r0, std::min(M_, r0 + kvblock::kRowPanel), lo, hi, N,
                            out + lin.cols[p]);
      after(lin.cols[p] + 8 * lo, lin.cols[p] + 8 * hi);
    }
    if (slot < 3)
      aim(t, i, slot + 1);
    else
      aim(t, i + 1, 0);
  }

  // dst = src + (y + bias) on columns [c0, c1) of every row (the residual adds).
  void residual(int64_t c0, int64_t c1, const float* y, const float* bias, const float* src,
                float* dst) const {
    for (int64_t r = 0; r < M_; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const float v = bias != nullptr ? y[r * H_ + c] + bias[c] : y[r * H_ + c];
        dst[r * H_ + c] = src[r * H_ + c] + v;
      }
  }

  // This thread's part of a row-wise phase of `units` column units a row: its share of the rows
  // (every unit) when there are as many rows as threads, else every row and its share of the
  // units (one decode row: both threads busy). Units: blocks of 32 columns, or heads.
  struct Part {
    int64_t r0, r1, u0, u1;
  };
  Part part(const Team& t, int64_t units) const {
    if (M_ >= t.size) {
      const auto [r0, r1] = t.share(M_);
      return {r0, r1, 0, units};
    }
    const auto [u0, u1] = t.share(units);
    return {0, M_, u0, u1};
  }

  // This thread's part of a row-wise phase it may compute whole (every row and unit: see Own).
  Part row_part(const Team& t, int64_t units) const {
    return whole(t) ? Part{0, M_, 0, units} : part(t, units);
  }

  // x = RMSNorm(src) with weight `norm` on this thread's part, quantized for matmul `slot`.
  void norm_and_quantize(const Team& t, const float* src, const float* norm, float eps,
                         int slot) const {
    constexpr int64_t B = kvblock::kBlock;
    const Part p = row_part(t, H_ / B);
    float* xs = whole(t) ? s_.own[t.rank].x.data() : s_.x.data();
    kvblock::Activations& a = acts(t, slot);
    for (int64_t r = p.r0; r < p.r1; ++r) {
      float* x = xs + r * H_;
      kvrows::rms_norm(src + r * H_, norm, H_, eps, x, B * p.u0, B * p.u1);
      a.quantize_blocks(path_, r, p.u0, p.u1, x);
    }
  }

  // Layer i up to its attention: input norm, qkv, its bias, q/k norms, rotary and the KV write.
  void pre_attention(const Team& t, size_t i, const float* hin) const {
    const DecodePlan::Layer& l = plan_.layers[i];
    const TeamLayer& tl = plan_.team[i];
    const float eps = static_cast<float>(l.eps);
    size_in_team(t, i, 0);
    norm_and_quantize(t, hin, tl.norm0, eps, 0);
    sync_shared(t);
    const int64_t W = tl.lin[0].width;
    float* qkv = qkv_[i].data_ptr<float>();
    matmul(t, i, 0, qkv, W, [](int64_t, int64_t) {});
    t.sync();
    const at::Tensor& kv = kv_[i];
    const int64_t d = kv.size(4), heads = l.heads, kv_heads = l.kv_heads;
    const at::Tensor* st = step_tensors(i);
    const float *cos = st[0].data_ptr<float>(), *sin = st[1].data_ptr<float>();
    const int64_t cos_row = st[0].stride(0);
    const int64_t* slots = st[2].data_ptr<int64_t>();
    const at::ScalarType kv_type = kv.scalar_type();
    float* cache32 = kv_type == at::kFloat ? kv.data_ptr<float>() : nullptr;
    c10::Half* cache16 = kv_type == at::kHalf ? kv.data_ptr<c10::Half>() : nullptr;
    c10::BFloat16* cache_bf16 = kv_type == at::kBFloat16 ? kv.data_ptr<c10::BFloat16>() : nullptr;
    const Part p = part(t, heads + 2 * kv_heads);  // units: the q, k and v heads
    for (int64_t r = p.r0; r < p.r1; ++r) {
      float* row = qkv + r * W;
      if (tl.lin[0].bias != nullptr)
        for (int64_t c = p.u0 * d; c < p.u1 * d; ++c) row[c] = row[c] + tl.lin[0].bias[c];
      if (tl.q_norm != nullptr) {
        float normed[512];
        for (int64_t hd = p.u0; hd < std::min(p.u1, heads + kv_heads); ++hd) {
          float* x = row + hd * d;
          kvrows::rms_norm(x, hd < heads ? tl.q_norm : tl.k_norm, d, eps, normed);
          std::copy(normed, normed + d, x);
        }
      }
      kvrows::rope_write_kv(row, cos + r * cos_row, sin + r * cos_row, cache32, cache16,
                            cache_bf16, slots[r], kv.stride(0), heads, kv_heads, d, p.u0, p.u1);
    }
  }

  // Layer i after its attention (att [M, heads * d]): o, residual, norm, gate/up, SwiGLU, down,
  // residual into hout.
  void post_attention(const Team& t, size_t i, const float* att, const float* hin,
                      float* hout) const {
    constexpr int64_t B = kvblock::kBlock;
    const DecodePlan::Layer& l = plan_.layers[i];
    const TeamLayer& tl = plan_.team[i];
    const int64_t q_size = tl.lin[1].K, gu = tl.lin[2].width, inter = gu / 2;
    float *y = s_.y.data(), *mid = s_.mid.data();
    // down's output: y, or computing whole this thread's own (the other may still read gate/up's
    // output in y for its SwiGLU while this one runs down)
    float* down = whole(t) ? s_.own[t.rank].down.data() : y;
    size_in_team(t, i, 1);
    const Part pa = row_part(t, q_size / B);
    kvblock::Activations& a1 = acts(t, 1);
    for (int64_t r = pa.r0; r < pa.r1; ++r)
      a1.quantize_blocks(path_, r, pa.u0, pa.u1, att + r * q_size);
    sync_shared(t);
    matmul(t, i, 1, y, H_, [&](int64_t c0, int64_t c1) {
      residual(c0, c1, y, tl.lin[1].bias, hin, mid);
    });
    t.sync();
    size_in_team(t, i, 2);
    norm_and_quantize(t, mid, tl.norm1, static_cast<float>(l.eps), 2);
    sync_shared(t);
    matmul(t, i, 2, y, gu, [](int64_t, int64_t) {});
    t.sync();
    size_in_team(t, i, 3);
    const Part pm = row_part(t, inter / B);
    const int64_t c0 = B * pm.u0, c1 = B * pm.u1;
    float* acts3 = whole(t) ? s_.own[t.rank].act.data() : s_.act.data();
    kvblock::Activations& a3 = acts(t, 3);
    for (int64_t r = pm.r0; r < pm.r1; ++r) {
      const float* row = y + r * gu;
      float* act = acts3 + r * inter;
      if (tl.lin[2].bias != nullptr) {  // y + bias, never into y: computing whole, both read it
        const float* bias = tl.lin[2].bias;
        for (int64_t c = c0; c < c1; ++c) act[c] = row[c] + bias[c];
        float up[B];
        for (int64_t b0 = c0; b0 < c1; b0 += B) {  // (elementwise: the same bits in any pieces)
          for (int64_t c = 0; c < B; ++c) up[c] = row[inter + b0 + c] + bias[inter + b0 + c];
          kvrows::silu_mul(act + b0, up, B, act + b0);
        }
      } else {
        kvrows::silu_mul(row + c0, row + inter + c0, c1 - c0, act + c0);
      }
      a3.quantize_blocks(path_, r, pm.u0, pm.u1, act);
    }
    sync_shared(t);
    matmul(t, i, 3, down, H_, [&](int64_t c0, int64_t c1) {
      residual(c0, c1, down, tl.lin[3].bias, mid, hout);
    });
  }

  const DecodePlan& plan_;
  const std::vector<at::Tensor>& kv_;
  const std::vector<at::Tensor>& shared_;
  const std::vector<int64_t>& where_;
  const int64_t M_, H_;
  const kvblock::PathFns& path_;
  TeamScratch& s_;  // the calling thread's (inside the team, thread_local would be each thread's)
  kvblock::ActNeeds needs_[4];  // what each matmul's kernels read, over all layers
  bool uniform_[4] = {};        // whether each matmul's input width is every layer's
  int64_t inter_ = 0;           // the widest MLP activation of the layers
  bool small_rows_ = false;     // the rows' SwiGLU is within whole_max (see whole())
  std::vector<at::Tensor> qkv_, att_;
  std::vector<std::unique_ptr<kvrows::DecodeAttention>> attention_;
};


// Every layer of a step in one call (no LoRA rows): layer i runs decode_layer's ops with the
// plan's layer i, its KV cache kv_caches[i] and shared[5 where[i]..]: cos, sin, slot_mapping,
// block_tables, seq_lens (one such set per distinct rotary and KV-cache group of the layers). The
// same ops as calling decode_layer per layer, so the same bits; only the per-layer Python call and
// its argument conversion are gone.
at::Tensor decode_layers(const at::Tensor& h, const c10::intrusive_ptr<DecodePlan>& plan,
                         const std::vector<at::Tensor>& kv_caches,
                         const std::vector<at::Tensor>& shared, const std::vector<int64_t>& where) {
  const size_t layers = plan->layers.size();
  TORCH_CHECK(kv_caches.size() == layers && where.size() == layers,
              "decode_layers: ", layers, " layers in the plan, ", kv_caches.size(),
              " KV caches, ", where.size(), " step indices");
  const int mode = team_mode.load(std::memory_order_relaxed);
  if (mode != 0) {
    std::string why;
    if (layers == 0 || h.dim() != 2 || h.scalar_type() != at::kFloat || !h.device().is_cpu() ||
        h.size(0) == 0) {
      why = "the hidden states are not float32 [n, hidden] with n > 0";
    } else {
      TeamStep step(*plan, kv_caches, shared, where, h.size(0), h.size(1));
      why = step.prepare(mode == 2);
      if (why.empty()) {
        last_reason() = "";
        return step.run(h);
      }
    }
    TORCH_CHECK(mode != 2, "decode_layers: the team path cannot run this step: ", why);
    last_reason() = why;
  } else {
    last_reason() = "off";
  }
  at::Tensor x = h;
  for (size_t i = 0; i < layers; ++i) {
    const DecodePlan::Layer& l = plan->layers[i];
    TORCH_CHECK(where[i] >= 0 && static_cast<size_t>(5 * where[i] + 5) <= shared.size(),
                "decode_layers: step index out of range");
    const at::Tensor* s = shared.data() + 5 * where[i];
    x = layer(x, l.w, l.kinds, l.eps, s[0], s[1], kv_caches[i], s[2], s[3], s[4], l.heads,
              l.kv_heads, l.scale, l.window, l.softcap, nullptr);
  }
  return x;
}

// The same layer with LoRA adapters' deltas on its matmuls (a step with adapter rows).
at::Tensor decode_layer_lora(const at::Tensor& h, const std::vector<at::Tensor>& w,
                             const std::vector<int64_t>& kinds, double eps, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& kv_cache,
                             const at::Tensor& slots, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
                             double scale, int64_t window, double softcap,
                             const std::vector<at::Tensor>& lora_tensors,
                             const std::vector<int64_t>& lora_segments) {
  const LoRA lora{lora_tensors, lora_segments};
  return layer(h, w, kinds, eps, cos, sin, kv_cache, slots, block_tables, seq_lens, heads,
               kv_heads, scale, window, softcap, &lora);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "decode_layer(Tensor h, Tensor[] weights, int[] kinds, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int heads, "
      "int kv_heads, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<double>, std::vector<int64_t>>());
  m.def(
      "decode_layers(Tensor h, __torch__.torch.classes.kvserve.DecodePlan plan, "
      "Tensor(a!)[] kv_caches, Tensor[] shared, int[] where) -> Tensor");
  m.def("decode_team_select", &decode_team_select);
  m.def("decode_team_last", &decode_team_last);
  m.def("decode_team_prefetch", &decode_team_prefetch);
  m.def("decode_team_whole_max", &decode_team_whole_max);
  m.def(
      "decode_layer_lora(Tensor h, Tensor[] weights, int[] kinds, float eps, Tensor cos, "
      "Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "int heads, int kv_heads, float scale, int window, float softcap, Tensor[] lora, "
      "int[] lora_segments) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layer_lora", &decode_layer_lora);
  m.impl("decode_layers", &decode_layers);
}
