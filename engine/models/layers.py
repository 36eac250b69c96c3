"""Building blocks of Llama-family decoders: RMSNorm, rotary embeddings (with scaling), linear params."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RMSNorm(nn.Module):
    """Normalize in float32, scale in the model dtype (as the Hugging Face reference does)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        # torch's rms_norm accumulates bf16/fp16 input in float32 and rounds once, which is
        # bitwise what upcasting first gives, in two ops fewer.
        normed = F.rms_norm(x, (self.hidden_size,), eps=self.eps)
        return self.weight * normed


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialized parameter (weights are always loaded from a checkpoint afterwards)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def optional_param(
    *shape: int, dtype: torch.dtype, device: torch.device, enabled: bool
) -> nn.Parameter | None:
    """`empty_param` when the checkpoint has this tensor (biases, an untied head), else None."""
    return empty_param(*shape, dtype=dtype, device=device) if enabled else None


# ---------------------------------------------------------------- rotary embeddings


def rope_parameters(hf_config: Any) -> dict:
    """Rope type, theta and scaling as one dict, from new (`rope_parameters`) or old config keys."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def rope_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for the supported rope types."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; "
            f"kvserve supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # [head_dim // 2]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_position_embeddings)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params.get("original_max_position_embeddings") or max_positions)
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed once for every position, indexed by the positions of each step."""

    cos: torch.Tensor  # [max_positions, head_dim // 2]
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        params: dict,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, params, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        # Kept in the model dtype, as the reference casts cos/sin before rotating.
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [n], each [n, 1, head_dim // 2]; looked up once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, d] ("rotate half" layout: the two halves of the head dimension form
    the (real, imag) pairs) by the angles whose cos/sin are [n, 1, d // 2]."""
    x1, x2 = x.chunk(2, dim=-1)  # [n, heads, d // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
