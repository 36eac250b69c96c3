"""A bfloat16 KV cache under float32 queries (`--kv-cache-dtype bfloat16`, the CPU default under
block-quantized weights where AVX-512 BF16 runs): the dot products in bf16 arithmetic
(csrc/attention_bf16.h). Every kernel rounds alike (prefill = decode per token, split = per item,
alone = in a batch), the hardware kernels give the emulated kernels' bits, the result stays close to
float32 arithmetic over the same cache, and the cache write rounds as torch's `.to(bfloat16)`."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu_kernels
from tests.unit.test_kv_cache_float16 import assert_rope_write_rounds_as_torch
from tests.unit.test_prefill_kernel import both, random_step

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


def _paths() -> list[int]:
    """The bf16 paths this machine runs: 0 emulated (AVX2), 1 the hardware's where it runs."""
    return [0, 1] if torch.ops.kvserve.attention_bf16_probe() == "" else [0]


class _path:
    def __init__(self, mode: int):
        self.mode = mode

    def __enter__(self):
        self.saved = torch.ops.kvserve.attention_bf16_select(self.mode)

    def __exit__(self, *exc):
        torch.ops.kvserve.attention_bf16_select(self.saved)


def _step(seed: int, heads: int, kv_heads: int, head_dim: int):
    rng = random.Random(seed)
    torch.manual_seed(rng.randrange(1 << 30))
    # decodes, whole prompts, chunks after cached context; odd and even lengths (the last pair of
    # keys), runs of 8, 16-row blocks and 64-key tiles
    query_lens = [1, 1, 1, 200, 7, 17, 64, 1 + rng.randrange(90), 9, 2]
    cached = [5, 130, 0, 0, 0, 33, 129, rng.randrange(300), 250, 61]
    seq_lens = [c + n for c, n in zip(cached, query_lens, strict=True)]
    cache, meta = random_step(rng, query_lens, seq_lens, rng.choice([4, 16]), kv_heads, head_dim)
    q = torch.randn(sum(query_lens), heads, head_dim)
    return q, cache.to(torch.bfloat16), meta


def cpu_kernels_have_avx2() -> bool:
    return not torch.ops.kvserve.attention_bf16_path().startswith("portable")


def test_the_path_is_reported():
    path = torch.ops.kvserve.attention_bf16_path()
    assert path.startswith(("avx512bf16", "emulated", "portable")), path
    with _path(0):
        assert not torch.ops.kvserve.attention_bf16_path().startswith("avx512bf16")
    with pytest.raises(RuntimeError, match="mode must be 0 or 1"):
        torch.ops.kvserve.attention_bf16_select(2)


# 16: the portable loops (float32 arithmetic); 32 and 256: one and eight 16x16 transposes of a
# key block where AVX-512 BF16 runs (the prefill scores from transposed key tiles)
@pytest.mark.parametrize("head_dim", [64, 128, 16, 32, 256])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (4, 4), (6, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (100, 50.0)])
def test_prefill_is_bitwise_decode_on_every_path_and_the_paths_agree(
    head_dim, heads, kv_heads, window, softcap
):
    q, cache, meta = _step(head_dim * 31 + heads + (window or 0), heads, kv_heads, head_dim)
    results = []
    for mode in _paths():
        with _path(mode):
            fast, slow = both(q, cache, meta, head_dim**-0.5, window, softcap)
        assert torch.equal(fast, slow), mode  # a token's bits: prefilled or decoded alone
        results.append(fast)
    for other in results[1:]:
        assert torch.equal(other, results[0])  # hardware = emulation
    # float32 arithmetic over the same (widened) cache: close, and not the same bits where the
    # bf16 kernels ran (head_dim % 32 == 0)
    reference, _ = both(q, cache.float(), meta, head_dim**-0.5, window, softcap)
    torch.testing.assert_close(results[0], reference, rtol=3e-2, atol=3e-2)
    if head_dim % 32 == 0 and cpu_kernels_have_avx2():
        assert not torch.equal(results[0], reference)
    else:
        assert torch.equal(results[0], reference)


@pytest.mark.parametrize("window,softcap", [(None, None), (700, 30.0)])
def test_long_contexts_split_over_threads_alike(window, softcap):
    """A lone long sequence, its attention split over the threads or not, alone or in a batch, on
    each path: the same bits."""
    rng = random.Random(11)
    torch.manual_seed(11)
    seq_lens = [2049, 1500, 9, 1101]
    cache, meta = random_step(rng, [1] * len(seq_lens), seq_lens, 16, 3, 64)
    cache = cache.to(torch.bfloat16)
    q = torch.randn(len(seq_lens), 9, 64)
    tables, lens = meta.token_context()
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    split = torch.ops.kvserve.decode_split_select(1)
    try:
        results = []
        for mode in _paths():
            with _path(mode):
                together = cpu_kernels.paged_decode_attention(
                    q, cache, tables, lens, 0.125, window, softcap
                )
                for s in (1, 0):
                    torch.ops.kvserve.decode_split_select(s)
                    for i in range(len(seq_lens)):
                        args = (tables[i : i + 1], lens[i : i + 1], 0.125, window, softcap)
                        alone = cpu_kernels.paged_decode_attention(q[i : i + 1], cache, *args)
                        assert torch.equal(alone[0], together[i]), (mode, s, seq_lens[i])
            results.append(together)
        for other in results[1:]:
            assert torch.equal(other, results[0])
    finally:
        torch.ops.kvserve.decode_split_select(split)
        torch.set_num_threads(threads)


def test_tiny_values_and_a_zero_context_tail_round_alike():
    """Denormal-range keys, values and probabilities (flushed to zero by the hardware's dot
    product; the emulation flushes them alike) and values of both signs: the paths agree."""
    rng = random.Random(5)
    torch.manual_seed(5)
    query_lens, seq_lens = [1, 33, 1], [77, 33, 3]
    cache, meta = random_step(rng, query_lens, seq_lens, 16, 1, 64)
    tiny = cache * 1e-38  # below float32's normal range after the products
    tiny[:, :, ::3] = cache[:, :, ::3] * 40  # large scores: probabilities far below 1e-38 too
    cache = tiny.to(torch.bfloat16)
    q = torch.randn(sum(query_lens), 2, 64) * 30
    results = []
    for mode in _paths():
        with _path(mode):
            fast, slow = both(q, cache, meta, 0.125)
        assert torch.equal(fast, slow)
        results.append(fast)
    for other in results[1:]:
        assert torch.equal(other.view(torch.int32), results[0].view(torch.int32))


def test_rope_write_rounds_into_bfloat16_as_torch_does():
    assert_rope_write_rounds_as_torch(torch.bfloat16)
