"""The AMX-INT8 probe: the switch, the cpuid gate, and a child that traps or miscomputes reported as
such instead of taking the process down."""

from __future__ import annotations

import logging
import platform

import pytest

from engine.kernels import amx_probe
from engine.kernels.amx_probe import AMX_INT8_CODE, UD2_CODE, AmxStatus, probe_amx, run_child
from engine.models.cpu_features import CpuFeatures

X86_LINUX = platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")
needs_x86 = pytest.mark.skipif(not X86_LINUX, reason="the probe's machine code is x86-64 Linux")
HAS_AMX_FLAGS = {"amx_tile", "amx_int8"} <= amx_probe.cpu_flags()


def _no_child(*args: object, **kwargs: object) -> tuple[str, str]:
    raise AssertionError("the probe ran a child process")


@needs_x86
@pytest.mark.skipif(HAS_AMX_FLAGS, reason="this CPU lists the AMX flags")
def test_no_amx_flags_is_unavailable_without_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSERVE_AMX", raising=False)
    monkeypatch.setattr(amx_probe, "run_child", _no_child)
    status = probe_amx()
    assert status.state == "unavailable" and not status.usable
    assert "lacks amx_tile" in status.detail


def test_switch_off_runs_no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_AMX", "0")
    monkeypatch.setattr(amx_probe, "run_child", _no_child)
    status = probe_amx(flags=frozenset({"amx_tile", "amx_int8"}))
    assert (status.state, status.switch, status.usable) == ("off", "0", False)


@needs_x86
def test_auto_probes_when_the_flags_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []

    def child(code: bytes, request_permission: bool = True) -> tuple[str, str]:
        calls.append(code)
        assert request_permission  # Linux hands out the tile state only on request
        return "runs", "tdpbssd tile product exact"

    monkeypatch.setattr(amx_probe, "run_child", child)
    status = probe_amx("auto", flags=frozenset({"amx_tile", "amx_int8", "amx_bf16"}))
    assert calls == [AMX_INT8_CODE] and status.usable and status.switch == "auto"


@needs_x86
def test_switch_on_probes_without_flags_and_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        amx_probe, "run_child", lambda code, request_permission=True: ("traps", "x")
    )
    with caplog.at_level(logging.WARNING, logger=amx_probe.__name__):
        status = probe_amx("1", flags=frozenset())
    assert status.state == "traps" and not status.usable and status.switch == "1"
    assert "cpuid lacks amx_tile" in status.detail
    assert "does not run here" in caplog.text


@needs_x86
def test_unknown_switch_value_falls_back_to_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amx_probe, "run_child", _no_child)
    status = probe_amx("yes please", flags=frozenset())
    assert status.switch == "auto" and "'yes please' ignored" in status.detail


def test_unknown_switch_value_is_a_warning_naming_the_accepted_values(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVSERVE_AMX", "bogus")
    monkeypatch.setattr(amx_probe, "run_child", _no_child)
    with caplog.at_level(logging.INFO, logger=amx_probe.__name__):
        status = probe_amx(flags=frozenset())
    assert status.switch == "auto"
    (record,) = [r for r in caplog.records if "bogus" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert all(v in record.getMessage() for v in ("0 (off)", "1 (probe", "auto"))


@needs_x86
def test_a_child_killed_by_sigill_is_reported_as_traps() -> None:
    state, detail = run_child(UD2_CODE, request_permission=False)
    assert state == "traps" and "SIGILL" in detail


@needs_x86
@pytest.mark.skipif(HAS_AMX_FLAGS, reason="this CPU lists the AMX flags")
def test_amx_instructions_trap_on_a_cpu_without_amx() -> None:
    """The real probe code, without the permission request, where the CPU has no AMX: SIGILL in the
    child (as on the Xeon whose cpuid lists AMX), this process unharmed."""
    assert run_child(AMX_INT8_CODE, request_permission=False)[0] == "traps"


@needs_x86
@pytest.mark.skipif(HAS_AMX_FLAGS, reason="this CPU lists the AMX flags")
def test_kernel_refuses_the_tile_state_without_amx() -> None:
    status = probe_amx("1", flags=frozenset())
    assert status.state == "refused" and "ARCH_REQ_XCOMP_PERM" in status.detail


@needs_x86
def test_a_wrong_result_is_a_failure_not_runs() -> None:
    state, detail = run_child(bytes.fromhex("c3"), request_permission=False)  # ret: C stays zero
    assert state == "failed" and "differs" in detail


def test_cpu_line_names_the_amx_result() -> None:
    status = AmxStatus("traps", "the probe died with SIGILL")
    cpu = CpuFeatures("Xeon", "AVX512", frozenset({"avx2", "amx_int8"}), amx=status.describe())
    assert "AMX-INT8: traps (the probe died with SIGILL)" in cpu.describe()
