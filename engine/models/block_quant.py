"""Block-quantized weights in GGUF's own number formats (blocks of 32 input values: Q8_0, int8 with a
scale; Q4_1, 4-bit with a scale and a minimum; fp16 scales as GGUF stores them), interleaved by 8
output columns for the C++ kernels of engine/kernels/csrc/block_matmul.cpp, which quantize
activations per row and block (batch-invariant). Built from float weights, or from a GGUF file's
stored blocks with no requantization error."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.kernels import cpu_kernels

BLOCK = 32  # input values per block
GROUP = 8  # output columns interleaved per SIMD group


def kernels() -> object:
    """torch.ops.kvserve with the block kernels loaded, or a ValueError saying why not."""
    if not cpu_kernels.available():
        raise ValueError(
            "block-quantized weights need kvserve's C++ CPU kernels, which could not be built or "
            "loaded (see the log); use --quantization none"
        )
    return torch.ops.kvserve


@dataclass
class BlockValues:
    """A weight's blocks before interleaving: q [N, K] (uint8 0..15 for q4_1 and q4_0, int8 for
    q8_0), d and m [N, K/32] float32 (m all zero for q8_0, -8 d for q4_0). Row slices and
    concatenations are exact."""

    kind: str  # "q4_1" | "q4_0" | "q8_0"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, as GGUF dequantizes (d * q + m)
        n, k = self.shape
        w = self.q.float().view(n, k // BLOCK, BLOCK) * self.d[..., None]
        if self.kind in ("q4_1", "q4_0"):
            w = w + self.m[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> BlockValues:  # of this class (Q5 values stay Q5)
        return type(self)(self.kind, self.q[index], self.d[index], self.m[index])

    @staticmethod
    def cat(parts: list[BlockValues]) -> BlockValues:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights stored as different formats: {sorted(kinds)}")
        return type(parts[0])(
            kinds.pop(),
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.m for p in parts]),
        )

    def to_weight(self) -> BlockQ4Weight | BlockQ8Weight:
        return BlockQ4Weight(self) if self.kind in ("q4_1", "q4_0") else BlockQ8Weight(self)


def _blocks(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N, K // 32, 32] float32
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"block quantization needs input features divisible by 32: {in_features}")
    return weight.float().reshape(out_features, in_features // BLOCK, BLOCK)


def _fp16(t: torch.Tensor) -> torch.Tensor:  # the scale GGUF would store, back in float32
    return t.to(torch.float16).float()


def _roundf(t: torch.Tensor) -> torch.Tensor:
    """C's roundf, halves away from zero, as ggml rounds (torch.round rounds halves to even)."""
    a = t.abs()
    whole = a.floor()
    return torch.sign(t) * (whole + (2 * (a - whole)).floor())  # exact: no a + 0.5 rounding


def quantize_q8_0(weight: torch.Tensor) -> BlockValues:
    """As ggml's reference Q8_0 quantizer: d = max|w| / 127 per block, q = roundf(w / d)."""
    w = _blocks(weight)
    d = w.abs().amax(dim=-1) / 127.0  # [N, K/32]
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = _roundf(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return BlockValues("q8_0", q.flatten(1), _fp16(d), torch.zeros_like(d))


def quantize_q4_1(weight: torch.Tensor) -> BlockValues:
    """As ggml's reference Q4_1 quantizer: d = (max - min) / 15, m = min, q = round((w - m) / d)."""
    w = _blocks(weight)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, K/32]
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.floor((w - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return BlockValues("q4_1", q.flatten(1), _fp16(d), _fp16(lo))


# GGUF block layouts: bytes per block of 32 and where the fp16 scale / minimum and the values sit.
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def from_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockValues:
    """A GGUF tensor's stored bytes ([N, K/32 * block bytes]) as blocks, exactly: Q8_0 and Q4_1 as
    they are, Q4_0 (w = d * (q - 8)) as q4_0: its values are Q4_1's with m = -8 d (exact in
    float32), which nothing stores; the kernels sum each block's products with q - 8 in integers."""
    if kind not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} is not stored as blocks kvserve runs directly")
    n, k = shape
    size = GGUF_BLOCK_BYTES[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, size)
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)
        return BlockValues("q8_0", q, d, torch.zeros_like(d))
    if kind == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        m = -8.0 * d
    packed = torch.from_numpy(blocks[..., size - 16 :].copy())  # [N, K/32, 16]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)  # GGUF: low nibbles first
    return BlockValues("q4_1" if kind == "Q4_1" else "q4_0", q, d, m)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad])


def _group_scales(s: torch.Tensor, groups: int) -> torch.Tensor:  # [N, KB] -> [N/8, KB, 8] fp16
    return s.to(torch.float16).view(groups, GROUP, -1).transpose(1, 2).contiguous()


