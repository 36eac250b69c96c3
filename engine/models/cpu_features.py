"""What the CPU offers the weight formats: torch's vector capability, the relevant /proc/cpuinfo
flags (AVX2, AVX-512, VNNI, native bf16, AMX), and whether fbgemm's int8 kernels are available."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The flags that decide a format; the rest of /proc/cpuinfo is noise for this purpose.
RELEVANT_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve",
)  # fmt: skip


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str  # "AMD EPYC 7B13" or the platform's processor name
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    flags: frozenset[str]  # the RELEVANT_FLAGS this CPU has
    quantized_engines: tuple[str, ...]  # torch.backends.quantized.supported_engines

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware (AVX-512 BF16 or AMX); elsewhere torch emulates them slowly."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or "AMX" in self.capability.upper()

    @property
    def fbgemm_int8(self) -> bool:
        """fbgemm's int8 GEMM: x86 with AVX2 at least (it has AVX2 and AVX-512 VNNI kernels)."""
        vector = "avx2" in self.flags or self.capability.upper().startswith(("AVX2", "AVX512"))
        return vector and "fbgemm" in self.quantized_engines

    @property
    def int8_kernel(self) -> str:
        if "avx512_vnni" in self.flags or "amx_int8" in self.flags:
            return "fbgemm AVX-512 VNNI"
        if {"avx512f", "avx512bw"} <= self.flags:
            return "fbgemm AVX-512"
        return "fbgemm AVX2"

    def describe(self) -> str:
        flags = " ".join(f for f in RELEVANT_FLAGS if f in self.flags) or "none of note"
        return (
            f"{self.model_name}: torch capability {self.capability}, flags: {flags}; "
            f"native bf16: {'yes' if self.native_bf16 else 'no'}; "
            f"fbgemm int8: {self.int8_kernel if self.fbgemm_int8 else 'no'}"
        )


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, relevant flags) from /proc/cpuinfo text (x86 "flags", ARM "Features")."""
    name, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return name, frozenset(flags & set(RELEVANT_FLAGS))


@functools.cache
def detect_cpu() -> CpuFeatures:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    name, flags = parse_cpuinfo(text)
    return CpuFeatures(
        model_name=name or platform.processor() or platform.machine(),
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=flags,
        quantized_engines=tuple(torch.backends.quantized.supported_engines),
    )
