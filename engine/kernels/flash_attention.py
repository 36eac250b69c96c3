"""The flash-attn backend (CUDA, float16/bfloat16): one varlen call per layer and step, reading the
paged cache in place when the block size allows, with flash-attn's own sliding window and softcap."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.kernels.metadata import AttentionMetadata


def flash_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One varlen flash-attn call for the whole step (decodes and prefill chunks alike).

    flash-attn reads a paged cache directly only when the block size is a multiple of 256;
    otherwise each sequence's context is gathered into one packed K/V first.
    """
    from flash_attn import flash_attn_varlen_func

    cu_seqlens_k = meta._shared.get("cu_seqlens_k")
    if cu_seqlens_k is None:  # once per step, shared by every layer
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        meta._shared["cu_seqlens_k"] = cu_seqlens_k
    common = dict(
        cu_seqlens_q=meta.query_start_loc,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,  # bottom-right aligned: queries are the last query_len positions
        # flash-attn's window counts keys left of the query: window - 1 plus the query's own.
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )
    if softcap is not None:  # only then: flash-attn before 2.6 has no softcap argument
        common["softcap"] = softcap
    if meta.block_size % 256 == 0:
        return flash_attn_varlen_func(
            q, kv_cache[0], kv_cache[1], block_table=meta.block_tables, **common
        )
    keys, values = _gather_packed_context(kv_cache, meta)
    return flash_attn_varlen_func(q, keys, values, **common)


def _gather_packed_context(
    kv_cache: torch.Tensor, meta: AttentionMetadata
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context K/V, packed back to back: [sum(seq_lens), kv_heads, d] each."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots = meta._shared.get("packed_slots")
    if slots is None:  # once per step, shared by every layer
        slots = meta._shared["packed_slots"] = _packed_slots(meta, block_size, kv_cache.device)
    return flat[0][slots], flat[1][slots]


def _packed_slots(meta: AttentionMetadata, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slot of every context token of every sequence, back to back: [sum(seq_lens)]."""
    total = sum(meta.seq_lens_cpu)
    seq_ids = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=device), meta.seq_lens, output_size=total
    )  # [total]
    starts = F.pad(torch.cumsum(meta.seq_lens, 0), (1, 0))[:-1]  # [num_seqs]
    pos = torch.arange(total, device=device) - starts[seq_ids]  # position within its sequence
    return meta.block_tables[seq_ids, pos // block_size].long() * block_size + pos % block_size
