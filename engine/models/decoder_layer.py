"""One block of the shared decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3): what a family's
blocks contain (`DecoderSpec`), fused-qkv attention over the paged KV cache and the pre-norm layer
around it, in plain torch. The C++ CPU path (engine.models.decoder_cpu) reads the same modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.kernels.attention import paged_attention
from engine.kernels.metadata import AttentionMetadata
from engine.models.layers import GatedMLP, RMSNorm, empty_param, optional_param
from engine.models.lora_apply import LayerLoRA, add_lora
from engine.models.quantization import linear
from engine.models.rotary import apply_rotary, rotary_dim


@dataclass(frozen=True)
class DecoderSpec:
    """What one decoder family's blocks contain, read from its config by the family file."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # independent of hidden_size / num_heads (Qwen3, Gemma 3)
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_scale: float
    rope: tuple[dict, ...] = field(hash=False)  # rope parameters of each rotary table
    layer_rope: tuple[int, ...] = ()  # per layer, its rotary table (default: table 0)
    layer_windows: tuple[int | None, ...] = ()  # per layer, its sliding window (None: full)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    gemma_norms: bool = False  # (1 + weight) RMSNorms, and norms after attention and MLP too
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    attn_softcap: float | None = None
    final_softcap: float | None = None


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attention_scale
        self.rope_index = spec.layer_rope[layer] if spec.layer_rope else 0
        self.window = spec.layer_windows[layer] if spec.layer_windows else None
        self.softcap = spec.attn_softcap
        self.partial_rotary = rotary_dim(self.head_dim, spec.rope[self.rope_index]) != self.head_dim
        out = self.q_size + 2 * self.kv_size
        self.qkv_weight = empty_param(out, hidden, dtype=dtype, device=device)  # [q+k+v, hidden]
        self.qkv_bias = optional_param(out, dtype=dtype, device=device, enabled=spec.qkv_bias)
        self.o_weight = empty_param(hidden, self.q_size, dtype=dtype, device=device)
        self.o_bias = optional_param(hidden, dtype=dtype, device=device, enabled=spec.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm:
            eps, gemma = spec.rms_norm_eps, spec.gemma_norms
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, device, unit_offset=gemma)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device, unit_offset=gemma)

    def project_qkv(
        self,
        x: torch.Tensor,  # [n, hidden], normalized
        cos: torch.Tensor,  # [n, 1, rotary_dim // 2]
        sin: torch.Tensor,
        lora: LayerLoRA | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, d] and k, v [n, kv_heads, d], rotary applied: pure tensor code."""
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias)  # [n, q_size + 2 * kv_size]
        add_lora(qkv, x, lora, "qkv")
        v = qkv[:, self.q_size + self.kv_size :].view(n, kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(n, heads, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(n, kv_heads, d))
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        # q and k sit side by side in qkv, so one rotation covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(n, heads + kv_heads, d)
        q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
        return q, k, v

    def project_out(
        self, out: torch.Tensor, lora: LayerLoRA | None = None
    ) -> torch.Tensor:  # [n, heads, d] -> [n, hidden]
        x = out.reshape(out.shape[0], self.q_size)
        return add_lora(linear(x, self.o_weight, self.o_bias), x, lora, "o")


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, residuals around each; Gemma also normalizes each output
    (`post_attention_layernorm` then is that, and `pre_feedforward_layernorm` the MLP's input)."""

    def __init__(self, spec: DecoderSpec, index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        eps, hidden, gemma = spec.rms_norm_eps, spec.hidden_size, spec.gemma_norms
        self.index = index
        self.sandwich = gemma
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, unit_offset=gemma)
        self.self_attn = Attention(spec, index, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, unit_offset=gemma)
        self.mlp = GatedMLP(
            hidden, spec.intermediate_size, spec.activation, spec.mlp_bias, dtype, device
        )
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device, unit_offset=True)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device, unit_offset=True)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        dense: DenseFns | None = None,
        lora: LayerLoRA | None = None,
    ) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        # The paged attention stays eager; the dense halves around it may be compiled (`dense`).
        if lora is not None:  # a step with adapter rows runs the eager halves with their deltas
            q, k, v = pre_attention(self, h, *rope, lora=lora)
            out = paged_attention(
                q, k, v, kv_cache, meta, self.self_attn.scale,
                window=self.self_attn.window, softcap=self.self_attn.softcap,
            )  # fmt: skip
            return post_attention(self, h, out, lora=lora)
        pre, post = dense or (pre_attention, post_attention)
        q, k, v = pre(self, h, *rope)
        attn = self.self_attn
        out = paged_attention(
            q, k, v, kv_cache, meta, attn.scale, window=attn.window, softcap=attn.softcap
        )  # [n, heads, d]
        return post(self, h, out)


def pre_attention(
    layer: DecoderLayer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: LayerLoRA | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return layer.self_attn.project_qkv(layer.input_layernorm(h), cos, sin, lora)


def post_attention(
    layer: DecoderLayer, h: torch.Tensor, out: torch.Tensor, lora: LayerLoRA | None = None
) -> torch.Tensor:
    attended = layer.self_attn.project_out(out, lora)  # [n, hidden]
    if layer.sandwich:
        h = h + layer.post_attention_layernorm(attended)
        mlp_out = run_mlp(layer, layer.pre_feedforward_layernorm(h), lora)
        return h + layer.post_feedforward_layernorm(mlp_out)
    h = h + attended
    return h + run_mlp(layer, layer.post_attention_layernorm(h), lora)


def run_mlp(layer: DecoderLayer, x: torch.Tensor, lora: LayerLoRA | None) -> torch.Tensor:
    """The layer's MLP, with the adapters' deltas where it is the gated MLP (experts take none)."""
    if lora is None or not isinstance(layer.mlp, GatedMLP):
        return layer.mlp(x)
    return layer.mlp(x, lora)


DenseFns = tuple[Callable[..., Any], Callable[..., Any]]
