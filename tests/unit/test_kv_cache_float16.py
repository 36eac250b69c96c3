"""A float16 KV cache under float32 queries (`--kv-cache-dtype float16`, the CPU default under
block-quantized weights): every C++ attention path widens it on load, exactly, so each gives bitwise
what it gives over a float32 cache holding the same (rounded) values; the cache write rounds as
torch's `.to(float16)`; the torch SDPA fallback reads it too; and `auto` resolves as documented."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu_kernels
from engine.kernels.attention import AttentionMetadata, paged_attention
from engine.kernels.kv_dtype import bf16_attention_runs, kernels_read, resolve_kv_cache_dtype
from tests.unit.test_prefill_kernel import both, random_step

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _half_and_float(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache in float16, and the same values widened into a float32 cache."""
    half = cache.to(torch.float16)
    return half, half.float()


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 128, 16])  # 16: not a multiple of 32 (portable loops)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4)])
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (100, 50.0)])
def test_decode_and_prefill_over_float16_are_bitwise_the_widened_float32_cache(
    head_dim, heads, kv_heads, window, softcap
):
    rng = random.Random(head_dim * 31 + heads + (window or 0))
    torch.manual_seed(rng.randrange(1 << 30))
    query_lens = [1, 1, 200, 7, 17, 64, 9]  # decodes, then chunks after cached context
    cached = [5, 130, 0, 0, 33, 129, 250]
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    cache, meta = random_step(rng, query_lens, seq_lens, 16, kv_heads, head_dim)
    half, widened = _half_and_float(cache)
    q = torch.randn(sum(query_lens), heads, head_dim)
    fast16, slow16 = both(q, half, meta, head_dim**-0.5, window, softcap)
    fast32, slow32 = both(q, widened, meta, head_dim**-0.5, window, softcap)
    assert torch.equal(fast16, fast32)  # the prefill kernel
    assert torch.equal(slow16, slow32)  # the decode kernel per token
    assert torch.equal(fast16, slow16)  # and the two agree, as over float32


@needs_kernels
@pytest.mark.parametrize("window,softcap", [(None, None), (700, 30.0)])
def test_long_contexts_split_over_threads_read_float16_alike(window, softcap):
    """A lone long sequence, its attention split over the threads (the split path, forced on) or
    not: the same bits over float16 as over the widened float32 cache, and as the same sequence in
    a batch."""
    rng = random.Random(7)
    torch.manual_seed(7)
    seq_lens = [2049, 1500, 9, 1100]
    cache, meta = random_step(rng, [1] * len(seq_lens), seq_lens, 16, 3, 64)
    half, widened = _half_and_float(cache)
    q = torch.randn(len(seq_lens), 9, 64)
    tables, lens = meta.token_context()
    together = cpu_kernels.paged_decode_attention(q, half, tables, lens, 0.125, window, softcap)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    mode = torch.ops.kvserve.decode_split_select(1)
    try:
        for split in (1, 0):
            torch.ops.kvserve.decode_split_select(split)
            for i in range(len(seq_lens)):
                args = (tables[i : i + 1], lens[i : i + 1], 0.125, window, softcap)
                alone16 = cpu_kernels.paged_decode_attention(q[i : i + 1], half, *args)
                alone32 = cpu_kernels.paged_decode_attention(q[i : i + 1], widened, *args)
                assert torch.equal(alone16, alone32), (split, seq_lens[i])
                assert torch.equal(alone16[0], together[i]), (split, seq_lens[i])
    finally:
        torch.ops.kvserve.decode_split_select(mode)
        torch.set_num_threads(threads)