class _BlockWeight(nn.Module):
    """Common parts: N padded up to a multiple of 8 columns (zero blocks), cut off after the kernel."""

    d: torch.Tensor
    m: torch.Tensor  # registered by the formats with a minimum (_register_scales)
    kind: str

    def __init__(self, values: BlockValues) -> None:
        super().__init__()
        self.out_features, self.in_features = values.shape
        if self.in_features % BLOCK:
            raise ValueError(f"block weights need input features divisible by 32: {values.shape}")
        self.groups = -(-self.out_features // GROUP)
        self.blocks = self.in_features // BLOCK

    def _cut(self, out: torch.Tensor) -> torch.Tensor:
        return out if out.shape[1] == self.out_features else out[:, : self.out_features]

    def _register_scales(self, values: BlockValues, derived_m: bool) -> None:
        """d and m [N/8, K/32, 8] fp16; m empty when the kernels derive it from d (Q4_0, Q5_0), so
        they read the bytes per block the file stores."""
        g = self.groups
        self.register_buffer("d", _group_scales(_pad_rows(values.d, g * GROUP), g))
        if derived_m:
            self.register_buffer("m", torch.empty(0, dtype=torch.float16))
        else:
            self.register_buffer("m", _group_scales(_pad_rows(values.m, g * GROUP), g))

    def _scales(self, offset: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, m) [N, K/32] float32 back from the buffers; m = offset * d when it is derived."""
        g, kb, n = self.groups, self.blocks, self.out_features
        d = self.d.float().transpose(1, 2).reshape(g * GROUP, kb)
        if offset is not None:
            m = offset * d
        else:
            m = self.m.float().transpose(1, 2).reshape(g * GROUP, kb)
        return d[:n], m[:n]

    def _scale_bytes(self) -> int:
        return 2 * (self.d.numel() + self.m.numel())


class BlockQ8Weight(_BlockWeight):
    """Q8_0 blocks, qs [N/8, K/32, 8, 32] int8 (vector j, lane c: column c's 4 values 4j..4j+3)."""

    qs: torch.Tensor
    kind = "q8_0"

    def __init__(self, values: BlockValues) -> None:
        super().__init__(values)
        g, kb = self.groups, self.blocks
        q = _pad_rows(values.q, g * GROUP).view(g, GROUP, kb, 8, 4)  # [g, c, b, j, i]
        self.register_buffer("qs", q.permute(0, 2, 3, 1, 4).contiguous().view(g, kb, 8, 32))
        self.register_buffer("d", _group_scales(_pad_rows(values.d, g * GROUP), g))

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + 2 * self.d.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N] float32
        ops = kernels()
        return self._cut(ops.q8_linear(x.float(), self.qs, self.d, None))  # type: ignore[attr-defined]

    def values(self) -> BlockValues:
        g, kb = self.groups, self.blocks
        q = self.qs.view(g, kb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(g * GROUP, -1)
        d = self.d.float().transpose(1, 2).reshape(g * GROUP, kb)
        n = self.out_features
        return BlockValues("q8_0", q[:n], d[:n], torch.zeros_like(d[:n]))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, K] float32, dequantized rows
        if self.qs.device.type == "cpu" and ids.dtype == torch.int64:  # one op, the same values
            return kernels().q8_rows(self.qs, self.d, ids)  # type: ignore[attr-defined]
        return self.rows_torch(ids)

    def rows_torch(self, ids: torch.Tensor) -> torch.Tensor:  # rows() in torch ops, any device
        group, lane = ids // GROUP, ids % GROUP
        q = self.qs.view(self.groups, self.blocks, 8, GROUP, 4)[
            group, :, :, lane, :
        ]  # [n, kb, 8, 4]
        d = self.d[group, :, lane].float()  # [n, kb]
        return (q.reshape(ids.shape[0], self.blocks, BLOCK).float() * d[..., None]).flatten(1)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.values().dequantize()


class BlockQ4Weight(_BlockWeight):
    """Q4_1 blocks, qs [N/8, K/32, 4, 32] uint8 (vector j, lane c: column c's values 4j..4j+3 in the
    low nibbles and 4j+16..4j+19 in the high ones); d, m [N/8, K/32, 8] fp16. Q4_0 (kind q4_0)
    stores no m (empty): the kernels take each block's weights as q - 8 in its integer sum (one fma
    per block, as Q8_0), so it reads 18 bytes per block, as stored."""

    qs: torch.Tensor

    def __init__(self, values: BlockValues) -> None:
        super().__init__(values)
        self.kind = values.kind
        g, kb = self.groups, self.blocks
        q = _pad_rows(values.q, g * GROUP).view(g, GROUP, kb, 2, 4, 4)  # [g, c, b, half, j, i]
        q = q.permute(0, 2, 3, 4, 1, 5)  # [g, b, half, j, c, i]
        packed = q[:, :, 0] | (q[:, :, 1] << 4)  # [g, b, j, c, i]
        self.register_buffer("qs", packed.contiguous().view(g, kb, 4, 32))
        self._register_scales(values, derived_m=self.kind == "q4_0")

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self._scale_bytes()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N] float32
        ops = kernels()
        out = ops.q4_linear(x.float(), self.qs, self.d, self.m, None)  # type: ignore[attr-defined]
        return self._cut(out)

    def values(self) -> BlockValues:
        g, kb = self.groups, self.blocks
        packed = self.qs.view(g, kb, 4, GROUP, 4)  # [g, b, j, c, i]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=2)  # [g, b, half, j, c, i]
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(g * GROUP, -1)
        d, m = self._scales(-8.0 if self.kind == "q4_0" else None)
        return BlockValues(self.kind, q[: self.out_features], d, m)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.values().dequantize()


BlockWeight = BlockQ4Weight | BlockQ8Weight
