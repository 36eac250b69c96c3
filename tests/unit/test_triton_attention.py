"""The Triton paged-attention kernels against the torch SDPA reference: shuffled block tables, odd
lengths, GQA ratios, several block sizes, decode (with and without split-K) and prefill chunks over
cached context. On CPU they run under Triton's interpreter (TRITON_INTERPRET=1), so shapes stay small;
on a CUDA machine the same tests run the compiled kernels."""

from __future__ import annotations

import os
import random

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:  # must be set before triton is first imported (it fixes how kernels are built)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine.kernels import cpu_kernels, triton_attention  # noqa: E402
from engine.kernels.attention import (  # noqa: E402
    AttentionMetadata,
    allocate_kv_cache,
    attention_backend,
    paged_attention,
    write_kv,
)
from engine.kernels.sdpa_attention import sdpa_decode  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"


def _step(rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype):
    """A paged cache whose blocks are shuffled (out of order, not contiguous) and filled with the
    sequences' earlier context, plus this step's q/k/v."""
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    (kv_cache,) = allocate_kv_cache(
        1, num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE
    )
    kv_cache.normal_()  # stale data everywhere: a kernel reading past a context would show
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size, DEVICE)
    num_tokens = sum(query_lens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(num_tokens, heads, head_dim, device=DEVICE).to(dtype)

    return kv_cache, meta, rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)


def _check(
    query_lens,
    seq_lens,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim=16,
    seed=0,
    dtype=torch.float32,
    num_splits=None,
    window=None,
    softcap=None,
):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kv_cache, meta, q, k, v = _step(
        rng, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype
    )
    scale = head_dim**-0.5
    # Reference: the SDPA backend in float32 over a float32 copy of the same cache.
    ref_cache = kv_cache.float()
    meta.backend = "sdpa"
    expected = paged_attention(
        q.float(), k.float(), v.float(), ref_cache, meta, scale, window=window, softcap=softcap
    )
    meta.backend = None
    write_kv(k, v, kv_cache, meta.slot_mapping)  # what paged_attention does before attending
    got = triton_attention.paged_attention_triton(
        q, kv_cache, meta, scale, num_splits=num_splits, window=window, softcap=softcap
    )
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    return meta


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
def test_decode_and_prefill_with_context(block_size, num_heads, num_kv_heads):
    # Decodes of odd lengths (one a single token), then a fresh prompt, a chunk after cached context
    # and a one-token chunk (a prefill, not a decode, since it follows the first prefill).
    query_lens = [1, 1, 1, 13, 7, 1]
    seq_lens = [1, 19, 70, 13, 45, 6]
    _check(query_lens, seq_lens, block_size, num_heads, num_kv_heads, seed=block_size + num_heads)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_decode_matches_one_pass(num_splits):
    # Splits longer and shorter than the context, some empty (8 splits over a 5-token context).
    _check([1, 1, 1], [5, 130, 257], 16, 6, 2, num_splits=num_splits, seed=num_splits)


def test_long_prefill_chunk_spans_several_query_tiles():
    # 80 new tokens after 50 cached ones: several programs along the query axis.
    _check([80], [130], 8, 4, 2, head_dim=8, seed=3)


@pytest.mark.parametrize("seed", range(4))
def test_random_steps(seed):
    rng = random.Random(100 + seed)
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 2, 3, 5])
    num_decodes, num_prefills = rng.randint(0, 4), rng.randint(0, 2)
    if num_decodes + num_prefills == 0:
        num_decodes = 1
    query_lens = [1] * num_decodes + [rng.randint(2, 30) for _ in range(num_prefills)]
    seq_lens = [n + rng.choice([0, rng.randint(1, 90)]) for n in query_lens]
    seq_lens[:num_decodes] = [max(1, s) for s in seq_lens[:num_decodes]]
    _check(
        query_lens,
        seq_lens,
        rng.choice([2, 8, 16]),
        num_heads,
        num_kv_heads,
        head_dim=rng.choice([8, 24, 32]),
        seed=seed,
        num_splits=rng.choice([None, 2, 4]),
    )


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (16, None), (300, None),
                                            (None, 4.0), (7, 2.0)])  # fmt: skip
@pytest.mark.parametrize("num_splits", [None, 3])
def test_sliding_window_and_softcap(window, softcap, num_splits):
    # Decodes shorter and longer than the window, a fresh prompt, a chunk whose window reaches back
    # into cached context, and a chunk spanning several query tiles (GQA 3: 21 tokens per tile).
    query_lens = [1, 1, 1, 13, 7, 50]
    seq_lens = [1, 19, 70, 13, 45, 90]
    _check(
        query_lens,
        seq_lens,
        4,
        6,
        2,
        seed=window or 1,
        window=window,
        softcap=softcap,
        num_splits=num_splits,
    )


