"""What the CPU offers the weight formats: torch's vector capability, the relevant /proc/cpuinfo
flags (AVX2, FMA, F16C, AVX-512, VNNI, native bf16, AMX), and which path of kvserve's block kernels
(engine/kernels/csrc/block_matmul.cpp) runs on it and why (each ISA path is probed in a child
process before it is trusted; block_paths.cpp), and whether AMX-INT8 runs (engine.kernels.amx_probe)."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels.amx_probe import amx_status

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
    # The block-kernel path the loaded kernels run ("avx512vnni", "avxvnni", "avx2", "portable")
    # and why; None where the kernels are not loaded (or for a CPU described from flags only).
    kernel_path: str | None = None
    kernel_reason: str = ""
    kernel_paths_running: frozenset[str] | None = None  # the paths whose probe passed
    # AMX-INT8 as its child-process probe found it (engine.kernels.amx_probe), "runs (...)",
    # "traps (...)", ...; None for a CPU described from flags only.
    amx: str | None = None
    # The attention over a bfloat16 KV cache (csrc/attention_bf16.h): "avx512bf16 (vdpbf16ps)",
    # "emulated (...)"; None where the kernels are not loaded.
    bf16_attention: str | None = None

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware (AVX-512 BF16 or AMX); elsewhere torch emulates them slowly."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags) or "AMX" in self.capability.upper()

    @property
    def block_kernels(self) -> bool:
        """kvserve's int8/int4 block kernels have an AVX2 + FMA + F16C path (x86 since ~2013), and
        faster VNNI ones; elsewhere they fall back to portable loops that are slower than float32
        matmuls. Where the kernels are loaded, the AVX2 path's probe decides, not the flags."""
        if self.kernel_paths_running is not None:
            return "avx2" in self.kernel_paths_running
        return {"avx2", "fma", "f16c"} <= self.flags

    def describe(self) -> str:
        flags = " ".join(f for f in RELEVANT_FLAGS if f in self.flags) or "none of note"
        if self.kernel_path is not None:
            kernels = f"{self.kernel_path} ({self.kernel_reason})"
        else:
            kernels = "AVX2" if self.block_kernels else "portable (slow)"
        amx = f"; AMX-INT8: {self.amx}" if self.amx is not None else ""
        bf16 = f"; bf16 attention: {self.bf16_attention}" if self.bf16_attention else ""
        return (
            f"{self.model_name}: torch capability {self.capability}, flags: {flags}; "
            f"native bf16: {'yes' if self.native_bf16 else 'no'}; block kernels: {kernels}{amx}"
            f"{bf16}"
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


BLOCK_KERNEL_PATHS = ("avx512vnni", "avxvnni", "avx2", "portable")  # fastest first


def block_kernel_choice() -> tuple[str, str, frozenset[str]] | None:
    """(path, reason, the paths that run) of the block kernels as loaded now, or None if the C++
    kernels are not loaded."""
    from engine.kernels import cpu_kernels

    if not cpu_kernels.available():
        return None
    ops = torch.ops.kvserve
    running = frozenset(p for p in BLOCK_KERNEL_PATHS if block_kernel_probe(p) == "")
    return str(ops.block_kernels_path()), str(ops.block_kernels_reason()), running


def block_kernel_probe(path: str) -> str:
    """ "" if the loaded kernels' `path` runs on this CPU (its probe, in a child process, gave the
    portable loops' bits), else why not. Needs the C++ kernels loaded."""
    try:
        return str(torch.ops.kvserve.block_kernels_probe(path))
    except RuntimeError as e:  # a path this build does not have (x86 paths on ARM)
        return str(e).splitlines()[0]


@functools.cache
def detect_cpu() -> CpuFeatures:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    name, flags = parse_cpuinfo(text)
    path, reason, running = block_kernel_choice() or (None, "", None)
    bf16 = str(torch.ops.kvserve.attention_bf16_path()) if path is not None else None
    return CpuFeatures(
        model_name=name or platform.processor() or platform.machine(),
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=flags,
        kernel_path=path,
        kernel_reason=reason,
        kernel_paths_running=running,
        amx=amx_status().describe(),
        bf16_attention=bf16,
    )
