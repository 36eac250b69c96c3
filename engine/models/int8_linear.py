"""Batch-invariant int8 linear on fbgemm: per-output-channel int8 weights, int8 activations with
scales per row (per token), computed by torch's dynamic quantized linear kernel (AVX2 / AVX-512).

fbgemm's dynamic linear picks ONE activation scale for the whole input tensor (from its min and max),
so on its own a token's output would depend on the other tokens of the batch. Here a fixed first row
[+A, -A, 0, ...] is prepended and every other row is pre-scaled into [-A, A] by its own max-abs: the
tensor's min and max, hence fbgemm's scale and zero point, are constants, each row's integers depend
only on that row, the int32 accumulation is exact, and each output row is scaled back by its own
factor. A row therefore gives bitwise the same output alone or in any batch.

Activations are 7-bit (`reduce_range`: AVX2's u8 x s8 multiply, vpmaddubsw, sums pairs of products
into int16 with saturation; 7-bit activations against 8-bit weights never saturate). 7 bits per row
cost SmolLM2 about 25% perplexity, so each row goes in twice: its rounded integers (high) and its
rounding residual scaled by 126 (low), y = W.high + W.low / 126: about 13-bit activations (as accurate
as float activations, measured) for twice the rows, nearly free at decode sizes where the weights'
memory traffic dominates.
"""

from __future__ import annotations

import threading
import warnings

import torch
from torch import nn

# The fixed row's +-63.5 puts fbgemm's scale at exactly 127 / 127 = 1 and its zero point at 64, so
# the rows' values are quantized to the nearest integer, within the 7-bit range [-64, 63].
_A = 63.5
_LEVELS = 63.0  # a row's max-abs maps to +-63
_LOW_FACTOR = 2.0 * _LEVELS  # the residual (at most half a step) scaled back onto [-63, 63]
_TINY = torch.finfo(torch.float32).tiny


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _pack(q: torch.Tensor, scale: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed weight from int8 q [out, in] and per-channel scales [out]."""
    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 flags quantized tensor constructors as deprecated
        warnings.simplefilter("ignore", UserWarning)
        qtensor = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
        engine = torch.backends.quantized.engine
        try:
            torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(qtensor, None)
        finally:
            torch.backends.quantized.engine = engine


class _InputBuffers(threading.local):
    """Per thread, one growing [rows + 1, in] float32 buffer per input width; row 0 is the fixed
    [+A, -A, 0, ...] row, the others take the scaled input (no allocation or concat per call)."""

    def __init__(self) -> None:
        self.by_width: dict[int, torch.Tensor] = {}

    def get(self, rows: int, width: int) -> torch.Tensor:  # [rows + 1, width]
        buf = self.by_width.get(width)
        if buf is None or buf.shape[0] < rows + 1:
            capacity = max(rows + 1, 2 * (buf.shape[0] if buf is not None else 0), 9)
            with torch.inference_mode(False):  # a normal tensor: writable inside and outside
                buf = torch.zeros(capacity, width)
                buf[0, 0], buf[0, 1] = _A, -_A
            self.by_width[width] = buf
        return buf[: rows + 1]


_buffers = _InputBuffers()


class Int8Weight(nn.Module):
    """Symmetric per-output-channel int8 weight, w ~= q * scale[:, None] with q in [-127, 127],
    packed for fbgemm; `matmul` quantizes activations per row (batch-invariant, see module doc)."""

    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:  # weight: [out, in]
        super().__init__()
        if weight.shape[1] < 2:
            raise ValueError("int8 weights need at least 2 input features")
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("scale", scale)
        self.packed = _pack(q, scale)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], x's dtype
        dtype = x.dtype
        x = x.float()
        n = x.shape[0]
        # step = max-abs / 63: each row spans the integers [-63, 63] in units of its own step
        step = x.abs().amax(dim=1, keepdim=True).mul_(1.0 / _LEVELS).clamp_(min=_TINY)  # [n, 1]
        buf = _buffers.get(2 * n, self.in_features)  # [1 + 2n, in]: fixed row, high, low
        high, low = buf[1 : n + 1], buf[n + 1 :]
        torch.div(x, step, out=low)
        # A NaN would reach fbgemm's min/max and so every row's scale: keep the integers finite
        # and let the bad row's own `step` (NaN/inf) carry the error to its output row only.
        torch.nan_to_num(low, nan=0.0, posinf=_LEVELS, neginf=-_LEVELS, out=low)
        torch.round(low, out=high)  # integers in [-63, 63]
        low.sub_(high).mul_(_LOW_FACTOR)  # the rounding residual, in [-63, 63] again
        y = torch.ops.quantized.linear_dynamic(buf, self.packed, True)  # [1 + 2n, out]
        out = torch.add(y[1 : n + 1], y[n + 1 :], alpha=1.0 / _LOW_FACTOR).mul_(step)
        return out if dtype == torch.float32 else out.to(dtype)

    def int8_values(self) -> torch.Tensor:  # [out, in] int8, as packed
        weight, _ = torch.ops.quantized.linear_unpack(self.packed)
        return weight.int_repr()

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        return self.int8_values().float() * self.scale[:, None]


class Int8Embedding(nn.Module):
    """Embedding lookup from an int8 table: each looked-up row is dequantized (q[i] * scale[i]). Used
    for a head tied to its embedding, so lookups and logits share one set of int8 weights."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, head: Int8Weight, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", head.int8_values().contiguous())  # [vocab, hidden]
        self.register_buffer("scale", head.scale.clone())  # [vocab]
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = self.qweight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        rows = self.qweight[ids].float() * self.scale[ids, None]
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)
