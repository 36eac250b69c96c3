"""Weight-only int8/int4 linear: packed kernels agree with the dequantized matmul, and quantization
error stays within what the format allows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.quantization import Int4Weight, Int8Weight, linear, quantize_weight


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the output dtype's rounding: bf16 keeps 8 bits, so ~1% of the largest output."""
    scale = expected.abs().max().item()
    tol = 1e-2 * scale if got.dtype == torch.bfloat16 else 1e-5 * scale
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=tol)


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(96, 128)  # [out, in]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernel_matches_dequantized_matmul(weight: torch.Tensor, dtype: torch.dtype) -> None:
    q = Int8Weight(weight.to(dtype))
    x = torch.randn(5, 128, dtype=dtype)
    expected = F.linear(x.float(), q.dequantize().float())
    got = linear(x, q)
    assert got.dtype == dtype and got.shape == (5, 96)
    _assert_close(got, expected)


def test_int8_error_is_within_half_a_step(weight: torch.Tensor) -> None:
    q = Int8Weight(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_matches_dequantized_matmul(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype
) -> None:
    q = Int4Weight(weight.to(dtype), group_size)
    x = torch.randn(7, 128, dtype=dtype)
    expected = F.linear(x.float(), q.dequantize().float())
    _assert_close(linear(x, q), expected)


def test_int4_error_is_within_half_a_group_step(weight: torch.Tensor) -> None:
    q = Int4Weight(weight, 32)
    groups = weight.view(96, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [out, groups]
    err = (q.dequantize() - weight).abs().view(96, 4, 32)
    assert (err <= step[..., None] / 2 + 1e-5).all()
    # and it is a real quantizer: no more than 16 distinct values per group
    assert all(len(torch.unique(g)) <= 16 for g in q.dequantize().view(-1, 32))


def test_bias_is_added(weight: torch.Tensor) -> None:
    bias = torch.randn(96)
    x = torch.randn(3, 128)
    q = Int8Weight(weight)
    torch.testing.assert_close(linear(x, q, bias), linear(x, q) + bias)


def test_odd_shapes_fall_back_to_a_group_that_fits_or_int8() -> None:
    fallback = quantize_weight(torch.randn(16, 96), "int4", 64)
    assert isinstance(fallback, Int4Weight) and fallback.group_size == 32
    assert isinstance(quantize_weight(torch.randn(16, 40), "int4", 32), Int8Weight)
    assert isinstance(quantize_weight(torch.randn(8, 64), "int4", 32), Int8Weight)
