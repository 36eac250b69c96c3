"""GGUF's Q5_0 and Q5_1 blocks served as stored (32 values of 5 bits per block: Q5_1 w = d q + m
with fp16 d, m; Q5_0 w = d (q - 16), no m stored: the kernels sum each block's products with
q - 16 in integers, then one fma per block), read from a file's bytes exactly, dequantized bit for bit as
the `gguf` package does, and interleaved by 8 output columns for the q5_linear kernels
(engine/kernels/csrc/block_q5.cpp): the values in the K-quants' 5-bit planes, the scales as Q4_1's."""

from __future__ import annotations

import numpy as np
import torch

from engine.models.block_quant import (
    BLOCK,
    GROUP,
    BlockValues,
    _BlockWeight,
    _pad_rows,
    kernels,
)
from engine.models.kquant import deinterleave, interleave

Q5_BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24}  # fp16 d (and m), 4 bytes of fifth bits, 16 of nibbles


class Q5Values(BlockValues):
    """A Q5 weight's blocks before interleaving: q [N, K] uint8 0..31, d and m [N, K/32] float32
    (m = -16 d for q5_0)."""

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, gguf.quants' operations in its order
        n, k = self.shape
        q = self.q.float().view(n, k // BLOCK, BLOCK)
        if self.kind == "q5_0":
            return (self.d[..., None] * (q - 16)).view(n, k)  # d * 0 keeps its sign, as gguf's
        return (self.d[..., None] * q + self.m[..., None]).view(n, k)

    def to_weight(self) -> BlockQ5Weight:  # type: ignore[override]
        return BlockQ5Weight(self)


def from_gguf_q5blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> Q5Values:
    """A GGUF Q5_0 / Q5_1 tensor's bytes ([N, K/32 * block bytes]) as values, exactly: per block
    d (Q5_1: then m), qh (bit j: value j's fifth bit), qs (value j in byte j's low nibble for j <
    16, in byte j - 16's high nibble otherwise)."""
    if kind not in Q5_BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} is not a Q5 block type")
    n, k = shape
    size = Q5_BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, size)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q5_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        m = -16.0 * d
    qh = blocks[..., size - 20 : size - 16]  # [N, K/32, 4] little-endian: bit j of the 32
    top = np.unpackbits(qh, axis=-1, bitorder="little")  # [N, K/32, 32]
    packed = blocks[..., size - 16 :]
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    q = torch.from_numpy((low | (top << 4)).reshape(n, k))
    return Q5Values("q5_1" if kind == "Q5_1" else "q5_0", q, d, m)


class BlockQ5Weight(_BlockWeight):
    """Q5 blocks interleaved for q5_linear: qs [N/8, K/32, 5, 32] uint8 (kquant.interleave's
    planes), d, m [N/8, K/32, 8] fp16 (m empty for q5_0: the kernels take its weights as q - 16 in
    the integer sums, so it reads its 22 bytes per block, as stored)."""

    qs: torch.Tensor

    def __init__(self, values: Q5Values) -> None:
        super().__init__(values)
        self.kind = values.kind
        self.register_buffer("qs", interleave(_pad_rows(values.q, self.groups * GROUP), 5))
        self._register_scales(values, derived_m=self.kind == "q5_0")

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self._scale_bytes()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N] float32
        ops = kernels()
        out = ops.q5_linear(x.float(), self.qs, self.d, self.m, None)  # type: ignore[attr-defined]
        return self._cut(out)

    def values(self) -> Q5Values:
        q = deinterleave(self.qs)
        d, m = self._scales(-16.0 if self.kind == "q5_0" else None)
        return Q5Values(self.kind, q[: self.out_features], d, m)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.values().dequantize()
