"""Quantization of a loaded model's matmul weights (int8: per-channel weights and per-row activations
on fbgemm, see int8_linear; int4: weight-only, per group) and the one `linear` every model layer
calls, which dispatches to the packed kernels."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.int8_linear import Int8Embedding, Int8Weight

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)  # 32 matches the blocks of GGUF Q4_0/Q4_1
DEFAULT_INT4_GROUP_SIZE = 32


class Int4Weight(nn.Module):
    """Asymmetric int4 per group of `group_size` input channels (as GGUF Q4_1): each group keeps a
    scale and a minimum; q in [0, 15], w ~= (q - 8) * scale + zero with zero = min + 8 * scale."""

    qweight: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:  # weight: [out, in]
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % group_size:
            raise ValueError(f"int4 group size {group_size} must divide {in_features}")
        w = weight.float().view(out_features, in_features // group_size, group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        zero = lo + 8.0 * scale
        self.group_size = group_size
        self.out_features, self.in_features = out_features, in_features
        q = q.view(out_features, in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("qweight", packed)  # [out, in // 2] uint8
        # [groups, out, 2] (scale, zero) in the activation dtype, the kernel's layout
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", scales_zeros.to(weight.dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, self.group_size, self.scales_zeros
        )

    def dequantize(self) -> torch.Tensor:  # [out, in]
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
        return self.matmul(eye).t().contiguous()


QuantizedWeight = Int8Weight | Int4Weight


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for a plain [out, in] weight, or the packed kernel for a quantized one."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    out = weight.matmul(x)
    return out if bias is None else out + bias


def quantize_weight(weight: torch.Tensor, method: str, group_size: int) -> QuantizedWeight:
    if method == "int8":
        return Int8Weight(weight)
    out_features, in_features = weight.shape
    if in_features % group_size:  # an odd width: fall back to the finest group that fits
        fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
        group_size = fits[0] if fits else 0
    if not group_size or out_features % 16:  # the int4 packing works in tiles of 16 rows
        return Int8Weight(weight)
    return Int4Weight(weight, group_size)


@torch.no_grad()
def quantize_model(
    model: nn.Module, method: str | None, group_size: int = DEFAULT_INT4_GROUP_SIZE
) -> int:
    """Replace the model's linear weights (those named in `model.quantizable_weights()`) by int8 or
    int4 packed weights, in place. Returns the bytes the weights now take (all parameters + buffers)."""
    if method is None:
        return weight_bytes(model)
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be int8 or int4; got {method!r}")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(
            f"--quantization {method} uses CPU kernels; on {device} serve bf16/fp16 weights "
            "(--quantization none)"
        )
    find_weights = getattr(type(model), "quantizable_weights", None)
    if find_weights is None:
        raise ValueError(f"--quantization is not supported for {type(model).__name__} models")
    before = weight_bytes(model)
    for owner, attr in find_weights(model):
        weight = getattr(owner, attr)
        quantized = quantize_weight(weight.data, method, group_size)
        if attr in owner._parameters:
            del owner._parameters[attr]
        setattr(owner, attr, quantized)
    _share_int8_head_with_embedding(model)
    after = weight_bytes(model)
    logger.info(
        "quantized linear weights to %s: %.0f MB -> %.0f MB", method, before / 1e6, after / 1e6
    )
    return after


def _share_int8_head_with_embedding(model: nn.Module) -> None:
    """A head tied to the embedding and packed as int8: lookups then dequantize rows of the same
    int8 table (no float copy of the table stays in memory)."""
    head = getattr(model, "lm_head_weight", None)
    if getattr(model, "tie_word_embeddings", False) and isinstance(head, Int8Weight):
        dtype = getattr(model, "dtype", torch.float32)
        model.embed_tokens = Int8Embedding(head, dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and packed int8 weight of `model`."""
    tensors = [*model.parameters(), *model.buffers()]
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, Int8Weight))
    return packed + sum(t.numel() * t.element_size() for t in tensors)
