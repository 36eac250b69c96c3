"""What the CPU offers the weight formats: torch's vector capability, the relevant /proc/cpuinfo
flags (AVX2, FMA, F16C, AVX-512, VNNI, native bf16, AMX), and whether kvserve's vectorized block
kernels (engine/kernels/csrc/block_matmul.cpp) run on it."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The flags that decide a format; the rest of /proc/cpuinfo is noise for this purpose.
RELEVANT_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve",
)  # fmt: skip


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str  # "AMD EPYC 7B13" or the platform's processor name
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    flags: frozenset[str]  # the RELEVANT_FLAGS this CPU has

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware (AVX-512 BF16 or AMX); elsewhere torch emulates them slowly."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or "AMX" in self.capability.upper()

    @property
    def block_kernels(self) -> bool:
        """kvserve's int8/int4 block kernels have an AVX2 + FMA + F16C path (x86 since ~2013);
        elsewhere they fall back to portable loops that are slower than float32 matmuls."""
        return {"avx2", "fma", "f16c"} <= self.flags

    def describe(self) -> str:
        flags = " ".join(f for f in RELEVANT_FLAGS if f in self.flags) or "none of note"
        return (
            f"{self.model_name}: torch capability {self.capability}, flags: {flags}; "
            f"native bf16: {'yes' if self.native_bf16 else 'no'}; "
            f"block kernels: {'AVX2' if self.block_kernels else 'portable (slow)'}"
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
    )
