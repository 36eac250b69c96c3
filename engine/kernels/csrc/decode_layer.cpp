// One Llama decoder layer of a pure decode step (every sequence adds one token) in a single call: the
// same ATen ops and kvserve kernels, in the same order, as the Python fused layer
// (engine/models/decoder_cpu.py, fused_layer), so its values are bitwise the same; only the Python
// dispatch between ~20 small ops per layer is gone. window / softcap (0: off) go to the attention.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <vector>

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
  }
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
