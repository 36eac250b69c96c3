"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) in plain torch over the paged KV cache.

q/k/v and gate/up projections are fused into single matmuls when the weights are loaded.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernels
from engine.kernels.attention import (
    AttentionMetadata,
    attend_cached,
    paged_attention,
    uses_cpu_kernels,
)
from engine.models.block_quant import BlockQ4Weight, BlockQ8Weight
from engine.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    empty_param,
    optional_param,
    rope_parameters,
)
from engine.models.quantization import linear

logger = logging.getLogger(__name__)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv_bias, o_bias = _attention_biases(cfg)
        out = self.q_size + 2 * self.kv_size
        self.qkv_weight = empty_param(out, hidden, dtype=dtype, device=device)  # [q+k+v, hidden]
        self.qkv_bias = optional_param(out, dtype=dtype, device=device, enabled=qkv_bias)
        self.o_weight = empty_param(hidden, self.q_size, dtype=dtype, device=device)
        self.o_bias = optional_param(hidden, dtype=dtype, device=device, enabled=o_bias)

    def project_qkv(
        self,
        x: torch.Tensor,  # [n, hidden], normalized
        cos: torch.Tensor,  # [n, 1, head_dim // 2]
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, d] and k, v [n, kv_heads, d], rotary applied: pure tensor code."""
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [n, q_size + 2 * kv_size]
        # q and k sit side by side in qkv, so one rotation covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(n, heads + kv_heads, d)
        q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(n, kv_heads, d)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:  # [n, heads, d] -> [n, hidden]
        return linear(out.reshape(out.shape[0], self.q_size), self.o_weight, self.o_bias)


def _attention_biases(cfg: Any) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): Qwen2 always has q/k/v bias; Llama's `attention_bias` covers all four."""
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    qkv_bias = attention_bias or getattr(cfg, "model_type", "") == "qwen2"
    return qkv_bias, attention_bias


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one matmul."""

    def __init__(self, cfg: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; Llama-family models use silu")
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.intermediate_size = inter
        self.gate_up_weight = empty_param(2 * inter, hidden, dtype=dtype, device=device)
        self.gate_up_bias = optional_param(2 * inter, dtype=dtype, device=device, enabled=bias)
        self.down_weight = empty_param(hidden, inter, dtype=dtype, device=device)
        self.down_bias = optional_param(hidden, dtype=dtype, device=device, enabled=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)  # [n, 2 * inter]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_weight, self.down_bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, dtype: torch.dtype, device: torch.device, window: int | None = None
    ):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.window = window  # sliding window of this layer's attention (None: full)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        dense: DenseFns | None = None,
    ) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        # The paged attention stays eager; the dense halves around it may be compiled (`dense`).
        pre, post = dense or (_pre_attention, _post_attention)
        q, k, v = pre(self, h, *rope)
        out = paged_attention(
            q, k, v, kv_cache, meta, self.self_attn.scale, window=self.window
        )  # [n, heads, d]
        return post(self, h, out)


def _fused_layer(
    layer: LlamaDecoderLayer,
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # [n, head_dim // 2] each
    h: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The CPU-kernel layer: one-pass RMSNorms, rotary fused with the KV-cache write, paged
    attention in place; the same values as the torch ops, in fewer passes and dispatches."""
    attn, norm1, norm2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    n, d = h.shape[0], attn.head_dim
    qkv = linear(cpu_kernels.rms_norm(h, norm1.weight, norm1.eps), attn.qkv_weight, attn.qkv_bias)
    cpu_kernels.rope_write_kv(
        qkv, *cos_sin, kv_cache, meta.slot_mapping, attn.num_heads, attn.num_kv_heads
    )
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=1)
    q = q.view(n, attn.num_heads, d)
    k, v = k.view(n, attn.num_kv_heads, d), v.view(n, attn.num_kv_heads, d)
    out = attend_cached(q, k, v, kv_cache, meta, attn.scale, window=layer.window)
    h = h + attn.project_out(out)
    return h + layer.mlp(cpu_kernels.rms_norm(h, norm2.weight, norm2.eps))


