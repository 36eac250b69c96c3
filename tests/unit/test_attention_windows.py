"""Sliding-window attention and logit softcapping on the CPU backends (the SDPA reference and the C++
paged kernel) against a plain masked reference, and the C++ kernel's batch invariance with a window:
a token's output is bitwise the same alone, in a batch, prefilled whole or in chunks."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from engine.kernels import cpu_kernels
from engine.kernels.attention import (
    AttentionMetadata,
    allocate_kv_cache,
    attend_cached,
    paged_attention,
    write_kv,
)
from engine.models.decoder import layer_windows_of as layer_windows

HAVE_KERNELS = cpu_kernels.available()
needs_kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="C++ kernels not built")
CPU_BACKENDS = ["sdpa", pytest.param("cpu", marks=needs_kernels)]


def masked_reference(q, k_ctx, v_ctx, query_len, scale, window, softcap):
    """Naive attention of one sequence's last query_len positions, in float64: q [query_len, H, d],
    k_ctx/v_ctx [seq_len, KVH, d]; a query at p sees keys in (p - window, p]."""
    seq_len, num_kv_heads = k_ctx.shape[0], k_ctx.shape[1]
    group = q.shape[1] // num_kv_heads
    k = k_ctx.double().repeat_interleave(group, dim=1)
    v = v_ctx.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [H, query_len, seq_len]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


class Step:
    """A paged cache with shuffled blocks holding each sequence's context, and one step's q/k/v."""

    def __init__(self, seed, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
        (self.kv_cache,) = allocate_kv_cache(
            1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu"
        )
        self.contexts = [
            (torch.randn(s, num_kv_heads, head_dim), torch.randn(s, num_kv_heads, head_dim))
            for s in seq_lens
        ]
        for (k_ctx, v_ctx), table, n, s in zip(
            self.contexts, self.tables, query_lens, seq_lens, strict=True
        ):
            old = torch.arange(s - n)  # earlier steps wrote these
            blocks = torch.tensor(table, dtype=torch.long)[old // block_size]
            self.kv_cache[0, blocks, old % block_size] = k_ctx[: len(old)]
            self.kv_cache[1, blocks, old % block_size] = v_ctx[: len(old)]
        self.query_lens, self.seq_lens, self.block_size = query_lens, seq_lens, block_size
        self.meta = AttentionMetadata.from_lists(query_lens, seq_lens, self.tables, block_size)
        self.q = torch.randn(sum(query_lens), num_heads, head_dim) * 2  # softcap bites
        pairs = zip(self.contexts, query_lens, seq_lens, strict=True)
        news = [(kc[s - n :], vc[s - n :]) for (kc, vc), n, s in pairs]
        self.k = torch.cat([k for k, _ in news])
        self.v = torch.cat([v for _, v in news])
        self.scale = head_dim**-0.5

    def run(self, backend, window, softcap):
        self.meta.backend = backend
        return paged_attention(
            self.q,
            self.k,
            self.v,
            self.kv_cache,
            self.meta,
            self.scale,
            window=window,
            softcap=softcap,
        )

    def check(self, out, window, softcap):
        start = 0
        for (k_ctx, v_ctx), n in zip(self.contexts, self.query_lens, strict=True):
            q = self.q[start : start + n]
            expected = masked_reference(q, k_ctx, v_ctx, n, self.scale, window, softcap)
            torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
            start += n


# Windows of one token, inside a block, one block exactly, across blocks, longer than any context.
WINDOWS_AND_CAPS = [(1, None), (3, None), (8, None), (13, None), (500, None), (None, 5.0), (6, 2.0)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window,softcap", WINDOWS_AND_CAPS)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(4, 4, 4), (8, 6, 2), (16, 8, 1)])
def test_window_and_softcap_match_masked_reference(
    backend, window, softcap, block_size, num_heads, num_kv_heads
):
    # Decodes (one at position 0, others past the window), a fresh prompt, a chunk after cached
    # context (a window reaching back into the cache), a one-token chunk, a long chunk.
    query_lens = [1, 1, 1, 9, 5, 1, 30]
    seq_lens = [1, 17, 40, 9, 21, 6, 61]
    for head_dim in (64, 40):  # 64: the AVX2 float32 kernel; 40: the portable loop
        step = Step(
            window or 0, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim
        )
        step.check(step.run(backend, window, softcap), window, softcap)


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 40])
def test_windowed_token_is_bitwise_the_same_alone_batched_and_chunked(head_dim):
    """The C++ path: each token's output depends only on its own window of the context."""
    window, block_size, seq_len = 16, 8, 70
    step = Step(1, [seq_len], [seq_len], block_size, 6, 2, head_dim)
    kv_cache, table, q = step.kv_cache, step.tables[0], step.q
    write_kv(step.k, step.v, kv_cache, step.meta.slot_mapping)

    def attend(query_lens, seq_lens, tables, queries):
        meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)
        return _attend_cached(queries, kv_cache, meta, step.scale, window)

    whole = attend([seq_len], [seq_len], [table], q)
    chunks, start = [], 0
    for n in (23, 30, 17):  # chunked prefill: each chunk over the cached context before it
        chunks.append(attend([n], [start + n], [table], q[start : start + n]))
        start += n
    assert torch.equal(torch.cat(chunks), whole)
    # Every token as a decode alone, then all of them decoding side by side in one batch.
    alone = torch.cat([attend([1], [p + 1], [table], q[p : p + 1]) for p in range(seq_len)])
    assert torch.equal(alone, whole)
    batch = attend([1] * seq_len, list(range(1, seq_len + 1)), [table] * seq_len, q)
    assert torch.equal(batch, whole)
    # A prefill next to other sequences' decodes (mixed step) gives the same rows too.
    other = Step(2, [1, 1], [33, 5], block_size, 6, 2, head_dim)
    merged_tables = [[b + kv_cache.shape[1] for b in t] for t in other.tables] + [table]
    merged_cache = torch.cat([kv_cache, other.kv_cache], dim=1)
    mixed_meta = AttentionMetadata.from_lists([1, 1, 40], [33, 5, 40], merged_tables, block_size)
    mixed = _attend_cached(
        torch.cat([other.q, q[:40]]), merged_cache, mixed_meta, step.scale, window
    )
    assert torch.equal(mixed[2:], whole[:40])


