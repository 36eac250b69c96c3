"""Paged attention: write a step's K/V into the block pool by slot mapping, then attend over each
sequence's cached context. The step's metadata and the backend choice live here; the backends are
chosen once: flash-attn on CUDA when installed and the block size lets it read the cache in place
(engine.kernels.flash_attention), else Triton kernels (engine.kernels.triton_attention) on CUDA; on
CPU the C++ decode kernel reading the paged cache in place for every query, prefill ones too
(engine.kernels.cpu_kernels); else the torch SDPA reference (engine.kernels.sdpa_attention: CUDA
without triton, CPU without the kernels).

Every backend takes a layer's sliding window (a query at position p sees keys at positions
> p - window, as transformers' masks) and Gemma's logit softcap (scores -> softcap * tanh(scores /
softcap) before the softmax)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kernels import cpu_kernels
from engine.kernels.flash_attention import flash_attention
from engine.kernels.sdpa_attention import sdpa_attention

logger = logging.getLogger(__name__)

BACKENDS = ("sdpa", "triton", "flash", "cpu")
FLASH_BLOCK_SIZE = 256  # flash-attn reads a paged cache in place only for multiples of this


@dataclass
class AttentionMetadata:
    # The step's new tokens are laid out sequence by sequence: the first `num_decode_seqs` sequences
    # have exactly one new token each (decodes), the rest are prefill chunks of any length >= 1.
    num_decode_seqs: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset per new token
    query_lens_cpu: list[int]  # host copies, to avoid device syncs
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend: str | None = (
        None  # force a backend (BACKENDS) for this step; None -> attention_backend()
    )
    # Per-step values every layer shares, built on first use (see decode_context).
    _shared: dict[object, Any] = field(default_factory=dict, init=False, repr=False)
    # Per model layer, the metadata of its KV cache group (its block tables and slot mapping); empty
    # when every layer shares this one. Set by the runner's input batch.
    layer_metas: tuple[AttentionMetadata, ...] = field(default=(), init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, layer_index: int) -> AttentionMetadata:
        """The metadata layer `layer_index` attends with (its KV-cache group's block tables and
        slot mapping); with one group, this metadata itself. Models always go through it."""
        return self.layer_metas[layer_index] if self.layer_metas else self

    def decode_context(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table [B, num_blocks], key mask [B, 1, 1, ctx_len]) of the decode sequences,
        computed once per step (and window) and reused by every layer."""
        cached = self._shared.get(("decode", window))
        if cached is None:
            batch = self.num_decode_seqs
            num_blocks = -(-max(self.seq_lens_cpu[:batch]) // self.block_size)
            table = self.block_tables[:batch, :num_blocks]
            positions = torch.arange(num_blocks * self.block_size, device=table.device)
            lens = self.seq_lens[:batch, None]
            mask = positions[None, :] < lens  # [B, ctx_len]
            if window is not None:  # the one query sits at lens - 1: keys > lens - 1 - window
                mask &= positions[None, :] >= lens - window
            cached = self._shared[("decode", window)] = (table, mask[:, None, None, :])
        return cached

    def prefill_context(
        self, seq_index: int, query_len: int, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(block table [num_blocks], causal mask [query_len, num_keys], first key position) of a
        prefill chunk that follows cached context; computed once per step (and window). With a
        window the table starts at the block holding the first query's first visible key."""
        key = (seq_index, window)
        cached = self._shared.get(key)
        if cached is None:
            seq_len = self.seq_lens_cpu[seq_index]
            first_query = seq_len - query_len
            first_block = (
                0 if window is None else max(0, first_query - window + 1) // self.block_size
            )
            table = self.block_tables[seq_index, first_block : -(-seq_len // self.block_size)]
            first_key = first_block * self.block_size
            # Query j sits at absolute position first_query + j and sees keys up to there.
            key_pos = torch.arange(first_key, seq_len, device=table.device)
            query_pos = torch.arange(first_query, seq_len, device=table.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - window
            cached = self._shared[key] = (table, mask, first_key)
        return cached

    def token_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table [num_tokens, width] int32, context length [num_tokens] int32) of every new
        token: each query's own causal context (its position + 1), computed once per step."""
        cached = self._shared.get("tokens")
        if cached is None:
            device = self.block_tables.device
            counts = torch.tensor(self.query_lens_cpu, device=device)
            tables = self.block_tables.repeat_interleave(counts, dim=0)
            lens = torch.cat(
                [
                    torch.arange(s - n + 1, s + 1, dtype=torch.int32, device=device)
                    for n, s in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True)
                ]
            )
            cached = self._shared["tokens"] = (tables, lens)
        return cached

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """The one builder (runner, embedding adapter, tests): host lists, decodes first; each
        sequence's new tokens are the last query_len positions of its seq_len context."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            slots.extend(slots_of(table, seq_len - query_len, seq_len, block_size))
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        return cls(
            num_decode_seqs=num_decodes,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
        )


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV-cache slots of positions [start, end): one range per block touched, not per token."""
    if end - start == 1:
        return [block_table[start // block_size] * block_size + start % block_size]
    slots: list[int] = []
    pos = start
    while pos < end:
        base = block_table[pos // block_size] * block_size
        stop = min(end, (pos // block_size + 1) * block_size)
        slots.extend(range(base + pos % block_size, base + pos % block_size + stop - pos))
        pos = stop
    return slots


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (0 = K, 1 = V)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each new token's K/V at its slot. k, v: [num_tokens, num_kv_heads, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over their sequences' paged context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]. Returns q's shape.
    window: the layer's sliding window (Hugging Face `sliding_window`; None = full attention);
    softcap: logit softcapping (None = off).
    """
    write_kv(k, v, kv_cache, meta.slot_mapping)
    return attend_cached(q, k, v, kv_cache, meta, scale, window=window, softcap=softcap)


def uses_cpu_kernels(meta: AttentionMetadata, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this step runs the C++ CPU backend (then models may call its fused layer ops)."""
    return (meta.backend or attention_backend(device.type, dtype, meta.block_size)) == "cpu"


def attend_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """paged_attention after this step's K/V are already in the cache (see write_kv)."""
    if window is not None and window <= 0:
        raise ValueError(f"sliding window must be positive, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"attention softcap must be positive, got {softcap}")
    backend = meta.backend or attention_backend(q.device.type, q.dtype, meta.block_size)
    if backend == "triton":
        from engine.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(q, kv_cache, meta, scale, window=window, softcap=softcap)
    if backend == "flash":
        return flash_attention(q.contiguous(), kv_cache, meta, scale, window, softcap)
    return sdpa_attention(
        q, k, v, kv_cache, meta, scale, window, softcap, in_place_decode=backend == "cpu"
    )


@functools.cache
def attention_backend(device_type: str, dtype: torch.dtype, block_size: int | None = None) -> str:
    """Pick the backend once per device, dtype and KV block size (None: no paged cache, as for
    BERT). KVSERVE_ATTENTION_BACKEND=auto|sdpa|triton|flash overrides the automatic choice:
    flash-attn when installed, on float16/bfloat16, and the block size is a multiple of 256
    (in place; forced with other sizes it gathers the context each layer); else triton on CUDA;
    else, on CPU, cpu (the C++ kernels, when they built); else sdpa, the pure-torch path everywhere.
    triton also runs on CPU under TRITON_INTERPRET=1 (slow; for tests)."""
    requested = os.environ.get("KVSERVE_ATTENTION_BACKEND", "auto")
    if requested not in ("auto", *BACKENDS):
        raise ValueError(
            f"KVSERVE_ATTENTION_BACKEND must be auto, {', '.join(BACKENDS)}; got {requested!r}"
        )
    half = dtype in (torch.float16, torch.bfloat16)  # flash-attn kernels exist only for these
    flash_ok = device_type == "cuda" and half and _flash_attn_importable()
    if requested == "flash" and not flash_ok:
        raise ValueError(
            "KVSERVE_ATTENTION_BACKEND=flash needs CUDA, float16/bfloat16 and the flash_attn package"
        )
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    triton_ok = (device_type == "cuda" or interpreted) and triton_importable()
    if requested == "triton" and not triton_ok:
        raise ValueError(
            "KVSERVE_ATTENTION_BACKEND=triton needs the triton package and CUDA "
            "(or TRITON_INTERPRET=1 on CPU)"
        )
    cpu_ok = device_type == "cpu" and requested in ("auto", "cpu") and cpu_kernels.available()
    if requested == "cpu" and not cpu_ok:
        raise ValueError(
            "KVSERVE_ATTENTION_BACKEND=cpu needs a CPU device and the C++ CPU kernels "
            "(built by scripts/install.sh; see the log for why they did not load)"
        )
    in_place = block_size is None or block_size % FLASH_BLOCK_SIZE == 0
    if requested != "auto":
        backend = requested
    elif flash_ok and in_place:
        backend = "flash"
    elif device_type == "cuda" and triton_ok and block_size is not None:
        backend = "triton"
    elif cpu_ok:
        backend = "cpu"
    else:
        backend = "sdpa"
    if backend == "flash" and not in_place:
        logger.warning(
            "flash-attn with --block-size %s gathers each sequence's context every layer; "
            "use a multiple of %d to read the cache in place",
            block_size,
            FLASH_BLOCK_SIZE,
        )
    logger.info("attention backend for %s %s: %s", device_type, dtype, backend)
    return backend


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
