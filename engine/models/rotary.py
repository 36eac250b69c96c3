"""Rotary position embeddings: the rope types configs use (default, linear, dynamic, yarn, llama3,
longrope) read from config.json, partial rotary, and the cos/sin tables a decoder looks up per step.

Each type's inverse frequencies and attention factor are those of transformers' ROPE_INIT_FUNCTIONS
(tests/unit/test_rotary.py checks every type against it)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """Rope type, theta and scaling as one flat dict, from new (`rope_parameters`, possibly one
    dict per layer type as Gemma 3 has) or old (`rope_theta` + `rope_scaling`) config keys."""
    params = getattr(hf_config, "rope_parameters", None)
    if (
        isinstance(params, dict)
        and layer_type is not None
        and isinstance(params.get(layer_type), dict)
    ):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    if "partial_rotary_factor" not in params and getattr(hf_config, "partial_rotary_factor", None):
        params["partial_rotary_factor"] = hf_config.partial_rotary_factor
    if params["rope_type"] in ("yarn", "llama3", "longrope"):
        # Phi-3 keeps its pretraining length beside rope_scaling; it takes priority (as in transformers).
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original:
            params["original_max_position_embeddings"] = original
    return params


def rotary_dim(head_dim: int, params: dict) -> int:
    """How many leading dimensions of each head rotate (all unless `partial_rotary_factor` < 1)."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def rope_inv_freq(
    head_dim: int, params: dict, max_position_embeddings: int, long: bool = False
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, attention factor that scales cos and sin).
    `long` picks LongRoPE's long factors (sequences past its original length)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported; "
            f"kvserve supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    dim = rotary_dim(head_dim, params)
    base = float(params["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "longrope":
        return _longrope(exponents, base, params, max_position_embeddings, long)
    inv_freq = 1.0 / (base**exponents)  # [dim // 2]
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn(exponents, dim, base, params, max_position_embeddings)
    # default; and dynamic NTK, which only changes frequencies past max_position_embeddings,
    # a length kvserve never serves (max_model_len is capped there).
    return inv_freq, 1.0


def _original_length(params: dict, max_positions: int) -> float:
    return float(params.get("original_max_position_embeddings") or max_positions)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = _original_length(params, max_positions)
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    exponents: torch.Tensor, dim: int, base: float, params: dict, max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones, a linear
    ramp between the dimensions that turn beta_slow and beta_fast times over the original length."""
    original = _original_length(params, max_positions)
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention = _mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency; 0: interpolate it
    pos_freqs = base**exponents
    inv_freq, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


def _longrope(
    exponents: torch.Tensor, base: float, params: dict, max_positions: int, long: bool
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, Phi-4-mini): per-dimension rescale factors, short ones up to the original
    pretraining length and long ones past it; cos/sin scaled by sqrt(1 + ln(s) / ln(original))."""
    original = _original_length(params, max_positions)
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.shape != exponents.shape:
        raise ValueError(
            f"rope_scaling {'long' if long else 'short'}_factor has {ext.numel()} values; "
            f"the rotary dimension needs {exponents.numel()}"
        )
    return 1.0 / (ext * base**exponents), float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed once for every position (scaled by the type's attention factor),
    indexed by the positions of each step.

    LongRoPE has a second set, its long factors. transformers rotates a sequence with the short
    set while it fits the original length and with the long set past it (recomputing its whole
    cache once, when it first crosses). A paged cache shared between sequences by prefix caching
    needs one rotation for every sequence, so, as vLLM, kvserve picks the set by the context it
    serves: long when max_model_len passes the original length (`limit_context`), else short.
    Either way, a sequence within that choice's range gets exactly transformers' rotation."""

    cos: torch.Tensor  # [max_positions, rotary_dim // 2]
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
        self.max_positions = max_positions
        self.rotary_dim = rotary_dim(head_dim, params)
        self.partial = self.rotary_dim != head_dim
        self.long_after: int | None = None  # LongRoPE: served contexts past this use the long set
        sets = [rope_inv_freq(head_dim, params, max_positions)]
        if params["rope_type"] == "longrope":
            self.long_after = int(_original_length(params, max_positions))
            sets.append(rope_inv_freq(head_dim, params, max_positions, long=True))
        # Kept in the model dtype, as the reference casts cos/sin before rotating.
        self.tables = [
            tuple(t.to(dtype=dtype, device=device) for t in _cos_sin(inv_freq, max_positions))
            for inv_freq in sets
        ]
        self.register_buffer("cos", self.tables[0][0], persistent=False)
        self.register_buffer("sin", self.tables[0][1], persistent=False)
        self.uses_long_factors = False
        self.limit_context(max_positions)

    def limit_context(self, max_model_len: int) -> None:
        """The longest context served: LongRoPE takes its long set past the original length."""
        self.uses_long_factors = self.long_after is not None and max_model_len > self.long_after
        self.cos, self.sin = self.tables[1 if self.uses_long_factors else 0]
        if self.long_after is not None:
            logger.info(
                "LongRoPE: %s factors for contexts up to %d tokens (original length %d)",
                "long" if self.uses_long_factors else "short",
                max_model_len,
                self.long_after,
            )

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [n], each [n, 1, rotary_dim // 2]; looked up once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _cos_sin(
    inv_freq_and_factor: tuple[torch.Tensor, float], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, rotary_dim // 2] float32, scaled by the attention factor."""
    inv_freq, attention = inv_freq_and_factor
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos() * attention, freqs.sin() * attention


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [n, heads, d] ("rotate half" layout: the two halves of the rotary dimensions form
    the (real, imag) pairs) by the angles whose cos/sin are [n, 1, r // 2]; with partial rotary
    (r < d) the last d - r dimensions pass through."""
    half = cos.shape[-1]
    if 2 * half != x.shape[-1]:
        rotated = apply_rotary(x[..., : 2 * half], cos, sin)
        return torch.cat((rotated, x[..., 2 * half :]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # [n, heads, d // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
