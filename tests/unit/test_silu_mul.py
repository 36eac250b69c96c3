"""The one-pass SwiGLU activation of block-quantized MLPs (csrc/silu_mul.cpp): close to torch's
silu(gate) * up, every element the same whatever the batch, its row, the row's width or the thread
count; the MLPs that take it (block weights) and those that keep torch's ops (float weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels
from engine.models.block_quant import BlockQ8Weight, quantize_q8_0
from engine.models.layers import GatedMLP

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


def _reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("inter", [1, 7, 8, 13, 64, 1536, 1539])
def test_close_to_torch_and_the_same_alone_as_in_any_batch(inter):
    torch.manual_seed(inter)
    x = torch.randn(37, 2 * inter) * 4
    out = cpu_kernels.silu_mul(x)
    torch.testing.assert_close(out.double(), _reference(x), rtol=2e-6, atol=1e-6)
    for r in (0, 5, 36):
        assert torch.equal(cpu_kernels.silu_mul(x[r : r + 1]), out[r : r + 1])
    assert torch.equal(cpu_kernels.silu_mul(x[3:20]), out[3:20])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_kernels.silu_mul(x), out)
    finally:
        torch.set_num_threads(threads)


def test_an_element_is_the_same_in_a_full_run_and_in_a_row_s_tail():
    """Element values depend on their inputs only: the 8-wide runs and the scalar tail agree."""
    torch.manual_seed(1)
    values = torch.randn(40) * 10
    wide = cpu_kernels.silu_mul(torch.cat([values, torch.ones(40)]).view(1, 80))
    for i in range(40):
        one = torch.tensor([[values[i].item(), 1.0]])
        assert torch.equal(cpu_kernels.silu_mul(one)[0, 0], wide[0, i])


def test_extremes_and_strided_rows():
    x = torch.tensor([[0.0, 100.0, -100.0, 88.0, -88.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    out = cpu_kernels.silu_mul(x)
    assert out[0, 0] == 0 and out[0, 1] == 200.0 and abs(out[0, 2]) < 1e-30
    torch.testing.assert_close(out.double(), _reference(x), rtol=2e-6, atol=1e-30)
    big = torch.randn(6, 500)
    view = big[:, 10:410]  # rows 500 apart, as a fused gate/up view may be
    assert torch.equal(cpu_kernels.silu_mul(view), cpu_kernels.silu_mul(view.contiguous()))


def test_bad_inputs_are_clear_errors():
    with pytest.raises(RuntimeError, match="inter"):
        cpu_kernels.silu_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.silu_mul(torch.randn(3, 8, dtype=torch.float64))


def test_block_mlps_take_it_and_float_mlps_keep_torch_s_ops():
    torch.manual_seed(2)
    mlp = GatedMLP(64, 96, "silu", False, torch.float32, torch.device("cpu"))
    torch.nn.init.normal_(mlp.gate_up_weight, std=0.1)
    torch.nn.init.normal_(mlp.down_weight, std=0.1)
    x = torch.randn(5, 64)
    gate, up = F.linear(x, mlp.gate_up_weight).split(96, dim=-1)
    assert torch.equal(mlp(x), F.linear(F.silu(gate) * up, mlp.down_weight))  # torch's bits
    packed = BlockQ8Weight(quantize_q8_0(mlp.gate_up_weight.detach()))
    del mlp._parameters["gate_up_weight"]  # as engine.models.quantization swaps a weight
    mlp.gate_up_weight = packed  # type: ignore[assignment]
    calls = []
    real = cpu_kernels.silu_mul

    def counting(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.shape)
        return real(t)

    cpu_kernels.silu_mul = counting  # type: ignore[assignment]
    try:
        mlp(x)
    finally:
        cpu_kernels.silu_mul = real  # type: ignore[assignment]
    assert calls == [torch.Size([5, 192])]