def assert_rope_write_rounds_as_torch(dtype: torch.dtype) -> None:
    """The C++ rotary + cache write into a `dtype` cache under float32 queries: q and k rotate in
    float32 whatever the cache, and the cache holds the float32 cache's values rounded as torch's
    `.to(dtype)`."""
    torch.manual_seed(3)
    n, heads, kv_heads, d, block_size = 21, 4, 2, 64, 8
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d) * 300  # some values beyond 16 bits' precision
    cos, sin = torch.randn(n, d // 2), torch.randn(n, d // 2)
    slots = torch.randperm(5 * block_size)[:n].long()
    caches = {}
    for kind in (torch.float32, dtype):
        cache = torch.zeros(2, 5, block_size, kv_heads, d, dtype=kind)
        x = qkv.clone()
        cpu_kernels.rope_write_kv(x, cos, sin, cache, slots, heads, kv_heads)
        caches[kind] = (cache, x)
    (c32, x32), (c16, x16) = caches[torch.float32], caches[dtype]
    assert torch.equal(x16, x32)
    assert torch.equal(c16, c32.to(dtype))


@needs_kernels
def test_rope_write_rounds_into_float16_as_torch_does():
    assert_rope_write_rounds_as_torch(torch.float16)


@needs_kernels
def test_the_cpu_backend_and_the_torch_fallback_read_float16_alike():
    """Through paged_attention: the C++ backend over a float16 cache matches the torch SDPA path over
    the same cache (which widens what it gathers), and a prompt in two chunks equals decoding its
    last token alone."""
    torch.manual_seed(9)
    n, heads, kv_heads, d, block_size = 150, 6, 2, 64, 16
    table = list(range(1, 11))[::-1]
    q = torch.randn(n, heads, d)
    k, v = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    outs = {}
    for backend in ("cpu", "sdpa"):
        cache = torch.zeros(2, 12, block_size, kv_heads, d, dtype=torch.float16)

        def step(lo: int, hi: int, cache=cache, backend=backend) -> torch.Tensor:
            meta = AttentionMetadata.from_lists([hi - lo], [hi], [table], block_size)
            meta.backend = backend
            return paged_attention(q[lo:hi], k[lo:hi], v[lo:hi], cache, meta, d**-0.5)

        whole = step(0, n)
        chunked = torch.cat([step(0, 70), step(70, n)])  # rewrites the same slots
        outs[backend] = (whole, chunked, step(n - 1, n))
    whole, chunked, last = outs["cpu"]
    assert torch.equal(whole, chunked) and torch.equal(last[0], whole[-1])
    for got in outs["sdpa"]:  # SDPA's own arithmetic: close, not bitwise
        torch.testing.assert_close(got[-1:], whole[-1:], rtol=1e-4, atol=1e-5)
    # The fresh K/V are not used as they are: SDPA's first chunk reads the rounded cache too.
    torch.testing.assert_close(outs["sdpa"][0], whole, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_mismatched_dtypes_are_clear_errors():
    rng = random.Random(1)
    cache, meta = random_step(rng, [1], [10], 16, 2, 64)
    with pytest.raises(RuntimeError, match="or bfloat16 under float32 queries"):
        cpu_kernels.paged_decode_attention(
            torch.randn(1, 4, 64, dtype=torch.bfloat16), cache.half(), meta.block_tables,
            meta.seq_lens, 0.125,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="or bfloat16 under float32 queries"):
        cpu_kernels.paged_decode_attention(
            torch.randn(1, 4, 64, dtype=torch.float16), cache.bfloat16(), meta.block_tables,
            meta.seq_lens, 0.125,
        )  # fmt: skip


def test_auto_is_16_bits_on_cpu_under_block_weights_else_the_model_dtype():
    # bfloat16 where the C++ kernels' AVX-512 BF16 attention runs, else float16
    sixteen = torch.bfloat16 if bf16_attention_runs() else torch.float16
    assert resolve_kv_cache_dtype("auto", CPU, torch.float32, "gguf") == sixteen
    assert resolve_kv_cache_dtype("auto", CPU, torch.float32, "int8") == sixteen
    assert resolve_kv_cache_dtype("auto", CPU, torch.float32, "int8", "sdpa") == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", CPU, torch.float32, None) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", CPU, torch.float32, None) == torch.float32
    assert resolve_kv_cache_dtype("auto", CPU, torch.bfloat16, None) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", CUDA, torch.bfloat16, None) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", CPU, torch.float32, "gguf") == torch.float32
    assert resolve_kv_cache_dtype("float16", CPU, torch.float32, None) == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", CUDA, torch.bfloat16, None) == torch.bfloat16
    for requested, device, dtype in (
        ("float16", CUDA, torch.float32),
        ("float32", CPU, torch.bfloat16),
        ("bfloat16", CUDA, torch.float32),
        ("float16", CPU, torch.bfloat16),
    ):
        with pytest.raises(ValueError, match="KV cache holds the model's dtype"):
            resolve_kv_cache_dtype(requested, device, dtype, None)
    # The Triton and flash-attn kernels read the model's dtype only
    assert resolve_kv_cache_dtype("auto", CPU, torch.float32, "int8", "triton") == torch.float32
    with pytest.raises(ValueError, match="KV cache holds the model's dtype"):
        resolve_kv_cache_dtype("float16", CPU, torch.float32, None, "triton")
    assert resolve_kv_cache_dtype("float16", CPU, torch.float32, None, "sdpa") == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        resolve_kv_cache_dtype("fp8", CPU, torch.float32, None)
    assert kernels_read(torch.float16, torch.float32)
    assert not kernels_read(torch.float16, torch.bfloat16)
