"""`--quantization auto` / `--dtype auto` choose from the detected CPU (faked here): int8 where fbgemm
runs, float elsewhere; int4 is refused where its kernel is slower; emulated bf16 is warned about."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import ModelConfig
from engine.models.cpu_features import CpuFeatures, detect_cpu, parse_cpuinfo
from engine.models.weight_format import choose_weight_format

CPU = torch.device("cpu")
X86 = ("qnnpack", "onednn", "x86", "fbgemm")


def _cpu(capability: str, *flags: str, engines: tuple[str, ...] = X86) -> CpuFeatures:
    return CpuFeatures("test CPU", capability, frozenset(flags), engines)


AVX2 = _cpu("AVX2", "avx2", "fma")
AVX512_BF16 = _cpu("AVX512", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
ARM = _cpu("DEFAULT", "asimd", "asimddp", engines=("qnnpack",))


def _choose(quantization: str | None, dtype: str = "auto", cpu: CpuFeatures = AVX2, **kw):
    return choose_weight_format(quantization, dtype, CPU, kw.pop("checkpoint", None), cpu, **kw)


@pytest.mark.parametrize("cpu", [AVX2, AVX512_BF16])
def test_auto_is_int8_with_float32_activations_on_x86(cpu: CpuFeatures) -> None:
    chosen = _choose("auto", cpu=cpu, checkpoint="bfloat16")
    assert chosen.quantization == "int8" and chosen.dtype == torch.float32
    assert "fbgemm" in chosen.reason and not chosen.warnings
    assert ("VNNI" in chosen.reason) == (cpu is AVX512_BF16)


def test_auto_without_fbgemm_keeps_float_weights() -> None:
    chosen = _choose("auto", cpu=ARM)
    assert chosen.quantization is None and chosen.dtype == torch.float32
    assert "no fbgemm" in chosen.reason
    with pytest.raises(ValueError, match="needs fbgemm"):
        _choose("int8", cpu=ARM)


def test_explicit_float_dtype_turns_auto_quantization_off() -> None:
    chosen = _choose("auto", "bfloat16", cpu=AVX512_BF16)
    assert chosen.quantization is None and chosen.dtype == torch.bfloat16
    assert not chosen.warnings  # native bf16


def test_none_and_float32_stay_exact_float32() -> None:
    for quantization in (None, "none"):
        chosen = _choose(quantization, "float32")
        assert chosen.quantization is None and chosen.dtype == torch.float32


def test_bf16_without_native_support_is_warned_about() -> None:
    chosen = _choose("none", "bfloat16", cpu=AVX2)
    assert chosen.dtype == torch.bfloat16
    assert any("emulated" in w and "slower than float32" in w for w in chosen.warnings)
    # auto never picks bf16 there, even for a bf16 checkpoint
    assert _choose("none", "auto", cpu=AVX2, checkpoint="bfloat16").dtype == torch.float32


def test_int4_is_refused_with_the_measured_reason_where_int8_is_faster() -> None:
    def slow_int4(cpu: CpuFeatures) -> list[tuple[float, float, str]]:
        return [(4.0, 0.2, "int8"), (30.0, 0.3, "int8")]

    with pytest.raises(ValueError, match=r"int4 is refused.*AVX2.*int4 4\.00 ms vs int8 0\.20 ms"):
        _choose("int4", int4_probe=slow_int4)


def test_int4_is_served_where_its_kernel_is_faster() -> None:
    def fast_int4(cpu: CpuFeatures) -> list[tuple[float, float, str]]:
        return [(0.1, 0.2, "int8"), (0.2, 0.3, "int8")]

    chosen = _choose("int4", cpu=AVX512_BF16, int4_probe=fast_int4)
    assert chosen.quantization == "int4" and "measured" in chosen.reason


def test_int4_is_refused_on_this_cpu_when_slower_than_int8() -> None:
    """The real probe on the machine running the tests: on AVX2 torch's int4 kernel is far slower."""
    cpu = detect_cpu()
    if not cpu.fbgemm_int8 or cpu.capability != "AVX2":
        pytest.skip("measured expectation is for AVX2 CPUs")
    with pytest.raises(ValueError, match="int4 is refused"):
        _choose("int4", cpu=cpu)


def test_quantization_is_refused_on_cuda() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="uses CPU kernels"):
        choose_weight_format("int8", "auto", cuda)
    chosen = choose_weight_format("auto", "auto", cuda)
    assert chosen.quantization is None and chosen.dtype == torch.bfloat16


def test_config_defaults_to_auto_and_validates() -> None:
    assert ModelConfig().quantization == "auto"
    assert ModelConfig(quantization="none").quantization is None
    with pytest.raises(ValueError, match="auto, none, int8 or int4"):
        ModelConfig(quantization="int3")


def test_cpuinfo_flags_are_parsed() -> None:
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"
        "flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 sha_ni\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n"
    )
    name, flags = parse_cpuinfo(text)
    assert name == "AMD EPYC 7B13" and flags == {"avx2", "fma", "avx512f", "avx512_bf16"}
    assert parse_cpuinfo("Features\t: fp asimd asimddp\n")[1] == {"asimd", "asimddp"}
    described = _cpu("AVX512", *flags).describe()
    assert "native bf16: yes" in described and "avx512_bf16" in described
