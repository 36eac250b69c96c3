"""Paged attention: write a step's K/V into the block pool by slot mapping, then attend over each
sequence's cached context. The step's metadata and the backend choice live here; the backends are
chosen once: flash-attn on CUDA when installed and the block size lets it read the cache in place
(engine.kernels.flash_attention), else Triton kernels (engine.kernels.triton_attention) on CUDA; on
CPU the C++ kernels reading the paged cache in place for every query, prefill ones too (the prefill
kernel shares K/V tiles across a chunk's rows, bitwise the decode kernel per token;
engine.kernels.cpu_kernels); else the torch SDPA reference (engine.kernels.sdpa_attention: CUDA
without triton, CPU without the kernels).

Every backend takes a layer's sliding window (a query at position p sees keys at positions
> p - window, as transformers' masks) and Gemma's logit softcap (scores -> softcap * tanh(scores /
softcap) before the softmax)."""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.kernels import cpu_kernels
from engine.kernels.flash_attention import flash_attention
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.sdpa_attention import sdpa_attention

logger = logging.getLogger(__name__)

BACKENDS = ("sdpa", "triton", "flash", "cpu")
FLASH_BLOCK_SIZE = 256  # flash-attn reads a paged cache in place only for multiples of this


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
