"""The KV cache's element type: what `--kv-cache-dtype` asks for, resolved against the device, the
model's dtype and its weight format, once at start-up.

On CPU under block-quantized weights (whose activations are already rounded to int8 per block) the
cache holds 16 bits an element by default: a long context's attention reads half the bytes and the
pool holds twice the tokens. bfloat16 where the C++ kernels' AVX-512 BF16 attention runs (a probe in
a child process, csrc/attention_bf16.h): its two dot products in bf16 arithmetic (queries and
probabilities rounded to bf16, products exact, sums float32), twice float32's multiply-adds per
instruction; float16 elsewhere, widened to float32 on load (exact), so the arithmetic after the load
is that of a float32 cache. Either way every kernel (prefill, decode, split, team) rounds alike, so
batch and chunking invariance hold. Float weights keep a cache of their own dtype, so
`--quantization none` stays transformers' arithmetic."""

from __future__ import annotations

import torch

_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None,
    backend: str = "cpu",
) -> torch.dtype:
    """The cache dtype for `requested` (a CacheConfig.kv_cache_dtype): `auto` is bfloat16 on CPU
    under float32 activations and a block-quantized weight format where the cpu backend's bf16
    attention runs in hardware (float16 where not), else `dtype`; an explicit type is the model's
    dtype, or float16 or bfloat16 under float32 on CPU. `backend` is the attention backend that
    reads it (engine.kernels.attention.attention_backend): the Triton and flash-attn kernels read
    the model's dtype only. Anything else is a ValueError."""
    widens = device.type == "cpu" and backend in ("cpu", "sdpa")
    if requested == "auto":
        if widens and dtype == torch.float32 and quantization is not None:
            return torch.bfloat16 if backend == "cpu" and bf16_attention_runs() else torch.float16
        return dtype
    if requested not in _NAMES:
        raise ValueError(f"kv_cache_dtype must be auto, {', '.join(_NAMES)}; got {requested!r}")
    wanted = _NAMES[requested]
    if wanted == dtype:
        return wanted
    if wanted in (torch.float16, torch.bfloat16) and dtype == torch.float32 and widens:
        return wanted
    model = str(dtype).removeprefix("torch.")
    raise ValueError(
        f"kv_cache_dtype {requested} does not fit {model} activations on {device.type} "
        f"({backend} attention): the KV cache holds the model's dtype ({model}), or float16 or "
        f"bfloat16 under float32 on CPU with the cpu or sdpa attention backend"
    )


def bf16_attention_runs() -> bool:
    """Whether the C++ kernels' bf16 attention runs on this CPU's AVX-512 BF16 instructions (its
    probe: csrc/attention_bf16.cpp); emulated with AVX2 it is slower than a float16 cache."""
    from engine.kernels import cpu_kernels

    return cpu_kernels.available() and torch.ops.kvserve.attention_bf16_probe() == ""


def kernels_read(kv_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether the C++ CPU kernels read a `kv_dtype` cache under `dtype` queries: their own dtype,
    or float16 or bfloat16 under float32 (csrc/attention_avx2.h: kv_dtype_ok)."""
    return kv_dtype == dtype or (
        dtype == torch.float32 and kv_dtype in (torch.float16, torch.bfloat16)
    )


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float16` -> `float16`, for logs and fingerprints."""
    return str(dtype).removeprefix("torch.")
