"""paged_attention against a dense causal reference: mixed decode + prefill, GQA, block sizes."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.kernels.attention import AttentionMetadata, allocate_kv_cache, paged_attention

# "cpu" is the C++ decode kernel reading the paged cache in place; "sdpa" the pure-torch fallback.
CPU_BACKENDS = [
    "sdpa",
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built"),
    ),
]


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


def run_step(
    rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim=8, backend="sdpa"
):
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
    meta.backend = backend
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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_decode_and_prefill_match_dense(block_size, num_heads, num_kv_heads, backend):
    torch.manual_seed(block_size + num_heads + num_kv_heads)
    rng = random.Random(block_size * 7 + num_kv_heads)
    # 3 decodes (one new token each), then: a fresh prompt, a later chunk, a 1-token chunk.
    query_lens = [1, 1, 1, 9, 5, 1]
    seq_lens = [1, 17, 33, 9, 21, 6]
    kv_cache, tables, _ = run_step(
        rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads, backend=backend
    )
    # The step is read as 3 decodes followed by 3 prefill chunks, not as 6 prefills.
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
    assert meta.num_decode_seqs == 3
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 12, 17, 18]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("seed", range(5))
def test_random_shapes_match_dense(seed, backend):
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
    head_dim = rng.choice([8, 64, 72])  # 72: the kernel's vector loop plus a tail
    run_step(rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_only_prefill_and_only_decode_steps(backend):
    torch.manual_seed(0)
    rng = random.Random(0)
    run_step(rng, [7], [7], 4, 4, 2, backend=backend)  # a whole prompt at once
    run_step(rng, [1, 1], [5, 70], 16, 4, 2, backend=backend)  # decodes only


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_decode_kernel_half_precision_matches_float32(dtype):
    """The kernel accumulates in float32 whatever the cache dtype: only the inputs' rounding differs."""
    torch.manual_seed(3)
    block_size, num_blocks = 16, 12
    cache = torch.randn(2, num_blocks, block_size, 2, 64)
    tables = torch.tensor([[3, 7, 1, 0], [2, 5, 9, 11]], dtype=torch.int32)
    lens = torch.tensor([40, 61], dtype=torch.int32)
    q = torch.randn(2, 6, 64)
    ref = cpu_kernels.paged_decode_attention(q, cache, tables, lens, 0.125)
    low = cpu_kernels.paged_decode_attention(q.to(dtype), cache.to(dtype), tables, lens, 0.125)
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
def test_cpu_decode_kernel_is_batch_invariant():
    """A sequence's output is bitwise the same alone and next to others of other lengths."""
    torch.manual_seed(5)
    cache = torch.randn(2, 40, 16, 3, 64)
    tables = torch.randperm(39, dtype=torch.int32).add(1).view(3, 13)
    lens = torch.tensor([200, 17, 131], dtype=torch.int32)
    q = torch.randn(3, 9, 64)
    batch = cpu_kernels.paged_decode_attention(q, cache, tables, lens, 0.125)
    for i in range(3):
        alone = cpu_kernels.paged_decode_attention(
            q[i : i + 1], cache, tables[i : i + 1], lens[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], batch[i])


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
    from engine.kernels.flash_attention import _gather_packed_context

    torch.manual_seed(0)
    rng = random.Random(4)
    query_lens, seq_lens = [1, 1, 7], [9, 3, 20]
    kv_cache, tables, contexts = run_step(rng, query_lens, seq_lens, 4, 2, 2)
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, 4)
    keys, values = _gather_packed_context(kv_cache, meta)
    torch.testing.assert_close(keys, torch.cat([k for k, _ in contexts]), atol=0, rtol=0)
    torch.testing.assert_close(values, torch.cat([v for _, v in contexts]), atol=0, rtol=0)


def test_backend_choice_and_override(monkeypatch):
    from engine.kernels.attention import attention_backend

    try:
        attention_backend.cache_clear()
        expected = "cpu" if cpu_kernels.available() else "sdpa"
        assert attention_backend("cpu", torch.float32) == expected
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "sdpa")  # the pure-torch path on demand
        attention_backend.cache_clear()
        assert attention_backend("cpu", torch.float32) == "sdpa"
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "flash")
        attention_backend.cache_clear()
        with pytest.raises(ValueError, match="needs CUDA"):
            attention_backend("cpu", torch.bfloat16)
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "fast")
        attention_backend.cache_clear()
        with pytest.raises(ValueError, match="must be auto, sdpa, triton, flash, cpu"):
            attention_backend("cpu", torch.float32)
    finally:
        attention_backend.cache_clear()


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_kv_write_equal_the_torch_ops(dtype):
    """Rotary inside the fused qkv and the cache write: bitwise what apply_rotary + write_kv give."""
    from engine.kernels.attention import write_kv
    from engine.models.rotary import apply_rotary

    torch.manual_seed(7)
    n, heads, kv_heads, d = 5, 6, 2, 16
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d).to(dtype)
    angles = torch.rand(n, d // 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([3, 17, 4, 30, 9])
    cache = torch.zeros(2, 8, 4, kv_heads, d, dtype=dtype)
    expected_cache = cache.clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
    rotated = apply_rotary(qk, cos[:, None], sin[:, None])
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    write_kv(rotated[:, heads:], v, expected_cache, slots)

    cpu_kernels.rope_write_kv(qkv, cos, sin, cache, slots, heads, kv_heads)
    assert torch.equal(qkv[:, : (heads + kv_heads) * d].view_as(rotated), rotated)
    assert torch.equal(cache, expected_cache)


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_the_module(dtype):
    from engine.models.layers import RMSNorm

    torch.manual_seed(8)
    norm = RMSNorm(72, 1e-5, dtype, torch.device("cpu"))
    norm.weight.data.copy_(torch.randn(72))
    x = (torch.randn(9, 72) * 3).to(dtype)
    expected = norm(x)
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # rows are independent: a row normalizes the same alone
    assert torch.equal(cpu_kernels.rms_norm(x[3:4], norm.weight, 1e-5)[0], got[3])


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("head_dim", [16, 64])
def test_cpu_backend_prefill_is_bitwise_the_same_however_it_is_chunked(head_dim):
    """Each query attends over its own causal context with one kernel: a prompt prefilled whole,
    in chunks after cached context, or as decode steps gives bitwise the same outputs per token."""
    torch.manual_seed(11)
    block_size, n, heads, kv_heads = 4, 23, 6, 2
    table = [5, 2, 7, 0, 3, 6]
    (cache,) = allocate_kv_cache(1, 8, block_size, kv_heads, head_dim, torch.float32, "cpu")
    q = torch.randn(n, heads, head_dim)
    k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)

    def step(lo: int, hi: int) -> torch.Tensor:  # tokens lo..hi-1 of the prompt in one step
        meta = AttentionMetadata.from_lists([hi - lo], [hi], [table], block_size)
        meta.backend = "cpu"
        return paged_attention(q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, head_dim**-0.5)

    whole = step(0, n)
    chunked = torch.cat([step(0, 9), step(9, 10), step(10, 22), step(22, 23)])
    assert torch.equal(chunked, whole)
    expected = dense_reference(q, k, v, n, head_dim**-0.5)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