DecodeLayerArgs = tuple[list[torch.Tensor], list[int], float, int, int, float, int | None]


def _decode_layer_args(layer: LlamaDecoderLayer) -> DecodeLayerArgs | None:
    """What csrc/decode_layer.cpp takes for this layer besides the step's tensors: its norms' and
    matmuls' tensors, their kinds, eps, heads, KV heads, scale and window; None if it cannot
    run it."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    if norm1.eps != norm2.eps:
        return None
    tensors: list[torch.Tensor] = [norm1.weight, norm2.weight]
    kinds: list[int] = []
    for weight, bias in (
        (attn.qkv_weight, attn.qkv_bias),
        (attn.o_weight, attn.o_bias),
        (mlp.gate_up_weight, mlp.gate_up_bias),
        (mlp.down_weight, mlp.down_bias),
    ):
        if isinstance(weight, BlockQ4Weight):
            tensors += [weight.qs, weight.d, weight.m]
            kinds += [1, int(bias is not None), weight.out_features]
        elif isinstance(weight, BlockQ8Weight):
            tensors += [weight.qs, weight.d]
            kinds += [2, int(bias is not None), weight.out_features]
        else:
            tensors.append(weight)
            kinds += [0, int(bias is not None), weight.shape[0]]
        if bias is not None:
            tensors.append(bias)
    return tensors, kinds, norm1.eps, attn.num_heads, attn.num_kv_heads, attn.scale, layer.window


def _pre_attention(
    layer: LlamaDecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.self_attn.project_qkv(layer.input_layernorm(h), cos, sin)


def _post_attention(layer: LlamaDecoderLayer, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    h = h + layer.self_attn.project_out(out)  # [n, hidden]
    return h + layer.mlp(layer.post_attention_layernorm(h))


DenseFns = tuple[Callable[..., Any], Callable[..., Any]]


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.dtype = dtype
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.max_position_embeddings = cfg.max_position_embeddings
        self.layer_windows: list[int | None] = layer_windows(cfg)
        self.rotary = RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg), dtype, device
        )
        embedding = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=embedding, _freeze=True
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, device, window) for window in self.layer_windows
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.dense: DenseFns | None = None  # compiled dense halves of a layer (compile_dense)
        self._decode_args: list[DecodeLayerArgs | None] | None = None  # see _decode_calls
        self.lm_head_weight: torch.Tensor | None = optional_param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device,
            enabled=not self.tie_word_embeddings,
        )  # fmt: skip

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> [num_tokens, hidden_size]
        h = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions)
        fused = self.dense is None and all(c.dtype == h.dtype for c in kv_caches)
        if fused and uses_cpu_kernels(meta, h.device, h.dtype):
            cos, sin = rope[0].squeeze(1), rope[1].squeeze(1)  # [n, head_dim // 2]
            calls = self._decode_calls() if meta.num_decode_seqs == meta.num_seqs else None
            for i, kv_cache in enumerate(kv_caches):
                args = calls[i] if calls is not None else None
                layer_meta = meta.for_layer(i)
                if args is None:
                    fused_layer = cast(LlamaDecoderLayer, self.layers[i])
                    h = _fused_layer(fused_layer, (cos, sin), h, kv_cache, layer_meta)
                    continue
                w, kinds, eps, heads, kv_heads, scale, window = args
                h = cpu_kernels.decode_layer(
                    h, w, kinds, eps, cos, sin, kv_cache, layer_meta.slot_mapping,
                    layer_meta.block_tables, layer_meta.seq_lens, heads, kv_heads, scale, window,
                )  # fmt: skip
            return cpu_kernels.rms_norm(h, self.norm.weight, self.norm.eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(rope, h, kv_cache, meta.for_layer(i), self.dense)
        return self.norm(h)

    def _decode_calls(self) -> list[DecodeLayerArgs | None]:
        """Per layer, the one-call decode layer's arguments (built once: weights_changed resets)."""
        if self._decode_args is None:
            self._decode_args = [
                _decode_layer_args(cast(LlamaDecoderLayer, layer)) for layer in self.layers
            ]
        return self._decode_args

    def weights_changed(self) -> None:
        """Called after matmul weights were replaced (quantization): forget what was derived."""
        self._decode_args = None

    def compile_dense(self) -> None:
        """torch.compile the per-layer dense code (norms, projections, rotary, MLP, residuals) once,
        shared by every layer, with a dynamic token count; paged attention stays eager."""
        self.dense = (
            torch.compile(_pre_attention, dynamic=True, fullgraph=True),
            torch.compile(_post_attention, dynamic=True, fullgraph=True),
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        weight = self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        return linear(hidden, weight).float()

    def quantizable_weights(self) -> list[tuple[Any, str]]:
        """(module, attribute) of every matmul weight, for engine.models.quantization. A tied head gets
        its own reference to the embedding, so the head can be packed while lookups stay exact."""
        if self.lm_head_weight is None:
            self.lm_head_weight = self.embed_tokens.weight
        found: list[tuple[Any, str]] = [(self, "lm_head_weight")]
        for layer in self.layers:
            found += [(layer.self_attn, "qkv_weight"), (layer.self_attn, "o_weight")]
            found += [(layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight")]
        return found

    # ------------------------------------------------------------ weight loading

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors into our (fused) parameters; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # parameter -> rows written, to know fused ones are complete
        for hf_name, tensor in weights:
            target = self._map_name(hf_name)
            if target is None:
                continue
            name, row_offset = target
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name} does not fit this model's configuration"
                )
            param = params[name]
            rows = tensor.shape[0]
            dest = param.data[row_offset : row_offset + rows]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)} from config.json"
                )
            dest.copy_(tensor)
            filled[name] = filled.get(name, 0) + rows
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(
                f"checkpoint is missing weights for {len(missing)} parameters: {shown}"
            )

    def _map_name(self, hf_name: str) -> tuple[str, int] | None:
        """HF tensor name -> (our parameter name, first row inside it), or None to skip."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight":
            return None if self.tie_word_embeddings else ("lm_head_weight", 0)
        name = hf_name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight"):
            return name, 0
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            logger.warning("ignoring unexpected checkpoint tensor %s", hf_name)
            return None
        layer, module, proj, kind = match.groups()
        prefix = f"layers.{layer}."
        if module in ("input_layernorm", "post_attention_layernorm"):
            return prefix + f"{module}.weight", 0
        q, kv, inter = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, 0
        if module == "mlp":
            inter = self.config.intermediate_size
        fused = {
            "q_proj": ("self_attn.qkv", 0),
            "k_proj": ("self_attn.qkv", q),
            "v_proj": ("self_attn.qkv", q + kv),
            "o_proj": ("self_attn.o", 0),
            "gate_proj": ("mlp.gate_up", 0),
            "up_proj": ("mlp.gate_up", inter),
            "down_proj": ("mlp.down", 0),
        }
        if proj not in fused:
            logger.warning("ignoring unexpected checkpoint tensor %s", hf_name)
            return None
        ours, offset = fused[proj]
        return prefix + f"{ours}_{kind}", offset


_LAYER_NAME = re.compile(
    r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm|self_attn|mlp)"
    r"(?:\.(\w+_proj))?\.(weight|bias)"
)


def layer_windows(cfg: Any) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: Mistral slides in every layer;
    configs with `layer_types` (Qwen2 builds them from `use_sliding_window` and
    `max_window_layers`: layers from max_window_layers on slide) slide where a type says
    "sliding_attention"; any other config with `sliding_window` slides everywhere. A window no
    shorter than max_position_embeddings never drops a key, so it is reported as None."""
    num_layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True):
        return [None] * num_layers
    if window >= cfg.max_position_embeddings:
        return [None] * num_layers
    types = getattr(cfg, "layer_types", None)
    if getattr(cfg, "model_type", "") == "mistral" or not types:
        return [int(window)] * num_layers
    return [int(window) if t == "sliding_attention" else None for t in types[:num_layers]]
