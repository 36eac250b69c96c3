"""The decoder layer on the C++ CPU kernels: one-pass RMSNorms, rotary fused with the KV-cache write,
paged attention in place (`fused_layer`), and the arguments of the one-call C++ layer that pure
decode steps run (`decode_layer_args`, csrc/decode_layer.cpp)."""

from __future__ import annotations

import torch

from engine.kernels import cpu_kernels
from engine.kernels.attention import attend_cached, write_kv
from engine.kernels.metadata import AttentionMetadata
from engine.models.block_parts import BlockParts
from engine.models.block_q5 import BlockQ5Weight
from engine.models.block_quant import BlockQ4Weight, BlockQ8Weight
from engine.models.decoder_layer import Attention, DecoderLayer, run_mlp
from engine.models.kquant import BlockKWeight
from engine.models.layers import RMSNorm
from engine.models.lora_apply import LayerLoRA, add_lora
from engine.models.quantization import linear
from engine.models.rotary import apply_rotary


def norm(module: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The norm in one pass per row where the kernel gives its values, else the torch module."""
    weight = module.kernel_weight()
    return module(x) if weight is None else cpu_kernels.rms_norm(x, weight, module.eps)


def _qk_norm_in_place(qkv: torch.Tensor, attn: Attention) -> None:
    """Per-head RMSNorm of the q and k heads inside the fused qkv [n, q + 2 * kv]."""
    assert attn.q_norm is not None and attn.k_norm is not None
    n, d = qkv.shape[0], attn.head_dim
    for module, start, size in (
        (attn.q_norm, 0, attn.q_size),
        (attn.k_norm, attn.q_size, attn.kv_size),
    ):
        part = qkv[:, start : start + size]  # [n, heads * d], rows strided
        part.copy_(norm(module, part.reshape(-1, d)).view(n, size))


def fused_layer(
    layer: DecoderLayer,
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # [n, rotary_dim // 2] each
    h: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    lora: LayerLoRA | None = None,
) -> torch.Tensor:
    """The CPU-kernel layer: the same values as the torch ops, in fewer passes and dispatches;
    `lora` adds a mixed-adapter step's low-rank deltas to its rows of each linear."""
    attn = layer.self_attn
    n, d, heads, kv_heads = h.shape[0], attn.head_dim, attn.num_heads, attn.num_kv_heads
    x = norm(layer.input_layernorm, h)
    qkv = add_lora(linear(x, attn.qkv_weight, attn.qkv_bias), x, lora, "qkv")
    if attn.q_norm is not None:
        _qk_norm_in_place(qkv, attn)
    if not attn.partial_rotary:
        cpu_kernels.rope_write_kv(qkv, *cos_sin, kv_cache, meta.slot_mapping, heads, kv_heads)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=1)
    q, k, v = q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)
    if attn.partial_rotary:  # the kernel rotates whole heads: rotate in torch, then store
        cos, sin = cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_kv(k, v, kv_cache, meta.slot_mapping)
    out = attend_cached(
        q, k, v, kv_cache, meta, attn.scale, window=attn.window, softcap=attn.softcap
    )
    attended = attn.project_out(out, lora)
    if layer.sandwich:
        h = h + norm(layer.post_attention_layernorm, attended)
        mlp_out = run_mlp(layer, norm(layer.pre_feedforward_layernorm, h), lora)
        return h + norm(layer.post_feedforward_layernorm, mlp_out)
    h = h + attended
    return h + run_mlp(layer, norm(layer.post_attention_layernorm, h), lora)


# (tensors, kinds, eps, heads, kv_heads, scale, window, softcap)
DecodeLayerArgs = tuple[
    list[torch.Tensor], list[int], float, int, int, float, int | None, float | None
]


def decode_layer_args(layer: DecoderLayer) -> DecodeLayerArgs | None:
    """What csrc/decode_layer.cpp takes for this layer besides the step's tensors: its norms' and
    matmuls' tensors, their kinds, eps, heads, KV heads, scale, window and softcap; None if it
    cannot run it (it runs the Llama block, with Qwen3's q/k norm: whole-head rotary, SiLU,
    plain RMSNorms of one eps)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    norms = [norm1, norm2]
    if attn.q_norm is not None and attn.k_norm is not None:
        norms += [attn.q_norm, attn.k_norm]
    if layer.sandwich or mlp.gelu or attn.partial_rotary:
        return None
    if any(n.eps != norm1.eps or n.unit_offset for n in norms):
        return None
    tensors: list[torch.Tensor] = [n.weight for n in norms]
    kinds: list[int] = []
    tail: list[int] = []  # each parts weight's part count, then its parts' (kind, width)
    for weight, bias in (
        (attn.qkv_weight, attn.qkv_bias),
        (attn.o_weight, attn.o_bias),
        (mlp.gate_up_weight, mlp.gate_up_bias),
        (mlp.down_weight, mlp.down_bias),
    ):
        if isinstance(weight, BlockParts):
            described = [_block_kind(p, tensors) for p in weight.parts]
            if None in described:
                return None
            kinds += [4, int(bias is not None), weight.out_features]
            tail += [len(described), *(v for kind in described for v in kind or ())]
        elif not isinstance(weight, torch.Tensor):
            kind = _block_kind(weight, tensors)
            if kind is None:
                return None
            kinds += [kind[0], int(bias is not None), kind[1]]
        else:
            tensors.append(weight)
            kinds += [0, int(bias is not None), weight.shape[0]]
        if bias is not None:
            tensors.append(bias)
    if len(norms) == 4 or tail:
        kinds.append(int(len(norms) == 4))  # q/k norm weights follow the two block norms
    kinds += tail
    heads, kv_heads = attn.num_heads, attn.num_kv_heads
    return tensors, kinds, norm1.eps, heads, kv_heads, attn.scale, attn.window, attn.softcap


def _block_kind(weight: object, tensors: list[torch.Tensor]) -> tuple[int, int] | None:
    """(kind, true width) of a block weight for csrc/decode_layer.cpp, its tensors appended to
    `tensors`; None for a weight it cannot run."""
    if isinstance(weight, BlockQ4Weight):
        tensors += [weight.qs, weight.d, weight.m]
        return 1, weight.out_features
    if isinstance(weight, BlockQ8Weight):
        tensors += [weight.qs, weight.d]
        return 2, weight.out_features
    if isinstance(weight, BlockKWeight):
        tensors += [weight.qs, weight.sc, weight.dm]
        return 3, weight.out_features
    if isinstance(weight, BlockQ5Weight):
        tensors += [weight.qs, weight.d, weight.m]
        return 5, weight.out_features
    return None
