"""Choose the weight format (quantization + activation dtype) for the device and CPU at hand: `auto`
picks the fastest format whose quality is within bounds; explicit choices that are slower than
float32 on this CPU are refused (int4) or warned about (emulated bf16/fp16), with the reason."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.cpu_features import CpuFeatures, detect_cpu

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WeightFormat:
    quantization: str | None  # None (float weights) | "int8" | "int4"
    dtype: torch.dtype  # activations (and float weights)
    reason: str  # why, for the start-up log
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        weights = self.quantization or str(self.dtype).removeprefix("torch.")
        return f"weights {weights}, activations {str(self.dtype).removeprefix('torch.')}"


# (int4 ms, competitor ms, competitor name) for a model-shaped layer at 1 and 8 rows.
Int4Probe = Callable[[CpuFeatures], list[tuple[float, float, str]]]


def choose_weight_format(
    quantization: str | None,
    dtype: str,
    device: torch.device,
    checkpoint_dtype: str | None = None,
    cpu: CpuFeatures | None = None,
    int4_probe: Int4Probe | None = None,
) -> WeightFormat:
    """`quantization`: auto | none (or None) | int8 | int4; `dtype`: auto | float32 | bfloat16 |
    float16. Raises ValueError for a combination this device cannot serve or serves slower."""
    from engine.models.loader import resolve_dtype

    quantization = None if quantization in (None, "none") else quantization
    if device.type != "cpu":
        if quantization in ("int8", "int4"):
            raise ValueError(
                f"--quantization {quantization} uses CPU kernels; on {device} serve bf16/fp16 "
                "weights (--quantization auto or none)"
            )
        torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype)
        return WeightFormat(None, torch_dtype, f"{device.type}: float weights")
    cpu = cpu or detect_cpu()
    if quantization == "auto":
        quantization, reason = _auto_quantization(dtype, cpu)
    elif quantization == "int8":
        _require_int8(cpu)
        reason = f"--quantization int8 ({cpu.int8_kernel}, per-row activation scales)"
    elif quantization == "int4":
        reason = _require_int4_pays(cpu, int4_probe or measure_int4)
    elif quantization is None:
        reason = "--quantization none: float weights"
    else:
        raise ValueError(f"quantization must be auto, none, int8 or int4; got {quantization!r}")
    if quantization == "int8":
        torch_dtype = torch.float32 if dtype == "auto" else _explicit_dtype(dtype)
    else:
        torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype)
    return WeightFormat(quantization, torch_dtype, reason, _slow_dtype_warnings(torch_dtype, cpu))


def _auto_quantization(dtype: str, cpu: CpuFeatures) -> tuple[str | None, str]:
    if dtype in ("bfloat16", "float16"):
        return None, f"auto: --dtype {dtype} asks for {dtype} weights"
    if cpu.fbgemm_int8:
        return "int8", (
            f"auto: int8 ({cpu.int8_kernel}): int8 weights with per-row int8 activations run the "
            "linears several times faster than float32 on this CPU, batch-invariant, perplexity "
            "within 1% of float32 (--quantization none keeps float32 exact)"
        )
    return None, "auto: no fbgemm int8 kernels on this CPU (x86 with AVX2 needed): float weights"


def _require_int8(cpu: CpuFeatures) -> None:
    if not cpu.fbgemm_int8:
        raise ValueError(
            "--quantization int8 needs fbgemm's int8 kernels (an x86 CPU with AVX2 or AVX-512); "
            f"this CPU has none ({cpu.describe()}); use --quantization none"
        )


def _require_int4_pays(cpu: CpuFeatures, probe: Int4Probe) -> str:
    timings = probe(cpu)
    shown = ", ".join(
        f"{rows} row{'s' * (rows > 1)}: int4 {t4:.2f} ms vs {name} {other:.2f} ms"
        for rows, (t4, other, name) in zip((1, 8), timings, strict=False)
    )
    if all(t4 >= other for t4, other, _ in timings):
        better = "int8" if cpu.fbgemm_int8 else "none"
        raise ValueError(
            f"--quantization int4 is refused on this CPU ({cpu.capability}): torch's int4 "
            f"weight-only kernel is slower here than {timings[0][2]} ({shown}, one "
            f"576x1536 layer); use --quantization {better} (or auto)"
        )
    return f"--quantization int4 (torch's int4 kernel; measured {shown})"


def measure_int4(cpu: CpuFeatures) -> list[tuple[float, float, str]]:
    """Time torch's int4 kernel against the best other format on one SmolLM-shaped layer."""
    from engine.models.quantization import Int4Weight, Int8Weight, linear

    torch.manual_seed(0)
    weight = torch.randn(1536, 576) * 0.02
    int4 = Int4Weight(weight, 32)
    other: torch.Tensor | Int8Weight = weight
    name = "float32"
    if cpu.fbgemm_int8:
        other, name = Int8Weight(weight), "int8"
    timings = []
    for rows in (1, 8):
        x = torch.randn(rows, 576)
        t4 = _median_ms(functools.partial(linear, x, int4))
        timings.append((t4, _median_ms(functools.partial(linear, x, other)), name))
    return timings


def _median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _explicit_dtype(dtype: str) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}")
    return FLOAT_DTYPES[dtype]


def _slow_dtype_warnings(dtype: torch.dtype, cpu: CpuFeatures) -> tuple[str, ...]:
    if dtype == torch.bfloat16 and not cpu.native_bf16:
        return (
            "bfloat16 on a CPU without native bf16 (no avx512_bf16/amx_bf16) is emulated and "
            "slower than float32 here; use --dtype auto",
        )
    if dtype == torch.float16:
        return ("float16 matmuls on CPU are slower than float32; use --dtype auto",)
    return ()
