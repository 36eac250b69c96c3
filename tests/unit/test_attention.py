"""paged_attention against a dense causal reference: mixed decode + prefill, GQA, block sizes."""

from __future__ import annotations

import random

import pytest
import torch

from engine.executor.attention import AttentionMetadata, allocate_kv_cache, paged_attention


def dense_reference(q, k_ctx, v_ctx, query_len, scale):
    """Naive attention for one sequence: q [query_len, H, d], full context k/v [seq_len, KVH, d]."""
    seq_len, num_kv_heads = k_ctx.shape[0], k_ctx.shape[1]
    group = q.shape[1] // num_kv_heads
    k = k_ctx.repeat_interleave(group, dim=1)  # [seq_len, H, d]
    v = v_ctx.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, query_len, seq_len]
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_step(rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim=8):
    """Fill earlier context into a shuffled paged cache, run one step, compare with the reference."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    free = list(range(1, num_blocks))  # block 0 stays unused, like padding
    rng.shuffle(free)  # non-contiguous, out-of-order block tables
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    (kv_cache,) = allocate_kv_cache(
        1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu"
    )
    contexts = [
        (torch.randn(s, num_kv_heads, head_dim), torch.randn(s, num_kv_heads, head_dim))
        for s in seq_lens
    ]
    # Earlier tokens were written by previous steps: put them in place directly.
    for (k_ctx, v_ctx), table, query_len, seq_len in zip(
        contexts, tables, query_lens, seq_lens, strict=True
    ):
        old = torch.arange(seq_len - query_len)
        blocks = torch.tensor(table)[old // block_size]
        kv_cache[0, blocks, old % block_size] = k_ctx[: len(old)]
        kv_cache[1, blocks, old % block_size] = v_ctx[: len(old)]
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    k = torch.cat(
        [kc[s - n :] for (kc, _), n, s in zip(contexts, query_lens, seq_lens, strict=True)]
    )
    v = torch.cat(
        [vc[s - n :] for (_, vc), n, s in zip(contexts, query_lens, seq_lens, strict=True)]
    )
    scale = head_dim**-0.5
    out = paged_attention(q, k, v, kv_cache, meta, scale)

    start = 0
    for (k_ctx, v_ctx), query_len in zip(contexts, query_lens, strict=True):
        expected = dense_reference(q[start : start + query_len], k_ctx, v_ctx, query_len, scale)
        torch.testing.assert_close(out[start : start + query_len], expected, atol=1e-5, rtol=1e-5)
        start += query_len
    return kv_cache, tables, contexts


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_decode_and_prefill_match_dense(block_size, num_heads, num_kv_heads):
    torch.manual_seed(block_size + num_heads + num_kv_heads)
    rng = random.Random(block_size * 7 + num_kv_heads)
    # 3 decodes (one new token each), then: a fresh prompt, a later chunk, a 1-token chunk.
    query_lens = [1, 1, 1, 9, 5, 1]
    seq_lens = [1, 17, 33, 9, 21, 6]
    kv_cache, tables, _ = run_step(rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads)
    # The step is read as 3 decodes followed by 3 prefill chunks, not as 6 prefills.
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
    assert meta.num_decode_seqs == 3
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 12, 17, 18]


@pytest.mark.parametrize("seed", range(5))
def test_random_shapes_match_dense(seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 4])
    num_heads = num_kv_heads * rng.choice([1, 2, 3])
    block_size = rng.choice([4, 16])
    num_decodes, num_prefills = rng.randint(0, 4), rng.randint(0, 3)
    if num_decodes + num_prefills == 0:
        num_decodes = 1
    query_lens = [1] * num_decodes + [rng.randint(1, 40) for _ in range(num_prefills)]
    seq_lens = [n + rng.choice([0, rng.randint(1, 50)]) for n in query_lens]
    run_step(rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads)


def test_only_prefill_and_only_decode_steps():
    torch.manual_seed(0)
    rng = random.Random(0)
    run_step(rng, [7], [7], 4, 4, 2)  # a whole prompt at once
    run_step(rng, [1, 1], [5, 70], 16, 4, 2)  # decodes only


def test_slot_mapping_writes_land_in_the_right_blocks():
    torch.manual_seed(0)
    rng = random.Random(1)
    block_size = 4
    query_lens, seq_lens = [1, 6], [10, 6]
    kv_cache, tables, contexts = run_step(rng, query_lens, seq_lens, block_size, 2, 2)
    # Every token of every sequence (old and new) sits at table[pos // bs], offset pos % bs.
    used = set()
    for (k_ctx, v_ctx), table, seq_len in zip(contexts, tables, seq_lens, strict=True):
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            torch.testing.assert_close(kv_cache[0, block, offset], k_ctx[pos], atol=0, rtol=0)
            torch.testing.assert_close(kv_cache[1, block, offset], v_ctx[pos], atol=0, rtol=0)
            used.add((block, offset))
    # Nothing else was written: every other slot is still zero.
    for block in range(kv_cache.shape[1]):
        for offset in range(block_size):
            if (block, offset) not in used:
                assert not kv_cache[:, block, offset].any(), (block, offset)


def test_metadata_from_lists_slots_and_decode_count():
    meta = AttentionMetadata.from_lists([1, 3], [6, 3], [[7, 2], [5]], block_size=4)
    assert meta.num_decode_seqs == 1
    # seq 0's new token is position 5 -> block 2, offset 1; seq 1's are positions 0..2 of block 5.
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 20, 21, 22]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert meta.block_tables.tolist() == [[7, 2], [5, 0]]


def test_packed_context_gather_for_flash_backend():
    """The flash backend's gather (used when block_size is not a multiple of 256) is plain torch,
    so its layout is checked here: contexts back to back, in position order."""
    from engine.executor.attention import _gather_packed_context

    torch.manual_seed(0)
    rng = random.Random(4)
    query_lens, seq_lens = [1, 1, 7], [9, 3, 20]
    kv_cache, tables, contexts = run_step(rng, query_lens, seq_lens, 4, 2, 2)
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, 4)
    keys, values = _gather_packed_context(kv_cache, meta)
    torch.testing.assert_close(keys, torch.cat([k for k, _ in contexts]), atol=0, rtol=0)
    torch.testing.assert_close(values, torch.cat([v for _, v in contexts]), atol=0, rtol=0)


def test_backend_choice_and_override(monkeypatch):
    from engine.executor.attention import attention_backend

    try:
        attention_backend.cache_clear()
        assert attention_backend("cpu", torch.float32) == "sdpa"
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "flash")
        attention_backend.cache_clear()
        with pytest.raises(ValueError, match="needs CUDA"):
            attention_backend("cpu", torch.bfloat16)
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "fast")
        attention_backend.cache_clear()
        with pytest.raises(ValueError, match="must be auto, sdpa, triton, flash"):
            attention_backend("cpu", torch.float32)
    finally:
        attention_backend.cache_clear()