def _attend_cached(q, kv_cache, meta, scale, window):
    """The step's K/V already in the cache; the C++ path, with a softcap too."""
    meta.backend = "cpu"
    return attend_cached(q, q, q, kv_cache, meta, scale, window=window, softcap=3.0)


@needs_kernels
def test_keys_before_the_window_are_never_read():
    """Blocks wholly before every query's window may be released and reused: the kernel must not
    read them (NaN there would poison the softmax even when masked)."""
    window, block_size = 8, 4
    step = Step(3, [1, 6], [30, 26], block_size, 4, 2, 64)
    expected = step.run("cpu", window, None)
    for table, n, s in zip(step.tables, step.query_lens, step.seq_lens, strict=True):
        first_needed = s - n - window + 1  # the first query's first visible key
        for block in table[: first_needed // block_size]:
            step.kv_cache[:, block] = float("nan")
    got = step.run("cpu", window, None)
    assert torch.equal(got, expected)


@needs_kernels
def test_softcap_keeps_huge_scores_finite():
    cache = torch.zeros(2, 4, 16, 1, 64)
    cache[0, 1, :5] = 1000.0
    cache[1, 1, :5] = torch.arange(5.0)[:, None, None]
    meta = AttentionMetadata.from_lists([1], [5], [[1]], 16)
    q = torch.full((1, 1, 64), 10.0)
    out = cpu_kernels.paged_decode_attention(
        q, cache, meta.block_tables, meta.seq_lens, 1.0, window=3, softcap=30.0
    )
    torch.testing.assert_close(out[0, 0], torch.full((64,), 3.0))  # equal capped scores: mean 2..4


def test_bad_window_or_softcap_is_an_error():
    step = Step(0, [1], [4], 4, 2, 2, 8)
    with pytest.raises(ValueError, match="window"):
        step.run("sdpa", 0, None)
    with pytest.raises(ValueError, match="softcap"):
        step.run("sdpa", None, -1.0)


def _tiny(cls, **kwargs):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return cls(**{**base, **kwargs})


def test_layer_windows_follow_transformers():
    assert layer_windows(_tiny(MistralConfig, sliding_window=16)) == [16] * 4
    assert layer_windows(_tiny(MistralConfig, sliding_window=None)) == [None] * 4
    # Qwen2: only with use_sliding_window, and only layers from max_window_layers on.
    qwen = _tiny(Qwen2Config, sliding_window=16, use_sliding_window=True, max_window_layers=1)
    assert layer_windows(qwen) == [None, 16, 16, 16]
    assert layer_windows(_tiny(Qwen2Config, sliding_window=16)) == [None] * 4  # off by default
    # Any other Llama-family config that sets a window slides everywhere.
    assert layer_windows(_tiny(LlamaConfig, sliding_window=24)) == [24] * 4
    assert layer_windows(_tiny(LlamaConfig)) == [None] * 4
    # A window as long as the positions never drops a key: full attention.
    assert layer_windows(_tiny(MistralConfig, sliding_window=256)) == [None] * 4


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_window_and_softcap_match_float32(dtype):
    """The portable kernel (any dtype) windows and caps like the float32 one."""
    step = Step(4, [1, 1, 12], [9, 50, 40], 8, 6, 2, 64)
    write_kv(step.k, step.v, step.kv_cache, step.meta.slot_mapping)
    step.meta.backend = "cpu"
    ref = attend_cached(
        step.q, step.k, step.v, step.kv_cache, step.meta, 0.125, window=10, softcap=4.0
    )
    low = attend_cached(
        step.q.to(dtype),
        step.k,
        step.v,
        step.kv_cache.to(dtype),
        step.meta,
        0.125,
        window=10,
        softcap=4.0,
    )
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), ref, atol=3e-2, rtol=3e-2)
