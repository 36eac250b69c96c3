"""A fused weight (q/k/v, gate/up) whose GGUF parts are stored in different block formats (a Q4_K_M
file keeps attn_q/attn_k in Q4_K and attn_v in Q6_K in some layers): each part served as stored
with its own kernel, the outputs side by side. Every output column is computed by its part's kernel
alone, so the result is bitwise what one fused kernel of those blocks would give."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class PartsValues:
    """Stored blocks of each part (BlockValues or KValues), in fused row order."""

    parts: list[Any]

    @property
    def kind(self) -> str:
        return "+".join(p.kind for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return torch.cat([p.dequantize() for p in self.parts])

    def to_weight(self) -> BlockParts:
        return BlockParts([p.to_weight() for p in self.parts])


class BlockParts(nn.Module):
    """Block weights stacked along the output rows."""

    def __init__(self, parts: list[Any]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._weights: list[Any] = list(parts)  # the same modules, typed for their kernels
        self.kind = "+".join(str(p.kind) for p in parts)
        self.out_features = sum(int(p.out_features) for p in parts)
        self.in_features = int(parts[0].in_features)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self._weights)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N] float32
        return torch.cat([p.matmul(x) for p in self._weights], dim=1)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return torch.cat([p.dequantize() for p in self._weights])
