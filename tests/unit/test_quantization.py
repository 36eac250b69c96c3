"""Quantized linears: the int8 fbgemm linear is accurate and bitwise batch-invariant (a row's output
is the same alone and inside any batch), the int4 weight-only kernel agrees with its dequantized
matmul, and quantization error stays within what each format allows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.int8_linear import Int8Embedding, fbgemm_available
from engine.models.quantization import Int4Weight, Int8Weight, linear, quantize_weight

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm int8 kernels (x86) only")


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the output dtype's rounding: bf16 keeps 8 bits, so ~1% of the largest output."""
    scale = expected.abs().max().item()
    tol = 1e-2 * scale if got.dtype == torch.bfloat16 else 1e-5 * scale
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=tol)


def _row_error(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:  # [n]
    return (got.float() - expected).norm(dim=1) / expected.norm(dim=1)


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(96, 128)  # [out, in]


@needs_fbgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_float_matmul(weight: torch.Tensor, dtype: torch.dtype) -> None:
    q = Int8Weight(weight)
    # rows of very different magnitudes: each gets its own activation scale
    x = torch.randn(9, 128) * torch.logspace(-3, 3, 9)[:, None]
    got = linear(x.to(dtype), q)
    assert got.dtype == dtype and got.shape == (9, 96)
    # two 7-bit passes per row (~13-bit activations): ~2e-4 of the exact matmul with the int8
    # weights (one 7-bit pass alone would give ~2%); the int8 weights add ~1% on Gaussian data
    tol = 1e-3 if dtype == torch.float32 else 1e-2  # bf16 output rounding
    assert _row_error(got, F.linear(x, q.dequantize())).max() < tol
    assert _row_error(got, F.linear(x, weight)).max() < 0.02


@needs_fbgemm
@pytest.mark.parametrize("shape", [(96, 128), (960, 576), (576, 1536), (37, 70)])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_rows_are_bitwise_the_same_alone_and_in_any_batch(
    shape: tuple[int, int], threads: int
) -> None:
    torch.manual_seed(1)
    q = Int8Weight(torch.randn(*shape) * 0.05)
    x = torch.randn(64, shape[1]) * torch.rand(64, 1) * 20  # [64, in], varied row ranges
    x[7] = 0.0
    x[11, 3] = 500.0  # an outlier row: would set a shared scale for everyone
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([linear(x[i : i + 1], q) for i in range(64)])
        generator = torch.Generator().manual_seed(2)
        for size in (2, 3, 8, 17, 33, 64):
            rows = torch.randperm(64, generator=generator)[:size]
            assert torch.equal(linear(x[rows], q), alone[rows]), size
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone[7], torch.zeros(shape[0]))


@needs_fbgemm
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_row_does_not_reach_the_other_rows(weight: torch.Tensor, bad: float) -> None:
    q = Int8Weight(weight)
    x = torch.randn(5, 128)
    alone = torch.cat([linear(x[i : i + 1], q) for i in range(5)])
    x[2, 7] = bad
    out = linear(x, q)
    assert all(torch.equal(out[i], alone[i]) for i in (0, 1, 3, 4))
    assert not out[2].isfinite().all()  # the bad row stays visibly bad (the engine reports it)


@needs_fbgemm
def test_int8_weights_are_within_half_a_step(weight: torch.Tensor) -> None:
    q = Int8Weight(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    assert q.int8_values().dtype == torch.int8 and q.int8_values().abs().max() == 127


@needs_fbgemm
def test_int8_embedding_dequantizes_the_heads_rows(weight: torch.Tensor) -> None:
    head = Int8Weight(weight)
    embedding = Int8Embedding(head, torch.float32)
    ids = torch.tensor([0, 5, 5, 95])
    torch.testing.assert_close(embedding(ids), head.dequantize()[ids], rtol=0, atol=0)
    assert Int8Embedding(head, torch.bfloat16)(ids).dtype == torch.bfloat16


@needs_fbgemm
def test_bias_is_added(weight: torch.Tensor) -> None:
    bias = torch.randn(96)
    x = torch.randn(3, 128)
    q = Int8Weight(weight)
    torch.testing.assert_close(linear(x, q, bias), linear(x, q) + bias)


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


@needs_fbgemm
def test_odd_shapes_fall_back_to_a_group_that_fits_or_int8() -> None:
    fallback = quantize_weight(torch.randn(16, 96), "int4", 64)
    assert isinstance(fallback, Int4Weight) and fallback.group_size == 32
    assert isinstance(quantize_weight(torch.randn(16, 40), "int4", 32), Int8Weight)
    assert isinstance(quantize_weight(torch.randn(8, 64), "int4", 32), Int8Weight)
