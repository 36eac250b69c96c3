"""The batched low-rank update of a mixed-adapter step: the step's token rows grouped into segments by
adapter (built once per step), and for each engine linear y[rows] += (x[rows] @ A^T) @ (scaling B)^T
for each segment's adapter only, in float32 beside the base weights' own (block-quantized) kernels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.core.lora import LoRAInfo


@dataclass
class LoRAPiece:
    """One PEFT module inside an engine linear (q, k or v of qkv; gate or up of gate_up)."""

    col_start: int  # its first column of x @ a^T
    rank: int
    out_start: int  # its first output column of the fused linear
    b: torch.Tensor  # [out_rows, rank] float32: scaling * lora_B


@dataclass
class LinearLoRA:
    """An adapter's delta on one fused linear: t = x @ a^T once (the modules' lora_A stacked), then
    y[:, piece's outputs] += t[:, piece's ranks] @ b^T per module. PEFT's [out, in] layout is kept
    (a transposed weight is the fast small gemm on CPU)."""

    a: torch.Tensor  # [total rank, in_features] float32
    pieces: list[LoRAPiece]


@dataclass
class LoRAAdapter:
    """A loaded adapter: per layer, per engine linear ("qkv", "o", "gate_up", "down") its delta."""

    info: LoRAInfo
    lora_id: (
        int  # unique per load: reloading a name gives a new id (and a new namespace if changed)
    )
    layers: list[dict[str, LinearLoRA]]

    @property
    def num_bytes(self) -> int:
        total = 0
        for linears in self.layers:
            for lin in linears.values():
                total += 4 * (lin.a.numel() + sum(p.b.numel() for p in lin.pieces))
        return total


class _Scheduled(Protocol):  # what the segments need of a ScheduledSeq (no executor import here)
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def lora_id(self) -> int | None: ...


@dataclass(frozen=True)
class LayerLoRA:
    """One layer's view of the step's segments: (first row, end row, that adapter's linears)."""

    parts: tuple[tuple[int, int, dict[str, LinearLoRA]], ...]


@dataclass(frozen=True)
class LoRABatch:
    """The step's adapter segments: contiguous token rows that use one adapter (base rows have none)."""

    segments: tuple[tuple[int, int, LoRAAdapter], ...]

    def layer(self, index: int) -> LayerLoRA | None:
        parts = tuple((s, e, a.layers[index]) for s, e, a in self.segments if a.layers[index])
        return LayerLoRA(parts) if parts else None

    @property
    def num_adapters(self) -> int:
        return len({a.lora_id for _, _, a in self.segments})


def lora_batch(
    scheduled: Sequence[_Scheduled], adapters: Mapping[int, LoRAAdapter]
) -> LoRABatch | None:
    """Segments of equal adapter in the step's token order (the scheduler orders each kind of row by
    adapter, so an adapter has at most a decode and a prefill segment); None when no row has one."""
    if not adapters:
        return None
    segments: list[tuple[int, int, LoRAAdapter]] = []
    row = 0
    for s in scheduled:
        end = row + s.num_new_tokens
        lora_id = s.lora_id
        if lora_id is not None:
            adapter = adapters[lora_id]
            if segments and segments[-1][1] == row and segments[-1][2] is adapter:
                segments[-1] = (segments[-1][0], end, adapter)
            else:
                segments.append((row, end, adapter))
        row = end
    return LoRABatch(tuple(segments)) if segments else None


_LINEARS = ("qkv", "o", "gate_up", "down")  # the one-call C++ layer's matmul order


def one_call_args(lora: LayerLoRA | None) -> tuple[list[torch.Tensor], list[int]] | None:
    """The layer's deltas as csrc/decode_layer.cpp's decode_layer_lora takes them: per segment
    [start, end, matmuls], per matmul [index, pieces], per piece [col_start, rank, out_start]; the
    tensors in the same order (a matmul's a, then its pieces' b)."""
    if lora is None:
        return None
    tensors: list[torch.Tensor] = []
    segments: list[int] = []
    for start, end, linears in lora.parts:
        present = [(i, linears[name]) for i, name in enumerate(_LINEARS) if name in linears]
        segments += [start, end, len(present)]
        for i, lin in present:
            segments += [i, len(lin.pieces)]
            tensors.append(lin.a)
            for p in lin.pieces:
                segments += [p.col_start, p.rank, p.out_start]
                tensors.append(p.b)
    return tensors, segments


def add_lora(
    y: torch.Tensor,  # [n, out] the base linear's output, updated in place
    x: torch.Tensor,  # [n, in] its input
    lora: LayerLoRA | None,
    linear: str,  # "qkv", "o", "gate_up" or "down"
) -> torch.Tensor:
    """y with each segment's adapter delta added to its rows (y itself when there is none)."""
    if lora is None:
        return y
    for start, end, linears in lora.parts:
        lin = linears.get(linear)
        if lin is not None:
            _add_segment(y[start:end], x[start:end], lin)
    return y


# Rows per low-rank GEMM. Every product runs as a batch of GEMMs of exactly this many rows (the last
# padded with zeros), so a row's bits depend on neither its neighbours nor how many share its adapter
# in the step: the block-quantized base kernels are batch-invariant, and so must the deltas be. One
# GEMM over all of a segment's rows would pick its blocking (and sum order) by the row count.
LORA_ROWS = 8


def low_rank(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ w^T (w [out, in]) in float32, each row computed alike whatever n is."""
    n = x.shape[0]
    m = -(-n // LORA_ROWS) * LORA_ROWS
    x = x.contiguous()
    if m != n:
        x = F.pad(x, (0, 0, 0, m - n))
    wt = w.t()
    chunks = m // LORA_ROWS
    out = torch.bmm(
        x.view(chunks, LORA_ROWS, x.shape[1]), wt.unsqueeze(0).expand(chunks, *wt.shape)
    )
    return out.view(m, w.shape[0])[:n]


def _add_segment(y: torch.Tensor, x: torch.Tensor, lin: LinearLoRA) -> None:
    t = low_rank(x if x.dtype == torch.float32 else x.float(), lin.a)  # [rows, total rank]
    whole = len(lin.pieces) == 1
    for p in lin.pieces:
        tp = t if whole else t.narrow(1, p.col_start, p.rank)
        dest = y.narrow(1, p.out_start, p.b.shape[0])
        delta = low_rank(tp, p.b)
        # float32: added as is; a 16-bit model: the delta in float32, added once rounded
        dest.add_(delta if y.dtype == torch.float32 else delta.to(y.dtype))
