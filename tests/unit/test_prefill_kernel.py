"""The C++ prefill attention kernel (csrc/paged_prefill.cpp) against the decode kernel run per token:
bitwise the same for every query token, over chunk lengths, GQA ratios, head dims, sliding windows,
softcaps, shuffled block tables and prefix-hit offsets, in mixed decode + prefill steps; and the
decode kernel's split path over long contexts against its per-item path."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.kernels.attention import AttentionMetadata, allocate_kv_cache, paged_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


def random_step(rng, query_lens, seq_lens, block_size, kv_heads, head_dim, dtype=torch.float32):
    """A filled cache with shuffled, non-contiguous block tables and the step's metadata."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    (cache,) = allocate_kv_cache(1, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu")
    cache.copy_(torch.randn(cache.shape).to(dtype))
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
    return cache, meta


def both(q, cache, meta, scale, window=None, softcap=None):
    """(prefill kernel, decode kernel per token) on the same step."""
    fast = cpu_kernels.paged_prefill_attention(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window, softcap
    )
    tables, lens = meta.token_context()
    slow = cpu_kernels.paged_decode_attention(q, cache, tables, lens, scale, window, softcap)
    return fast, slow


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (None, 30.0), (100, 50.0)])
def test_prefill_kernel_is_bitwise_the_decode_kernel(head_dim, heads, kv_heads, window, softcap):
    rng = random.Random(head_dim * 100 + heads * 10 + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    # decodes first, then chunks: whole prompts, chunks after cached context (prefix hits),
    # lengths around the 8-token runs, the 16-row blocks and the 64-key tiles
    query_lens = [1, 1, 1, 200, 7, 17, 64, 1 + rng.randrange(90), 9]
    cached = [5, 130, 63, 0, 0, 33, 129, rng.randrange(300), 250]
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    block_size = rng.choice([4, 16])
    cache, meta = random_step(rng, query_lens, seq_lens, block_size, kv_heads, head_dim)
    q = torch.randn(sum(query_lens), heads, head_dim)
    fast, slow = both(q, cache, meta, head_dim**-0.5, window, softcap)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("query_len", [1, 2, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 100, 257])
def test_every_chunk_length_after_every_prefix_offset(query_len):
    """A chunk of each length after prefix hits of several offsets, with and without a window."""
    rng = random.Random(query_len)
    torch.manual_seed(query_len)
    for cached in (0, 1, 8, 13, 64, 70):
        for window in (None, 9, 64):
            cache, meta = random_step(rng, [query_len], [cached + query_len], 16, 2, 64)
            q = torch.randn(query_len, 6, 64)
            fast, slow = both(q, cache, meta, 0.125, window)
            assert torch.equal(fast, slow), (cached, window)


def test_strided_queries_from_a_fused_qkv_view():
    """q as the model passes it: a view into the fused qkv rows (row stride > heads * d)."""
    rng = random.Random(3)
    torch.manual_seed(3)
    cache, meta = random_step(rng, [1, 40], [20, 90], 16, 2, 64)
    qkv = torch.randn(41, (4 + 2 * 2) * 64)
    q = qkv[:, : 4 * 64].view(41, 4, 64)
    fast, slow = both(q, cache, meta, 0.125)
    assert torch.equal(fast, slow)
    assert torch.equal(fast, both(q.contiguous(), cache, meta, 0.125)[0])


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float32, 16)])
def test_other_dtypes_and_head_dims_run_the_decode_kernel_per_token(dtype, head_dim):
    rng = random.Random(5)
    torch.manual_seed(5)
    cache, meta = random_step(rng, [1, 30, 12], [9, 30, 50], 4, 2, head_dim, dtype)
    q = torch.randn(43, 4, head_dim).to(dtype)
    fast, slow = both(q, cache, meta, 0.25, 20, 10.0)
    assert torch.equal(fast, slow)


def test_thread_count_does_not_change_a_bit():
    rng = random.Random(8)
    torch.manual_seed(8)
    cache, meta = random_step(rng, [1, 150, 33], [70, 300, 33], 16, 3, 64)
    q = torch.randn(184, 9, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = both(q, cache, meta, 0.125)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, both(q, cache, meta, 0.125)[0])


