"""GGUF's K-quants served as stored: Q4_K, Q5_K and Q6_K super-blocks of 256 input values (Q4_K /
Q5_K: an fp16 d and dmin per super-block and 6-bit scales and mins per block of 32, w = d sc q -
dmin m with q 4 or 5 bits; Q6_K: an fp16 d and int8 scales per 16 values, w = d sc (q - 32) with q
6 bits), read from a file's bytes exactly, dequantized bit for bit as the `gguf` package does, and
interleaved by 8 output columns for the kq_linear kernels (engine/kernels/csrc/block_kquants.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.models.block_quant import BLOCK, GROUP, _BlockWeight, _pad_rows, kernels

SUPER = 256  # input values per super-block
KQUANT_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block
BITS = {"q4_k": 4, "q5_k": 5, "q6_k": 6}


@dataclass
class KValues:
    """A K-quant weight before interleaving: q [N, K] uint8 (the unsigned values: 0..15, 0..31 or
    0..63), d and dmin [N, K/256] float32 (fp16 values; dmin 0 for q6_k), sc [N, K/32, 2] uint8
    (q4_k/q5_k: each block's scale and min; q6_k: its two halves' int8 scales, as bytes)."""

    kind: str  # "q4_k" | "q5_k" | "q6_k"
    q: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32, gguf.quants' operations in its order
        n, k = self.shape
        d = self.d.repeat_interleave(SUPER // BLOCK, dim=1)  # [N, K/32]
        if self.kind == "q6_k":
            scale = d[..., None] * self.sc.view(torch.int8).float()  # [N, K/32, 2], exact
            q = self.q.view(n, k // 16, 16).to(torch.int8) - 32
            return (scale.view(n, k // 16, 1) * q.float()).view(n, k)
        dmin = self.dmin.repeat_interleave(SUPER // BLOCK, dim=1)
        scale = d * self.sc[..., 0].float()  # exact: an fp16 times an integer below 64
        low = dmin * self.sc[..., 1].float()
        w = scale[..., None] * self.q.view(n, k // BLOCK, BLOCK).float() - low[..., None]
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> KValues:
        return KValues(self.kind, self.q[index], self.d[index], self.dmin[index], self.sc[index])

    @staticmethod
    def cat(parts: list[KValues]) -> KValues:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights stored as different formats: {sorted(kinds)}")
        return KValues(
            kinds.pop(),
            torch.cat([p.q for p in parts]),
            torch.cat([p.d for p in parts]),
            torch.cat([p.dmin for p in parts]),
            torch.cat([p.sc for p in parts]),
        )

    def to_weight(self) -> BlockKWeight:
        return BlockKWeight(self)


def _fp16(raw: np.ndarray) -> torch.Tensor:  # [..., 2] bytes -> [...] float32
    return torch.from_numpy(raw.copy().view(np.float16)[..., 0].astype(np.float32))


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes per super-block -> 8 six-bit scales and 8 mins ([..., 8] each)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def from_gguf_kblocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> KValues:
    """A GGUF K-quant tensor's bytes ([N, K/256 * block bytes]) as values, exactly."""
    if kind not in KQUANT_BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} is not a K-quant kvserve runs directly")
    n, k = shape
    if k % SUPER:
        raise ValueError(f"{kind} needs input features divisible by 256: {k}")
    ks = k // SUPER
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, ks, KQUANT_BLOCK_BYTES[kind])
    if kind == "Q6_K":
        ql, qh = b[..., 0:128].reshape(n, ks, 2, 1, 64), b[..., 128:192].reshape(n, ks, 2, 1, 32)
        low = (ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F  # [n, ks, half, 2, 64]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03  # [.., 4, 32]
        q = low.reshape(n, ks, 2, 128) | (high.reshape(n, ks, 2, 128) << 4)
        sc = b[..., 192:208].reshape(n, ks * 8, 2)  # per block of 32: its halves' scales
        d = _fp16(b[..., 208:210])
        zero = torch.zeros_like(d)
        return KValues("q6_k", torch.from_numpy(q.reshape(n, k).copy()), d, zero, _t(sc))
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    scale, mins = _scale_min(b[..., 4:16])  # [n, ks, 8] each
    qs = b[..., -128:].reshape(n, ks, 4, 1, 32)
    q = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(n, ks, 8, 32)
    if kind == "Q5_K":
        qh = b[..., 16:48].reshape(n, ks, 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    sc = np.stack([scale, mins], axis=-1).reshape(n, ks * 8, 2)
    kvs = "q5_k" if kind == "Q5_K" else "q4_k"
    return KValues(kvs, torch.from_numpy(q.reshape(n, k).copy()), d, dmin, _t(sc))


def synthetic_kblocks(
    kind: str, rows: int, cols: int, rng: np.random.Generator, std: float = 0.1
) -> np.ndarray:
    """For tests and benchmarks (the gguf package cannot quantize K-quants): [rows, cols / 256 *
    bytes] uint8, valid `kind` super-blocks whose weights spread about `std` around 0 (random
    values and 6-bit scales; d, dmin fp16 chosen to centre them)."""
    ks = cols // 256
    b = rng.integers(0, 256, (rows, ks, KQUANT_BLOCK_BYTES[kind]), dtype=np.uint8)
    if kind == "Q6_K":  # w = d * sc * (q - 32), sc int8 per 16
        b[..., 192:208] = rng.integers(-64, 64, (rows, ks, 16)).astype(np.int8).view(np.uint8)
        d = np.full((rows, ks), std / (64 * 18), np.float16)
        b[..., 208:210] = d.view(np.uint8).reshape(rows, ks, 2)
        return b.reshape(rows, -1)
    top = 15 if kind == "Q4_K" else 31  # w = d * sc * q - dmin * m; m = sc centres q around top/2
    scale = rng.integers(16, 64, (rows, ks, 8), dtype=np.uint8)
    # 12 bytes: 6-bit scales and mins of the 8 blocks (the first 4 in bytes 0-7, the rest split)
    packed = np.zeros((rows, ks, 12), np.uint8)
    for j in range(8):
        sc, mn = scale[..., j], scale[..., j]
        if j < 4:
            packed[..., j] = sc
            packed[..., 4 + j] = mn
        else:
            packed[..., 8 + j - 4] = (sc & 0x0F) | ((mn & 0x0F) << 4)
            packed[..., j - 4] |= (sc >> 4) << 6
            packed[..., j] |= (mn >> 4) << 6
    b[..., 4:16] = packed
    d = np.full((rows, ks), 2 * std / (40 * top), np.float16)
    b[..., 0:2] = d.view(np.uint8).reshape(rows, ks, 2)
    b[..., 2:4] = (d * (top / 2)).astype(np.float16).view(np.uint8).reshape(rows, ks, 2)
    return b.reshape(rows, -1)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint8))


