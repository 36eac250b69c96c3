"""Whether AMX-INT8 runs here: cpuid flags are not proof (an Intel Xeon advertises amx_tile and
amx_int8 yet traps on `tilezero`), so a child process asks Linux for the tile state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`) and runs one `tdpbssd` tile product, compared
with Python's integer sums; a SIGILL kills only the child. `KVSERVE_AMX=0|1|auto` is the switch.

No kernel uses AMX yet: this is what lets one be added safely (it runs only where `AmxStatus.usable`)."""

from __future__ import annotations

import functools
import logging
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

AMX_ENV = "KVSERVE_AMX"
SWITCH_VALUES = ("0", "1", "auto")
AMX_FLAGS = ("amx_tile", "amx_int8")  # /proc/cpuinfo names
PROBE_TIMEOUT_S = 30.0

# The probe's shapes: A is M x K int8, B is K/4 rows of N x 4 int8 (AMX's VNNI layout), C is M x N
# int32; every row 64 bytes, so one stride serves all three tiles.
M, K, N = 4, 64, 16
STRIDE = 64

# void probe(const char cfg[64] /*rdi*/, const int8* a /*rsi*/, const int8* b /*rdx*/,
#            int64 stride /*rcx*/, int32* c /*r8*/), assembled with GNU as and read back with objdump:
AMX_INT8_CODE = bytes.fromhex(
    "c4e2784907"  # ldtilecfg (%rdi)
    "c4e27b4b140e"  # tileloadd (%rsi,%rcx,1), %tmm2
    "c4e27b4b1c0a"  # tileloadd (%rdx,%rcx,1), %tmm3
    "c4e27b49c8"  # tilezero %tmm1
    "c4e2635eca"  # tdpbssd %tmm3, %tmm2, %tmm1
    "c4c27a4b0c08"  # tilestored %tmm1, (%r8,%rcx,1)
    "c4e27849c0"  # tilerelease
    "c3"  # ret
)
UD2_CODE = bytes.fromhex("0f0b")  # an instruction that always traps (the tests' stand-in for AMX)

# Child exit codes (a signal is reported by the signal's name).
EXIT_SAME, EXIT_DENIED, EXIT_NO_EXEC, EXIT_DIFFERENT = 0, 2, 4, 3

# The child: stdlib only (no torch: it starts in tens of milliseconds), one argument, the code's hex.
_CHILD = r"""
import ctypes, sys
code = bytes.fromhex(sys.argv[1])
request = sys.argv[2] == "1"
M, K, N, STRIDE = 4, 64, 16, 64
libc = ctypes.CDLL(None, use_errno=True)
if request:
    # arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18), syscall 158 on x86-64
    if libc.syscall(158, 0x1023, 18) != 0:
        print(__import__("os").strerror(ctypes.get_errno()))
        sys.exit(2)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = libc.mmap(None, 4096, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
if page in (None, ctypes.c_void_p(-1).value):
    print("mmap failed")
    sys.exit(4)
ctypes.memmove(page, code, len(code))
if libc.mprotect(page, 4096, 5) != 0:  # PROT_READ|PROT_EXEC
    print("mprotect to executable refused")
    sys.exit(4)
cfg = (ctypes.c_uint8 * 64)()
cfg[0] = 1  # palette 1
colsb = (ctypes.c_uint16 * 16).from_buffer(cfg, 16)
rows = (ctypes.c_uint8 * 16).from_buffer(cfg, 48)
colsb[1], rows[1] = N * 4, M  # tmm1: C, M x N int32
colsb[2], rows[2] = K, M  # tmm2: A, M x K int8
colsb[3], rows[3] = N * 4, K // 4  # tmm3: B, K/4 x (N x 4) int8
a = (ctypes.c_int8 * (M * STRIDE))(*[(i * 37 % 255) - 127 for i in range(M * STRIDE)])
b = (ctypes.c_int8 * (K // 4 * STRIDE))(*[(i * 91 % 255) - 128 for i in range(K // 4 * STRIDE)])
c = (ctypes.c_int32 * (M * N))()
fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                      ctypes.c_void_p)(page)
fn(ctypes.addressof(cfg), ctypes.addressof(a), ctypes.addressof(b), STRIDE, ctypes.addressof(c))
want = [sum(a[m * STRIDE + 4 * k + i] * b[k * STRIDE + 4 * n + i] for k in range(K // 4)
            for i in range(4)) for m in range(M) for n in range(N)]
sys.exit(0 if list(c) == want else 3)
"""


