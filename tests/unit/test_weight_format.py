"""`--quantization auto` / `--dtype auto` choose from the detected CPU (faked here): a .gguf model's own
blocks, else int8 blocks, where the CPU runs the AVX2 block kernels; float weights elsewhere; explicit
choices that are slower than float32 on this CPU are warned about, impossible ones refused."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core.config import ModelConfig
from engine.models.cpu_features import CpuFeatures, detect_cpu, parse_cpuinfo
from engine.models.weight_format import choose_weight_format

CPU = torch.device("cpu")


def _cpu(capability: str, *flags: str) -> CpuFeatures:
    return CpuFeatures("test CPU", capability, frozenset(flags))


AVX2 = _cpu("AVX2", "avx2", "fma", "f16c")
AVX512_BF16 = _cpu("AVX512", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16")
AVX_ONLY = _cpu("DEFAULT", "f16c")  # an old x86 CPU (Sandy/Ivy Bridge): no AVX2, no FMA
AVX2_NO_F16C = _cpu("AVX2", "avx2", "fma")  # the kernels convert fp16 scales with F16C
ARM = _cpu("DEFAULT", "asimd", "asimddp")


def _choose(quantization: str | None, dtype: str = "auto", cpu: CpuFeatures = AVX2, **kw):
    kw.setdefault("kernels", True)  # kvserve's C++ kernels loaded (faked too)
    return choose_weight_format(quantization, dtype, CPU, kw.pop("checkpoint", None), cpu, **kw)


@pytest.mark.parametrize("cpu", [AVX2, AVX512_BF16])
def test_auto_is_int8_blocks_with_float32_activations_where_the_kernels_are_vectorized(
    cpu: CpuFeatures,
) -> None:
    chosen = _choose("auto", cpu=cpu, checkpoint="bfloat16")
    assert chosen.quantization == "int8" and chosen.dtype == torch.float32
    assert "Q8_0" in chosen.reason and "batch-invariant" in chosen.reason
    assert not chosen.warnings
    assert chosen.describe() == "weights int8 (Q8_0 blocks), activations float32"


@pytest.mark.parametrize("cpu", [AVX2, AVX512_BF16])
def test_auto_serves_a_gguf_model_s_own_blocks(cpu: CpuFeatures) -> None:
    chosen = _choose("auto", cpu=cpu, gguf_source=True)
    assert chosen.quantization == "gguf" and chosen.dtype == torch.float32
    assert "as stored" in chosen.reason and not chosen.warnings
    assert "GGUF file" in chosen.describe()


@pytest.mark.parametrize("cpu", [AVX_ONLY, AVX2_NO_F16C, ARM])
def test_auto_keeps_float_weights_where_the_kernels_would_run_portable_loops(
    cpu: CpuFeatures,
) -> None:
    for gguf_source in (False, True):
        chosen = _choose("auto", cpu=cpu, gguf_source=gguf_source)
        assert chosen.quantization is None and chosen.dtype == torch.float32
        assert "lacks AVX2/FMA/F16C" in chosen.reason and not chosen.warnings


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_explicit_block_formats_are_served_everywhere_but_warned_about_where_slow(
    quantization: str,
) -> None:
    fast = _choose(quantization, cpu=AVX2)
    assert fast.quantization == quantization and fast.dtype == torch.float32
    assert not fast.warnings
    slow = _choose(quantization, cpu=ARM)
    assert slow.quantization == quantization
    assert len(slow.warnings) == 1 and "portable loops, slower than float32" in slow.warnings[0]


def test_without_the_cpp_kernels_auto_keeps_float_weights_and_block_formats_are_refused() -> None:
    for gguf_source in (False, True):
        chosen = _choose("auto", kernels=False, gguf_source=gguf_source)
        assert chosen.quantization is None and chosen.dtype == torch.float32
        assert "did not build" in chosen.reason
    for quantization in ("int8", "int4", "gguf"):
        with pytest.raises(ValueError, match="needs kvserve's C\\+\\+ kernels"):
            _choose(quantization, kernels=False, gguf_source=True)
    assert _choose("none", kernels=False).quantization is None


def test_gguf_is_refused_for_a_model_that_is_not_a_gguf_file() -> None:
    with pytest.raises(ValueError, match="not a .gguf file"):
        _choose("gguf")
    chosen = _choose("gguf", gguf_source=True)
    assert chosen.quantization == "gguf" and chosen.reason == "--quantization gguf"
    assert _choose("gguf", cpu=ARM, gguf_source=True).warnings


@pytest.mark.parametrize("quantization", ["int8", "int4", "gguf"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_block_formats_refuse_reduced_precision_activations(quantization: str, dtype: str) -> None:
    with pytest.raises(ValueError, match="float32 activations"):
        _choose(quantization, dtype, gguf_source=True)
    assert _choose(quantization, "float32", gguf_source=True).dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_explicit_float_dtype_turns_auto_quantization_off(dtype: str) -> None:
    chosen = _choose("auto", dtype, cpu=AVX512_BF16, gguf_source=True)
    assert chosen.quantization is None and chosen.dtype == getattr(torch, dtype)
    assert f"--dtype {dtype}" in chosen.reason


def test_none_and_float32_stay_exact_float32() -> None:
    for quantization in (None, "none"):
        chosen = _choose(quantization, "float32", gguf_source=True)
        assert chosen.quantization is None and chosen.dtype == torch.float32
        assert not chosen.warnings and chosen.describe() == "weights float32, activations float32"


def test_bf16_without_native_support_is_warned_about() -> None:
    chosen = _choose("none", "bfloat16", cpu=AVX2)
    assert chosen.dtype == torch.bfloat16
    assert any("emulated" in w and "slower than float32" in w for w in chosen.warnings)
    assert not _choose("none", "bfloat16", cpu=AVX512_BF16).warnings  # native bf16
    float16 = _choose("none", "float16", cpu=AVX512_BF16)
    assert any("float16" in w and "slower" in w for w in float16.warnings)


def test_a_bf16_checkpoint_runs_bf16_only_on_native_bf16_cpus(monkeypatch) -> None:
    # resolve_dtype asks the detected CPU (the faked one above is only the format's input)
    for native, expected in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr("engine.models.weight_format._cpu_has_native_bf16", lambda n=native: n)
        assert _choose("none", "auto", checkpoint="bfloat16").dtype == expected


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, none, int8, int4 or gguf"):
        _choose("int3")


def test_quantization_is_refused_on_cuda() -> None:
    cuda = torch.device("cuda")
    for quantization in ("int8", "int4", "gguf"):
        with pytest.raises(ValueError, match="uses CPU kernels"):
            choose_weight_format(quantization, "auto", cuda, gguf_source=True)
    chosen = choose_weight_format("auto", "auto", cuda, gguf_source=True)
    assert chosen.quantization is None and chosen.dtype == torch.bfloat16


def test_config_defaults_to_auto_and_validates() -> None:
    assert ModelConfig().quantization == "auto"
    assert ModelConfig(quantization="none").quantization is None
    assert ModelConfig(quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="auto, none, int8, int4 or gguf"):
        ModelConfig(quantization="int3")


def test_cpuinfo_flags_are_parsed() -> None:
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"
        "flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_bf16 sha_ni\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n"
    )
    name, flags = parse_cpuinfo(text)
    assert name == "AMD EPYC 7B13"
    assert flags == {"avx2", "fma", "f16c", "avx512f", "avx512_bf16"}
    assert parse_cpuinfo("Features\t: fp asimd asimddp\n")[1] == {"asimd", "asimddp"}
    described = _cpu("AVX512", *flags).describe()
    assert "native bf16: yes" in described and "avx512_bf16" in described
    assert "block kernels: AVX2" in described
    assert "block kernels: portable (slow)" in ARM.describe()
    assert AVX2.block_kernels and not AVX2_NO_F16C.block_kernels and not AVX_ONLY.block_kernels


def test_the_detected_cpu_agrees_with_the_kernels_it_runs() -> None:
    """What start-up logs and chooses by is what the C++ kernels find themselves."""
    from engine.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("kvserve's C++ CPU kernels could not be built here")
    if os.environ.get("KVSERVE_BLOCK_KERNELS") == "portable":
        pytest.skip("KVSERVE_BLOCK_KERNELS=portable forces the portable loops")
    cpu = detect_cpu()
    assert torch.ops.kvserve.block_kernels_vectorized() == cpu.block_kernels