def interleave(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Values q [N, K] (N a multiple of 8; below 2^bits) as the kernels' planes [N/8, K/32, bits,
    32]: vectors 0..3 as Q4_1's nibbles (column c's k = 4j + i low, 4j + 16 + i high in byte 4c +
    i), then the higher bits: 5 bits one vector, bit 2j + half; 6 bits two, vector 4 + j // 2, bits
    4 (j % 2) + 2 half. Shared by the K-quants and Q5_0 / Q5_1."""
    g, kb = q.shape[0] // GROUP, q.shape[1] // BLOCK
    q = q.view(g, GROUP, kb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # [g, b, half, j, c, i]
    low, high = q & 0x0F, q >> 4
    planes = [low[:, :, 0] | (low[:, :, 1] << 4)]  # [g, b, j, c, i]
    if bits == 5:  # bit 2j + half
        shift = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1, 1)
        bit = (high[:, :, 0] | (high[:, :, 1] << 1)) << shift
        planes.append(bit.sum(dim=2, keepdim=True, dtype=torch.uint8))
    elif bits == 6:  # vector j // 2, bits 4 (j % 2) + 2 half
        two = (high[:, :, 0] | (high[:, :, 1] << 2)).view(g, kb, 2, 2, GROUP, 4)
        planes.append(two[:, :, :, 0] | (two[:, :, :, 1] << 4))
    return torch.cat(planes, dim=2).contiguous().view(g, kb, bits, 32)


def deinterleave(qs: torch.Tensor) -> torch.Tensor:  # [N/8, K/32, bits, 32] -> [N, K] uint8
    """The values `interleave` packed, back in row order."""
    g, kb, bits = qs.shape[0], qs.shape[1], qs.shape[2]
    planes = qs.view(g, kb, bits, GROUP, 4)  # [g, b, plane, c, i]
    nib = planes[:, :, :4]
    low = torch.stack([nib & 0x0F, nib >> 4], dim=2)  # [g, b, half, j, c, i]
    if bits == 5:
        shift = (2 * torch.arange(4)).view(1, 4, 1, 1) + torch.arange(2).view(2, 1, 1, 1)
        high = (planes[:, :, 4:5].unsqueeze(2) >> shift) & 1
    elif bits == 6:
        h = planes[:, :, 4:6].repeat_interleave(2, dim=2)  # vector j // 2, per j
        shift = (4 * (torch.arange(4) % 2)).view(1, 4, 1, 1) + 2 * torch.arange(2).view(2, 1, 1, 1)
        high = (h.unsqueeze(2) >> shift) & 3
    else:
        high = torch.zeros_like(low)
    return (low | (high << 4)).permute(0, 4, 1, 2, 3, 5).reshape(g * GROUP, -1)


class BlockKWeight(_BlockWeight):
    """K-quant blocks interleaved for kq_linear: qs [N/8, K/32, bits, 32] uint8 (`interleave`'s
    planes), sc [N/8, K/32, 2, 8] uint8, dm [N/8, K/256, 2, 8] fp16 (d, dmin)."""

    qs: torch.Tensor
    sc: torch.Tensor
    dm: torch.Tensor

    def __init__(self, values: KValues) -> None:
        super().__init__(values)  # type: ignore[arg-type]  # shape is all it reads
        if self.in_features % SUPER:
            raise ValueError(
                f"K-quant weights need input features divisible by 256: {values.shape}"
            )
        self.kind = values.kind
        self.bits = BITS[values.kind]
        g, kb = self.groups, self.blocks
        self.register_buffer("qs", interleave(_pad_rows(values.q, g * GROUP), self.bits))
        sc = _pad_rows(values.sc, g * GROUP).view(g, GROUP, kb, 2)
        self.register_buffer("sc", sc.permute(0, 2, 3, 1).contiguous())
        dm = torch.stack([values.d, values.dmin], dim=-1).to(torch.float16)  # [N, K/256, 2]
        dm = _pad_rows(dm, g * GROUP).view(g, GROUP, kb // 8, 2)
        self.register_buffer("dm", dm.permute(0, 2, 3, 1).contiguous())

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.sc.numel() + 2 * self.dm.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N] float32
        ops = kernels()
        out = ops.kq_linear(x.float(), self.qs, self.sc, self.dm, None)  # type: ignore[attr-defined]
        return self._cut(out)

    def values(self) -> KValues:
        g, kb, n = self.groups, self.blocks, self.out_features
        q = deinterleave(self.qs)
        sc = self.sc.permute(0, 3, 1, 2).reshape(g * GROUP, kb, 2)
        dm = self.dm.float().permute(0, 3, 1, 2).reshape(g * GROUP, kb // 8, 2)
        return KValues(self.kind, q[:n], dm[:n, :, 0], dm[:n, :, 1], sc[:n])

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return self.values().dequantize()