def test_paged_attention_cpu_backend_matches_a_dense_reference_and_decoding():
    """Through the backend: a 300-token prompt in two chunks equals decoding its last token alone,
    and is close to float64 dense causal attention."""
    torch.manual_seed(9)
    n, heads, kv_heads, d, block_size = 300, 8, 2, 64, 16
    table = list(range(1, 20))[::-1]
    (cache,) = allocate_kv_cache(1, 21, block_size, kv_heads, d, torch.float32, "cpu")
    q = torch.randn(n, heads, d)
    k, v = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)

    def step(lo: int, hi: int) -> torch.Tensor:
        meta = AttentionMetadata.from_lists([hi - lo], [hi], [table], block_size)
        meta.backend = "cpu"
        return paged_attention(q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, d**-0.5)

    chunked = torch.cat([step(0, 130), step(130, n)])
    assert torch.equal(step(n - 1, n)[0], chunked[-1])
    kk = k.double().repeat_interleave(heads // kv_heads, 1)
    vv = v.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(chunked.double(), dense, atol=2e-5, rtol=2e-5)


def test_bad_arguments_are_clear_errors():
    rng = random.Random(1)
    cache, meta = random_step(rng, [10], [10], 16, 2, 64)
    q = torch.randn(10, 4, 64)
    bad_starts = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query_start_loc must cover every token"):
        cpu_kernels.paged_prefill_attention(
            q, cache, meta.block_tables, bad_starts, meta.seq_lens, 0.125
        )
    with pytest.raises(RuntimeError, match="exceed its context"):
        cpu_kernels.paged_prefill_attention(
            q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens - 5, 0.125
        )


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 64), (6, 2, 64)]
)
@pytest.mark.parametrize("window,softcap", [(None, None), (700, None), (300, 30.0), (None, 50.0)])
def test_a_long_context_decodes_bitwise_alone_as_in_a_batch(
    heads, kv_heads, head_dim, window, softcap
):
    """A few sequences over long contexts split their attention's phases over the threads (key
    tiles, then softmaxes, then P.V per 32 values): the same bits as the per-item path a larger
    batch takes, and as the prefill kernel gives the same token."""
    rng = random.Random(heads * 1000 + (window or 0) + int(softcap or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    seq_lens = [2049, 513, 1500, 700, 9, 1100]  # around the 256-key tiles and the 8-token runs
    cache, meta = random_step(rng, [1] * len(seq_lens), seq_lens, 16, kv_heads, head_dim)
    q = torch.randn(len(seq_lens), heads, head_dim)
    scale = head_dim**-0.5
    tables, lens = meta.token_context()
    together = cpu_kernels.paged_decode_attention(q, cache, tables, lens, scale, window, softcap)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # the split path runs below 2 (sequence, KV head) items per thread
    # on (it is off by default: slower than the per-item path where measured)
    mode = torch.ops.kvserve.decode_split_select(1)
    try:
        for i in range(len(seq_lens)):  # each alone (batch 1): the split path where it is long
            alone = cpu_kernels.paged_decode_attention(
                q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], scale, window, softcap
            )
            assert torch.equal(alone[0], together[i]), seq_lens[i]
        pair = cpu_kernels.paged_decode_attention(
            q[:2], cache, tables[:2], lens[:2], scale, window, softcap
        )
        torch.ops.kvserve.decode_split_select(0)  # and the per-item path for each alone
        for i in range(len(seq_lens)):
            alone = cpu_kernels.paged_decode_attention(
                q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], scale, window, softcap
            )
            assert torch.equal(alone[0], together[i]), seq_lens[i]
    finally:
        torch.ops.kvserve.decode_split_select(mode)
        torch.set_num_threads(threads)
    assert torch.equal(pair, together[:2])
    fast = cpu_kernels.paged_prefill_attention(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window, softcap
    )
    assert torch.equal(fast, together)
    ref = []  # and close to a float64 softmax(q k) v
    for i, n in enumerate(seq_lens):
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        blocks = meta.block_tables[i][pos // 16].long()
        k = cache[0][blocks, pos % 16].double()  # [len, kv_heads, d]
        v = cache[1][blocks, pos % 16].double()
        qi = q[i].double().view(kv_heads, heads // kv_heads, head_dim) * scale
        s = torch.einsum("hgd,thd->hgt", qi, k)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        ref.append(torch.einsum("hgt,thd->hgd", s.softmax(-1), v).reshape(heads, head_dim))
    torch.testing.assert_close(together.double(), torch.stack(ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4), (6, 2), (7, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (600, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_context_decode_split_over_the_threads_is_bitwise_per_item(
    head_dim, heads, kv_heads, window, softcap, dtype
):
    """From 512 keys the decode kernel splits each sequence's scores, softmax and P.V over the
    threads (key tiles of 512, lengths around them and the 8-token runs): bitwise its per-item
    path, alone or in a batch, whatever the thread count."""
    rng = random.Random(heads * 1000 + head_dim + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    seq_lens = [1100, 5, 513, 1029, 40, 512, 777]
    cache, meta = random_step(rng, [1] * len(seq_lens), seq_lens, 16, kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), heads, head_dim)
    tables, lens = meta.token_context()
    scale = head_dim**-0.5
    saved_threads, mode = torch.get_num_threads(), torch.ops.kvserve.decode_split_select(0)
    try:
        per_item = cpu_kernels.paged_decode_attention(
            q, cache, tables, lens, scale, window, softcap
        )
        torch.ops.kvserve.decode_split_select(1)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            split = cpu_kernels.paged_decode_attention(
                q, cache, tables, lens, scale, window, softcap
            )
            assert torch.equal(split, per_item), threads
            for i in (0, 2, 6):
                args = (tables[i : i + 1], lens[i : i + 1], scale, window, softcap)
                alone = cpu_kernels.paged_decode_attention(q[i : i + 1], cache, *args)
                assert torch.equal(alone[0], per_item[i]), (threads, seq_lens[i])
    finally:
        torch.ops.kvserve.decode_split_select(mode)
        torch.set_num_threads(saved_threads)
