"""Choose the weight format (quantization + activation dtype) for the device and CPU at hand: `auto`
picks the fastest format whose quality is within bounds (a GGUF file's own blocks, else int8 blocks,
where the CPU runs the vectorized block kernels); explicit choices that are slower than float32 on
this CPU are warned about (portable block loops, emulated bf16/fp16), with the reason; and the
activation dtype "auto" resolves to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.cpu_features import CpuFeatures, detect_cpu

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WeightFormat:
    quantization: str | None  # None (float weights) | "int8" | "int4" | "gguf"
    dtype: torch.dtype  # activations (and float weights)
    reason: str  # why, for the start-up log
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        weights = {
            None: str(self.dtype).removeprefix("torch."),
            "int8": "int8 (Q8_0 blocks)",
            "int4": "int4 (Q4_1 blocks, Q8_0 head)",
            "gguf": "as stored in the GGUF file",
        }[self.quantization]
        return f"weights {weights}, activations {str(self.dtype).removeprefix('torch.')}"


def choose_weight_format(
    quantization: str | None,
    dtype: str,
    device: torch.device,
    checkpoint_dtype: str | None = None,
    cpu: CpuFeatures | None = None,
    gguf_source: bool = False,
    kernels: bool | None = None,
) -> WeightFormat:
    """`quantization`: auto | none (or None) | int8 | int4 | gguf; `dtype`: auto | float32 |
    bfloat16 | float16; `gguf_source`: the model was converted from a .gguf file; `kernels`:
    whether kvserve's C++ kernels load (None: try now). Raises ValueError for a combination this
    device cannot serve."""
    quantization = None if quantization in (None, "none") else quantization
    if quantization not in (None, "auto", "int8", "int4", "gguf"):
        raise ValueError(
            f"quantization must be auto, none, int8, int4 or gguf; got {quantization!r}"
        )
    if device.type != "cpu":
        if quantization in ("int8", "int4", "gguf"):
            raise ValueError(
                f"--quantization {quantization} uses CPU kernels; on {device} serve bf16/fp16 "
                "weights (--quantization auto or none)"
            )
        torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype)
        return WeightFormat(None, torch_dtype, f"{device.type}: float weights")
    cpu = cpu or detect_cpu()
    if kernels is None and quantization is not None:
        from engine.kernels import cpu_kernels

        kernels = cpu_kernels.available()
    warnings: tuple[str, ...] = ()
    if quantization == "auto" and not kernels:
        quantization, reason = None, "auto: kvserve's C++ kernels did not build (see the log)"
    elif quantization == "auto":
        quantization, reason = _auto_quantization(dtype, cpu, gguf_source)
    elif quantization is None:
        reason = "--quantization none: float weights"
    else:
        if quantization == "gguf" and not gguf_source:
            raise ValueError(
                "--quantization gguf serves the blocks a GGUF file stores; this model is not a "
                ".gguf file (use int8, int4, auto or none)"
            )
        if not kernels:
            raise ValueError(
                f"--quantization {quantization} needs kvserve's C++ kernels, which did not build "
                "or load (see the log; scripts/install.sh builds them); use --quantization none"
            )
        reason = f"--quantization {quantization}"
        if not cpu.block_kernels:
            warnings = (
                f"--quantization {quantization}: this CPU lacks AVX2/FMA/F16C, so the block "
                "kernels run portable loops, slower than float32 matmuls; use --quantization auto",
            )
    if quantization is None:
        torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype)
        return WeightFormat(None, torch_dtype, reason, _slow_dtype_warnings(torch_dtype, cpu))
    if dtype not in ("auto", "float32"):
        raise ValueError(
            f"--quantization {quantization} runs float32 activations; use --dtype auto or "
            f"float32, or --quantization none for {dtype} weights"
        )
    return WeightFormat(quantization, torch.float32, reason, warnings)


def _auto_quantization(dtype: str, cpu: CpuFeatures, gguf_source: bool) -> tuple[str | None, str]:
    if dtype in ("bfloat16", "float16"):
        return None, f"auto: --dtype {dtype} asks for {dtype} weights"
    if not cpu.block_kernels:
        return None, "auto: this CPU lacks AVX2/FMA/F16C for the block kernels: float weights"
    if gguf_source:
        return "gguf", (
            "auto: the GGUF file's own Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks, served exactly as "
            f"stored (others as Q8_0), on the {_kernels(cpu)} block kernels with int8 activations per row and block of "
            "32: batch-invariant "
            "(--quantization none serves its dequantized float32 weights)"
        )
    return "int8", (
        f"auto: int8 Q8_0 blocks on the {_kernels(cpu)} block kernels, activations in int8 per row "
        "and block: several "
        "times faster than float32 here, batch-invariant, perplexity within 1% of float32 "
        "(--quantization none keeps float32 exact)"
    )


def _kernels(cpu: CpuFeatures) -> str:
    """The block-kernel path that runs (the loaded kernels' choice), else what the flags allow."""
    return cpu.kernel_path or "AVX2"


def _slow_dtype_warnings(dtype: torch.dtype, cpu: CpuFeatures) -> tuple[str, ...]:
    if dtype == torch.bfloat16 and not cpu.native_bf16:
        return (
            "bfloat16 on a CPU without native bf16 (no avx512_bf16/amx_bf16) is emulated and "
            "slower than float32 here; use --dtype auto",
        )
    if dtype == torch.float16:
        return ("float16 matmuls on CPU are slower than float32; use --dtype auto",)
    return ()


def resolve_dtype(
    dtype: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """ "auto" follows the checkpoint, as vLLM does: its own bfloat16/float16 where the device runs
    it natively, float32 stays float32 on CPU (on CUDA it becomes bfloat16, the fast path).

    Reduced precision rounds every activation, so greedy output then depends on what else shares
    the batch; a float32 checkpoint (such as the converted bundled GGUF) keeps greedy results
    identical alone and under any concurrency. `--dtype bfloat16` trades that for ~2x CPU speed.
    """
    if dtype == "auto":
        checkpoint = str(checkpoint_dtype or "float32").removeprefix("torch.")
        if device.type == "cuda":
            return torch.float16 if checkpoint == "float16" else torch.bfloat16
        if checkpoint == "bfloat16" and _cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}")
    return table[dtype]


def _cpu_has_native_bf16() -> bool:
    return detect_cpu().native_bf16