def test_keys_before_the_window_are_never_loaded():
    """Blocks wholly before every query's window may be released: NaN there must not show."""
    rng = random.Random(9)
    window, block_size = 8, 4
    kv_cache, meta, q, k, v = _step(rng, [1, 6], [40, 30], block_size, 4, 2, 16, torch.float32)
    write_kv(k, v, kv_cache, meta.slot_mapping)
    expected = triton_attention.paged_attention_triton(q, kv_cache, meta, 0.25, window=window)
    tables = meta.block_tables.tolist()
    for table, n, s in zip(tables, meta.query_lens_cpu, meta.seq_lens_cpu, strict=True):
        for block in table[: (s - n - window + 1) // block_size]:
            kv_cache[:, block] = float("nan")
    got = triton_attention.paged_attention_triton(q, kv_cache, meta, 0.25, window=window)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    _check([1, 1, 9], [40, 3, 25], 16, 9, 3, head_dim=32, dtype=dtype, num_splits=2)


def test_decode_reads_only_device_state():
    """What a CUDA graph captures: the decode launch takes its lengths from device tensors, so new
    lengths and tables written into the same buffers give new, correct results."""
    rng = random.Random(7)
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    kv_cache, meta, q, _, _ = _step(
        rng, [1, 1], [9, 30], block_size, num_heads, num_kv_heads, head_dim, torch.float32
    )
    scale = head_dim**-0.5
    first = triton_attention.paged_attention_triton(q, kv_cache, meta, scale, num_splits=2)
    # Same metadata object (same host values), other device contents: sequences swap lengths.
    num_blocks = kv_cache.shape[1]
    new_tables = [rng.sample(range(num_blocks), 8), rng.sample(range(num_blocks), 3)]
    other = AttentionMetadata.from_lists([1, 1], [30, 11], new_tables, block_size, DEVICE)
    meta.seq_lens.copy_(other.seq_lens)
    meta.block_tables.copy_(other.block_tables[:, : meta.block_tables.shape[1]])
    got = triton_attention.paged_attention_triton(q, kv_cache, meta, scale, num_splits=2)
    expected = sdpa_decode(q, kv_cache, other, scale)  # the reference over the new lengths
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, first)


def test_decode_splits_fill_the_gpu_but_stay_long():
    # Small batches split (132 SMs, 3 KV heads: 1 sequence -> 88 programs wanted -> 64 splits
    # capped by MAX_SPLITS, and by length: 8192 / 256 = 32).
    assert triton_attention.decode_splits(1, 3, 8192, 132) == 32
    assert triton_attention.decode_splits(1, 3, 1024, 132) == 4  # no split under 256 tokens
    assert triton_attention.decode_splits(1, 3, 100, 132) == 1
    assert triton_attention.decode_splits(256, 3, 8192, 132) == 1  # batch alone fills the GPU
    for batch in (1, 2, 3, 8, 64, 200):
        splits = triton_attention.decode_splits(batch, 4, 4096, 132)
        assert splits >= 1 and splits & (splits - 1) == 0  # powers of two: few kernel variants


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("KVSERVE_ATTENTION_BACKEND", raising=False)
    try:
        attention_backend.cache_clear()
        # On CUDA without flash-attn (or with a block size flash-attn cannot read in place): triton.
        if ON_CUDA:
            assert attention_backend("cuda", torch.bfloat16, 16) in ("triton", "flash")
        expected = "cpu" if cpu_kernels.available() else "sdpa"  # the C++ kernels, else SDPA
        assert attention_backend("cpu", torch.float32, 16) == expected
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
        attention_backend.cache_clear()
        if ON_CUDA:
            assert attention_backend("cuda", torch.float32, 16) == "triton"
        else:
            assert attention_backend("cpu", torch.float32, 16) == "triton"  # interpreter on
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        attention_backend.cache_clear()
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            attention_backend("cpu", torch.float32, 16)  # no device, no interpreter
    finally:
        attention_backend.cache_clear()


def test_paged_attention_dispatches_to_triton():
    """The backend interface: paged_attention writes K/V, then the triton path attends."""
    rng = random.Random(5)
    kv_cache, meta, q, k, v = _step(rng, [1, 6], [12, 20], 4, 4, 2, 16, torch.float32)
    ref_cache = kv_cache.clone()
    meta.backend = "triton"
    got = paged_attention(q, k, v, kv_cache, meta, 0.25)
    meta.backend = "sdpa"
    expected = paged_attention(q, k, v, ref_cache, meta, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)  # same writes


_COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import triton_attention as ta

def compile(fn, types, consts, num_warps):
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    idx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=idx)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

io = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
io.update({n: "*fp32" for n in ("part_o_ptr", "part_m_ptr", "part_l_ptr")})
io.update({n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr")})
io["scale_log2"] = io["softcap"] = "fp32"
for block_m, group_pad, split, softcap in ((1, 16, True, True), (16, 4, False, False)):
    consts = dict(BLOCK_M=block_m, GROUP_PAD=group_pad, BLOCK_N=32, HEAD_PAD=64, SPLIT=split,
                  SOFTCAP=softcap, PRECISION="tf32", UPCAST=False)
    compile(ta._paged_attention_kernel, io, consts, 4)
compile(ta._reduce_splits_kernel, io, dict(SPLITS_PAD=8, HEAD_PAD=64), 1)
print("compiled")
"""


def test_kernels_compile_for_hopper():
    """The interpreter skips Triton's compiler, so compile the kernels (bf16 decode with split-K,
    prefill, the reduction) for sm_90 ahead of time, as the GPU would: no device needed."""
    import subprocess
    import sys

    from tests import repo_pythonpath

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = repo_pythonpath()
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
