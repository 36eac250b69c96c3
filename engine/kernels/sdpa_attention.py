"""The torch SDPA attention backend (the reference, everywhere) and the CPU path that reads the paged
cache in place with the C++ kernels (engine.kernels.cpu_kernels) for every query; both with
sliding windows and logit softcapping (an explicit masked softmax where SDPA cannot softcap)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.kernels.kv_dtype import kernels_read

if TYPE_CHECKING:
    from engine.kernels.metadata import AttentionMetadata


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    in_place_decode: bool = False,
) -> torch.Tensor:
    num_decodes = meta.num_decode_seqs
    in_place_decode = in_place_decode and kernels_read(kv_cache.dtype, q.dtype)
    if in_place_decode and num_decodes == meta.num_seqs:  # a pure decode step: one kernel call
        return cpu_kernels.paged_decode_attention(
            q, kv_cache, meta.block_tables, meta.seq_lens, scale, window, softcap
        )
    if in_place_decode:
        # Every query, prefill ones too, attends over its own causal context read in place, bitwise
        # as the decode kernel gives it alone (the prefill kernel shares K/V tiles across a chunk's
        # rows): a token's result is the same whether its prompt was prefilled whole, in chunks,
        # after a prefix-cache hit or recomputed after preemption (batch-invariant). A window
        # starts each query's context at max(0, its length - window).
        return cpu_kernels.paged_prefill_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            window,
            softcap,
        )
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    if num_decodes:
        out[:num_decodes] = sdpa_decode(q[:num_decodes], kv_cache, meta, scale, window, softcap)
    start = num_decodes  # decodes own one token each, so they fill the first rows
    for i in range(num_decodes, meta.num_seqs):
        end = start + meta.query_lens_cpu[i]
        out[start:end] = sdpa_prefill(
            q[start:end], k[start:end], v[start:end], kv_cache, meta, i, scale, window, softcap
        )
        start = end
    return out


def masked_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA, or when softcapping (which SDPA cannot do) the same attention written out.

    queries [..., kv_heads, rows, d] (a KV head's query heads folded into rows); keys, values
    [..., kv_heads, num_keys, d]; mask (True = visible) broadcasts to [..., rows, num_keys]."""
    if softcap is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [..., kv_heads, rows, keys]
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)


def sdpa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """All decode sequences in one SDPA call over their contexts gathered into a padded batch."""
    batch, num_heads, head_dim = q.shape  # [B, num_heads, head_dim]
    num_kv_heads = kv_cache.shape[3]
    table, mask = meta.decode_context(window)  # [B, num_blocks], [B, 1, 1, ctx_len]
    ctx_len = mask.shape[-1]
    # K and V in one gather: [2, B, num_blocks, block_size, kv_heads, d] -> [2, B, kv_heads, ctx, d]
    context = kv_cache[:, table].view(2, batch, ctx_len, num_kv_heads, head_dim).transpose(2, 3)
    context = context.to(q.dtype)  # a float16 cache under float32 queries: widened, exactly
    # One query token per sequence, so the query heads sharing a KV head can ride along the
    # "query length" axis: GQA without copying K/V.
    queries = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = masked_attention(
        queries, context[0], context[1], mask, scale, softcap
    )  # [B, kv_heads, group, d]
    return out.reshape(batch, num_heads, head_dim)


def sdpa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq_index: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One prefill chunk: its queries are the last query_len positions of a seq_len context."""
    query_len, seq_len = q.shape[0], meta.seq_lens_cpu[seq_index]
    num_heads, num_kv_heads, head_dim = q.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    # The fresh K/V are the cached ones only when the cache keeps q's dtype (a float16 cache rounds).
    plain = window is None and softcap is None and kv_cache.dtype == q.dtype
    if query_len == seq_len and plain:  # no earlier context: the fresh K/V, plain causal
        queries = q.transpose(0, 1)  # [num_heads, query_len, d]
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, seq_len, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1)
    # [num_blocks], [query_len, num_keys]: keys from first_key on (a window skips earlier ones)
    table, mask, first_key = meta.prefill_context(seq_index, query_len, window)
    num_keys = seq_len - first_key
    keys = kv_cache[0][table].view(-1, num_kv_heads, head_dim)[:num_keys].transpose(0, 1)
    values = kv_cache[1][table].view(-1, num_kv_heads, head_dim)[:num_keys].transpose(0, 1)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    # A KV head's query heads as rows, head-major: [kv_heads, group * query_len, d]
    group = num_heads // num_kv_heads
    queries = q.transpose(0, 1).reshape(num_kv_heads, group * query_len, head_dim)
    out = masked_attention(queries, keys, values, mask.repeat(group, 1), scale, softcap)
    return out.view(num_heads, query_len, head_dim).transpose(0, 1)
