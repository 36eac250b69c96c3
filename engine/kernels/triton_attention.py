"""Triton paged attention: decode and prefill-with-context kernels that read K/V through each
sequence's block table in place (no gather of the context), GQA-aware, with split-K for decode,
sliding windows (keys before a tile's first visible one are never loaded) and logit softcapping.

Imported lazily (only when the backend is "triton"), so CPU-only installs without triton work. The
same kernels run on CPU under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from engine.kernels.metadata import AttentionMetadata

DECODE_BLOCK_N = (
    64  # context tokens per inner-loop tile (any block size: tiles gather via the table)
)
PREFILL_ROWS = 64  # (query token, query head) rows per prefill program
PREFILL_BLOCK_N = 32
MIN_TOKENS_PER_SPLIT = 256  # a decode split is worth its partial write above this much context
MAX_SPLITS = 64
_NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so masked rows never do inf - inf


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0])
    v_cache_ptr,  # same layout (kv_cache[1])
    out_ptr,  # like q
    part_o_ptr,  # [launch_tokens, num_heads, num_splits, head_dim] fp32 (split launches only)
    part_m_ptr,  # [launch_tokens, num_heads, num_splits] fp32: running max (log2 domain)
    part_l_ptr,  # [launch_tokens, num_heads, num_splits] fp32: softmax denominator
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32: context length including this step's tokens
    query_start_ptr,  # [num_seqs + 1] int32: cumulative new-token counts
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (a query at p sees keys > p - window); 0 = full attention
    softcap,  # logit softcap (scores -> softcap * tanh(scores / softcap)); used when SOFTCAP
    seq_offset,  # first sequence of this launch
    token_offset,  # first token row of this launch (indexes the partial buffers)
    num_splits,
    block_size,
    num_heads,
    group,  # query heads per KV head
    head_dim,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    BLOCK_M: tl.constexpr,  # query tokens per program
    GROUP_PAD: tl.constexpr,  # query-head rows per token (group, padded to a power of two)
    BLOCK_N: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT: tl.constexpr,  # write partials for _reduce_splits_kernel instead of the output
    SOFTCAP: tl.constexpr,  # apply the logit softcap
    PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), "tf32" (ignored) for 16-bit inputs
    UPCAST: tl.constexpr,  # dot in float32: the interpreter's 16-bit dot is wrong (triton 3.9)
):
    seq = tl.program_id(0) + seq_offset
    m_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx_start = seq_len - q_len  # absolute position of the sequence's first new token
        # Rows are (query token, query head of this KV head): GQA reads each K/V tile once.
        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        tok = m_tile * BLOCK_M + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        row_ok = (tok < q_len) & (head_in_group < group)
        head = kv_head * group + head_in_group
        q_pos = ctx_start + tok
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < head_dim
        q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_offs + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # Keys this tile can see end at its last query (causal) and start at its first query's
        # window; split that range evenly.
        kv_end = tl.minimum(seq_len, ctx_start + (m_tile + 1) * BLOCK_M)
        kv_start = 0
        if window > 0:
            kv_start = tl.maximum(0, ctx_start + m_tile * BLOCK_M - window + 1)
        chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
        lo = kv_start + split * chunk
        hi = tl.minimum(lo + chunk, kv_end)

        m_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32) + _NEG_BIG
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_PAD], dtype=tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < hi
            block = tl.load(table + pos // block_size, mask=pos_ok, other=0)
            kv_offs = (
                block.to(tl.int64) * stride_cb
                + (pos % block_size) * stride_cs
                + kv_head * stride_ch
            )  # [BLOCK_N]
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if SOFTCAP:  # in natural-log units: softcap * tanh(s / softcap), tanh via exp2
                x = scores / (softcap * 1.4426950408889634)  # s / softcap
                e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
                t = (1.0 - e) / (1.0 + e)
                scores = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)
            visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))  # [rows, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # empty splits (and padding rows) write zeros
        o = acc / l_safe[:, None]
        store_mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            idx = ((q_start + tok - token_offset).to(tl.int64) * num_heads + head) * num_splits
            idx = idx + split
            tl.store(part_o_ptr + idx[:, None] * head_dim + d[None, :], o, mask=store_mask)
            tl.store(part_m_ptr + idx, m_i, mask=row_ok)
            tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        else:
            o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(out_ptr + o_offs + d[None, :], o.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _reduce_splits_kernel(
    part_o_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    token_offset,
    num_splits,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Combine one (token, head)'s split partials: weights l_s * 2^(m_s - max m)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < head_dim
    base = (row.to(tl.int64) * num_heads + head) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=_NEG_BIG)
    l_s = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    o = tl.load(
        part_o_ptr + (base + s)[:, None] * head_dim + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [SPLITS_PAD, HEAD_PAD]
    w = l_s * tl.exp2(m - tl.max(m, 0))
    total = tl.sum(w, 0)
    result = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    out_offs = (row + token_offset).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + out_offs + d, result.to(out_ptr.dtype.element_ty), mask=d_ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and not interpreted():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one by one: few splits keep it quick


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of each decode sequence's context: enough programs to fill the GPU twice over, but
    no split shorter than MIN_TOKENS_PER_SPLIT of the longest context. Depends only on host values
    fixed per CUDA-graph bucket (batch, the model's max length), never on the step's lengths."""
    programs = batch * num_kv_heads
    wanted = _pow2(max(1, -(-2 * num_sms // programs)))
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    by_length = 1 << (by_length.bit_length() - 1)  # round down to a power of two
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    first_seq: int,
    num_seqs: int,
    first_token: int,
    num_tokens: int,
    block_m: int,
    block_n: int,
    num_splits: int,
    max_query_len: int,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    # tl.dot needs at least 16 rows: decode (one token) pads the head rows instead.
    group_pad = max(group_pad, 16 // block_m)
    head_pad = max(16, _pow2(head_dim))
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, d] views
    assert k_cache.stride(3) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    split = num_splits > 1
    if split:
        part_o = torch.empty(
            (num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_m = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # unused
    grid = (num_seqs, -(-max_query_len // block_m), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_m, part_l,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale * math.log2(math.e), window or 0, softcap or 1.0,
        first_seq, first_token, num_splits,
        kv_cache.shape[2], num_heads, group, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        BLOCK_M=block_m, GROUP_PAD=group_pad, BLOCK_N=block_n, HEAD_PAD=head_pad,
        SPLIT=split, SOFTCAP=softcap is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted() and q.dtype != torch.float32,
        num_warps=4,
    )  # fmt: skip
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_o, part_m, part_l, out, first_token, num_splits, num_heads, head_dim,
            out.stride(0), out.stride(1),
            SPLITS_PAD=_pow2(num_splits), HEAD_PAD=head_pad, num_warps=1,
        )  # fmt: skip


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over their paged context (already holding this step's K/V).

    q: [num_tokens, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim].
    Decodes (one launch, split over the context) read only device tensors plus host values fixed
    per batch size, so a CUDA graph can capture them; prefill chunks are a second, eager launch.
    `num_splits` overrides the decode split count (tests). window / softcap: see paged_attention.
    """
    q = q.contiguous()
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_seqs
    if num_decodes:
        # A window bounds what each decode reads: split that, not the whole context.
        span = meta.max_seq_len if window is None else min(meta.max_seq_len, window)
        splits = num_splits or decode_splits(
            num_decodes, kv_cache.shape[3], span, _num_sms(q.device)
        )
        _launch(
            q, kv_cache, out, meta, scale, 0, num_decodes, 0, num_decodes,
            block_m=1, block_n=DECODE_BLOCK_N, num_splits=splits, max_query_len=1,
            window=window, softcap=softcap,
        )  # fmt: skip
    num_prefills = meta.num_seqs - num_decodes
    if num_prefills:
        num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
        rows_per_token = _pow2(num_heads // num_kv_heads)
        block_m = max(1, PREFILL_ROWS // rows_per_token)
        _launch(
            q, kv_cache, out, meta, scale, num_decodes, num_prefills,
            num_decodes, q.shape[0] - num_decodes,
            block_m=block_m, block_n=PREFILL_BLOCK_N, num_splits=1,
            max_query_len=max(meta.query_lens_cpu[num_decodes:]),
            window=window, softcap=softcap,
        )  # fmt: skip
    return out