@dataclass(frozen=True)
class AmxStatus:
    """What the probe found. state: "runs" (the tile product ran and was exact), "traps" (its child
    died by SIGILL), "refused" (the kernel denied the tile state), "unavailable" (no cpuid flags, not
    x86-64 Linux), "off" (KVSERVE_AMX=0), "failed" (anything else: a wrong result, another signal)."""

    state: str
    detail: str
    switch: str = "auto"  # KVSERVE_AMX as honoured

    @property
    def usable(self) -> bool:
        """An AMX kernel may run: the switch allows it and the probe showed the instructions work."""
        return self.state == "runs"

    def describe(self) -> str:
        return f"{self.state} ({self.detail})"


def run_child(code: bytes, request_permission: bool = True) -> tuple[str, str]:
    """(state, detail) of running `code` (x86-64, the probe's calling convention) in a child."""
    argv = [sys.executable, "-I", "-c", _CHILD, code.hex(), "1" if request_permission else "0"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "failed", f"the probe hung for {PROBE_TIMEOUT_S:.0f} s"
    except OSError as e:
        return "failed", f"no child process: {e}"
    said = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    rc = done.returncode
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        if -rc == signal.SIGILL:
            return "traps", f"the probe died with {name}: the CPU does not run the instructions"
        return "failed", f"the probe died with {name}"
    if rc == EXIT_SAME:
        return "runs", "tdpbssd tile product exact in a child process"
    if rc == EXIT_DENIED:
        return "refused", f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused: {said}"
    if rc == EXIT_DIFFERENT:
        return "failed", "the tile product differs from the integer sums"
    if rc == EXIT_NO_EXEC:
        return "failed", f"no executable memory for the probe: {said}"
    tail = done.stderr.strip().splitlines()[-1:] or [""]
    return "failed", f"the probe exited with status {rc} {tail[0]}".rstrip()


def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() == "flags":
            return frozenset(value.split())
    return frozenset()


def probe_amx(switch: str | None = None, flags: frozenset[str] | None = None) -> AmxStatus:
    """The switch (default: KVSERVE_AMX, else auto) applied, then the probe where it is due.
    auto: probe when cpuid lists the AMX flags; 1: probe even without them (a VM may hide them),
    warning when AMX does not run; 0: off, no probe."""
    raw = os.environ.get(AMX_ENV, "auto") if switch is None else switch
    value = raw.strip().lower()
    note = ""
    if value not in SWITCH_VALUES:
        note = f"{AMX_ENV}={raw!r} ignored (0, 1 or auto); "
        logger.warning(
            "%s=%r is not a known value: give 0 (off), 1 (probe even without the cpuid flags) or "
            "auto (the default); going on with auto",
            AMX_ENV,
            raw,
        )
        value = "auto"
    if value == "0":
        return AmxStatus("off", f"{AMX_ENV}=0", "0")
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return AmxStatus("unavailable", note + "AMX is x86-64 Linux only here", value)
    have = cpu_flags() if flags is None else flags
    missing = [f for f in AMX_FLAGS if f not in have]
    if missing and value == "auto":
        return AmxStatus("unavailable", note + f"the CPU lacks {', '.join(missing)}", value)
    state, detail = run_child(AMX_INT8_CODE)
    if missing:
        detail += f"; cpuid lacks {', '.join(missing)}"
    if value == "1":
        detail = f"{AMX_ENV}=1: " + detail
        if state != "runs":
            logger.warning("%s=1 but AMX-INT8 does not run here: %s (%s)", AMX_ENV, state, detail)
    return AmxStatus(state, note + detail, value)


@functools.cache
def amx_status() -> AmxStatus:
    """The process's probe result, once (a child process at first use)."""
    status = probe_amx()
    logger.info("AMX-INT8: %s", status.describe())
    return status
