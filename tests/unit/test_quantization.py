"""Block-quantized weights (GGUF's Q8_0 and Q4_1 formats on kvserve's C++ kernels): outputs close to
the float matmul with the dequantized weights, bitwise batch-invariant (a row's output is the same
alone, inside any batch and with any thread count), GGUF bytes read exactly as the `gguf` package
dequantizes them, and the portable loops giving the vectorized paths' bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn

from engine.kernels import cpu_kernels
from engine.models.block_quant import (
    BlockQ4Weight,
    BlockQ8Weight,
    BlockValues,
    from_gguf_blocks,
    quantize_q4_1,
    quantize_q8_0,
)
from engine.models.cpu_features import detect_cpu
from engine.models.quantization import BlockEmbedding, linear, quantize_model
from tests import repo_pythonpath

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)
GGUF_TYPES = {
    "Q8_0": GGMLQuantizationType.Q8_0,
    "Q4_0": GGMLQuantizationType.Q4_0,
    "Q4_1": GGMLQuantizationType.Q4_1,
}


def _weight(kind: str, w: torch.Tensor) -> BlockQ4Weight | BlockQ8Weight:
    return BlockQ4Weight(quantize_q4_1(w)) if kind == "q4_1" else BlockQ8Weight(quantize_q8_0(w))


def _row_error(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:  # [n]
    return (got - expected).norm(dim=1) / expected.norm(dim=1)


def _term_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest error of an output against x @ w.T, relative to the sum of its terms' magnitudes
    (robust where terms cancel): int8 activations per block of 32 give ~0.1%, at worst ~1.5%."""
    return ((got - F.linear(x, w)).abs() / F.linear(x.abs(), w.abs())).max().item()


class _threads:
    def __init__(self, n: int) -> None:
        self.n, self.previous = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


# ---------------------------------------------------------------- accuracy


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_output_is_close_to_the_dequantized_float_matmul(kind: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05  # [out, in]
    q = _weight(kind, w)
    # rows of very different magnitudes: each row (and block) gets its own activation scale
    x = torch.randn(9, 256) * torch.logspace(-3, 3, 9)[:, None]
    got = linear(x, q)
    assert got.dtype == torch.float32 and got.shape == (9, 96)
    # int8 activations per block of 32: ~0.6% of the exact matmul with the stored weights
    assert _row_error(got, F.linear(x, q.dequantize())).max() < 0.02
    # and the weights' own error on Gaussian data: Q8_0 ~0.5%, Q4_1 ~8%
    bound = 0.02 if kind == "q8_0" else 0.15
    assert _row_error(got, F.linear(x, w)).max() < bound


@needs_kernels
def test_extreme_block_values_do_not_overflow_the_integer_sums() -> None:
    n, k = 16, 64
    ones = torch.ones(n, k // 32)
    q4 = BlockValues("q4_1", torch.full((n, k), 15, dtype=torch.uint8), ones, ones * 0.5)
    # -128 is a valid stored Q8_0 value (ggml's own quantizer never writes it)
    q8 = BlockValues("q8_0", torch.full((n, k), -128, dtype=torch.int8), ones, 0 * ones)
    x = torch.stack([torch.ones(k), -torch.ones(k), torch.full((k,), 3.0)])  # q = +-127 everywhere
    for values in (q4, q8):
        expected = F.linear(x, values.dequantize())
        torch.testing.assert_close(linear(x, values.to_weight()), expected, rtol=1e-6, atol=0)


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_a_zero_row_gives_zeros_and_bias_is_added(kind: str) -> None:
    torch.manual_seed(1)
    q = _weight(kind, torch.randn(40, 64))
    x = torch.randn(3, 64)
    x[1] = 0.0
    assert torch.equal(linear(x, q)[1], torch.zeros(40))
    bias = torch.randn(40)
    assert torch.equal(linear(x, q, bias), linear(x, q) + bias)


# ---------------------------------------------------------------- batch invariance


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("shape", [(37, 64), (200, 160), (576, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_the_same_alone_and_in_any_batch(
    kind: str, shape: tuple[int, int], threads: int
) -> None:
    """Batches of 2..130 rows cross the kernels' 4-row tiles and 64-row panels; a row lands in every
    position of a tile or panel, beside rows of any magnitude."""
    torch.manual_seed(2)
    q = _weight(kind, torch.randn(*shape) * 0.05)
    rows = 130
    x = torch.randn(rows, shape[1]) * torch.rand(rows, 1) * 20  # varied row ranges
    x[7] = 0.0
    x[11, 3] = 500.0  # an outlier row: a per-batch scale would move everyone else
    with _threads(threads):
        alone = torch.cat([linear(x[i : i + 1], q) for i in range(rows)])
        generator = torch.Generator().manual_seed(3)
        for size in (2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 127, 128, 129, 130):
            pick = torch.randperm(rows, generator=generator)[:size]
            assert torch.equal(linear(x[pick], q), alone[pick]), size
        twice = torch.tensor([5, 5, 11, 5, 129, 0])  # the same row at several positions
        assert torch.equal(linear(x[twice], q), alone[twice])
    assert alone.shape == (rows, shape[0])


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_outputs_do_not_depend_on_the_thread_count(kind: str) -> None:
    torch.manual_seed(4)
    q = _weight(kind, torch.randn(200, 160))
    x = torch.randn(70, 160)
    with _threads(1):
        one = linear(x, q)
    with _threads(2):
        two = linear(x, q)
    assert torch.equal(one, two)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_a_non_finite_row_does_not_reach_the_other_rows(kind: str, bad: float) -> None:
    torch.manual_seed(5)
    q = _weight(kind, torch.randn(96, 128))
    x = torch.randn(6, 128)
    alone = torch.cat([linear(x[i : i + 1], q) for i in range(6)])
    x[2, 7] = bad
    out = linear(x, q)
    assert all(torch.equal(out[i], alone[i]) for i in (0, 1, 3, 4, 5))
    assert not out[2].isfinite().any()  # the bad row stays visibly bad (the engine reports it)


# ---------------------------------------------------------------- shapes and layouts


@needs_kernels
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("out_features", [1, 7, 9, 37, 100])
def test_output_features_need_not_be_a_multiple_of_8(kind: str, out_features: int) -> None:
    torch.manual_seed(6)
    values = (quantize_q4_1 if kind == "q4_1" else quantize_q8_0)(torch.randn(out_features, 96))
    q = values.to_weight()
    x = torch.randn(5, 96)
    got = linear(x, q)
    assert got.shape == (5, out_features)
    assert _term_error(got, x, values.dequantize()) < 0.01
    assert torch.equal(q.dequantize(), values.dequantize())


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_values_round_trip_through_the_interleaved_layout(kind: str) -> None:
    torch.manual_seed(7)
    values = (quantize_q4_1 if kind == "q4_1" else quantize_q8_0)(torch.randn(45, 128))
    back = values.to_weight().values()
    assert back.kind == kind
    for name in ("q", "d", "m"):
        assert torch.equal(getattr(back, name), getattr(values, name)), name
    # row selections and concatenations (the fused qkv / gate_up weights) are exact too
    order = torch.randperm(45)
    joined = BlockValues.cat([values.rows(order[:20]), values.rows(order[20:])])
    assert torch.equal(joined.dequantize(), values.dequantize()[order])
    with pytest.raises(ValueError, match="different formats"):
        BlockValues.cat([quantize_q8_0(torch.randn(8, 32)), quantize_q4_1(torch.randn(8, 32))])


@needs_kernels
@pytest.mark.parametrize("out_features", [8, 43, 200])
def test_embedding_rows_in_one_op_are_the_torch_lookup_bit_for_bit(out_features: int) -> None:
    torch.manual_seed(3)
    w = torch.randn(out_features, 96) * torch.logspace(-3, 2, out_features)[:, None]
    w[1, :32] = 0.0  # a zero block (scale 0)
    weight = _weight("q8_0", w)
    ids = torch.tensor([0, out_features - 1, 1, 5 % out_features, 0, out_features // 2])
    got = weight.rows(ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), 96)
    assert torch.equal(got, weight.rows_torch(ids))
    assert torch.equal(got, weight.dequantize()[ids])
    assert weight.rows(ids[:0]).shape == (0, 96)
    with pytest.raises(RuntimeError, match="out of range"):
        weight.rows(torch.tensor([out_features + 8]))
    with pytest.raises(RuntimeError, match="out of range"):
        weight.rows(torch.tensor([-1]))


def test_weight_bytes_are_those_of_the_formats() -> None:
    w = torch.randn(64, 256)
    # Q8_0: 34 bytes per 32 values; Q4_1: 20 bytes per 32 values (GGUF's own sizes)
    assert BlockQ8Weight(quantize_q8_0(w)).nbytes == 64 * 8 * 34
    assert BlockQ4Weight(quantize_q4_1(w)).nbytes == 64 * 8 * 20


def test_input_features_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q8_0(torch.randn(8, 40))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q4_1(torch.randn(8, 33))
    ragged = BlockValues(
        "q8_0", torch.zeros(8, 40, dtype=torch.int8), torch.ones(8, 1), torch.zeros(8, 1)
    )
    with pytest.raises(ValueError, match="divisible by 32"):
        ragged.to_weight()


# ---------------------------------------------------------------- GGUF bytes


def _gguf_bytes(kind: str, w: torch.Tensor) -> np.ndarray:  # [N, K/32 * block bytes] uint8
    return gguf_quantize(w.numpy(), GGUF_TYPES[kind])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_the_gguf_package_does(kind: str) -> None:
    torch.manual_seed(8)
    w = torch.randn(24, 96) * 0.1
    w[3, :32] = 0.0  # a zero block: d = 0
    w[5, 32:64] = 0.25  # a constant block: Q4_1 with d = 0, m = 0.25
    raw = _gguf_bytes(kind, w)
    values = from_gguf_blocks(kind, raw, (24, 96))
    expected = torch.from_numpy(gguf_dequantize(raw, GGUF_TYPES[kind]))
    assert values.kind == kind.lower()  # Q4_0: Q4_1's values with m = -8 d, m not stored
    assert torch.equal(values.dequantize(), expected)
    # the kernels' layout keeps them exactly, N = 24 and all
    assert torch.equal(values.to_weight().dequantize(), expected)


@needs_kernels
def test_q4_0_blocks_run_on_the_q4_kernel() -> None:
    torch.manual_seed(9)
    raw = _gguf_bytes("Q4_0", torch.randn(40, 128))
    q = from_gguf_blocks("Q4_0", raw, (40, 128)).to_weight()
    x = torch.randn(6, 128)
    w = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q4_0))
    assert _term_error(linear(x, q), x, w) < 0.01


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_our_quantizers_write_ggml_s_blocks(kind: str) -> None:
    """quantize_q8_0 / q4_1 of a float weight give the blocks llama.cpp's quantizer writes, rounding
    ties included (C's roundf rounds halves away from zero; torch.round would round them to even)."""
    torch.manual_seed(10)
    w = torch.randn(16, 128)
    # a block whose values sit exactly halfway between two Q8_0 steps: d = 1, w = k + 0.5
    w[0, :32] = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])
    ours = (quantize_q8_0 if kind == "Q8_0" else quantize_q4_1)(w)
    theirs = from_gguf_blocks(kind, _gguf_bytes(kind, w), (16, 128))
    for name in ("q", "d", "m"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def test_unknown_gguf_types_are_refused() -> None:
    with pytest.raises(ValueError, match="Q4_K"):
        from_gguf_blocks("Q4_K", np.zeros((1, 144), dtype=np.uint8), (1, 256))


# ---------------------------------------------------------------- quantize_model


class _TiedModel(nn.Module):
    """The shape engine.models.quantization expects: matmul weights named by quantizable_weights, a
    head tied to the embedding, and one weight whose input features are not whole blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.tie_word_embeddings = True
        self.dtype = torch.float32
        self.embed_tokens = nn.Embedding(50, 64)
        self.lm_head_weight: torch.Tensor | None = None
        self.proj = nn.Parameter(torch.randn(24, 64), requires_grad=False)
        self.ragged = nn.Parameter(torch.randn(16, 40), requires_grad=False)

    def quantizable_weights(self) -> list[tuple[nn.Module, str]]:
        if self.lm_head_weight is None:
            self.lm_head_weight = self.embed_tokens.weight
        return [(self, "lm_head_weight"), (self, "proj"), (self, "ragged")]


@needs_kernels
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_model_packs_whole_block_weights_and_shares_the_head(method: str) -> None:
    model = _TiedModel()
    table = model.embed_tokens.weight.detach().clone()
    before = quantize_model(model, None)
    after = quantize_model(model, method)
    assert isinstance(model.proj, BlockQ4Weight if method == "int4" else BlockQ8Weight)
    assert isinstance(model.lm_head_weight, BlockQ8Weight)  # the head stays Q8_0 under int4 too
    assert isinstance(model.ragged, nn.Parameter)  # 40 input features: stays float
    assert after < before
    # the embedding now reads the head's Q8_0 table: its rows are the dequantized rows
    embedding = model.embed_tokens
    assert isinstance(embedding, BlockEmbedding)
    ids = torch.tensor([0, 7, 7, 49])
    dequantized = model.lm_head_weight.dequantize()
    assert torch.equal(embedding(ids), dequantized[ids])
    torch.testing.assert_close(dequantized, table, rtol=0, atol=table.abs().max().item() / 127)
    assert BlockEmbedding(model.lm_head_weight, torch.bfloat16)(ids).dtype == torch.bfloat16


def test_quantize_model_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="int8, int4 or gguf"):
        quantize_model(_TiedModel(), "int3")
    with pytest.raises(ValueError, match="pass a .gguf model"):
        quantize_model(_TiedModel(), "gguf", None)
    with pytest.raises(ValueError, match="not supported"):
        quantize_model(nn.Linear(32, 8), "int8")


# ---------------------------------------------------------------- the portable loops

_PORTABLE_SCRIPT = """
import sys, torch
from engine.kernels import cpu_kernels
from engine.models.block_quant import BlockValues
assert cpu_kernels.available() and not torch.ops.kvserve.block_kernels_vectorized()
data = torch.load(sys.argv[1])
x, out = data["x"], {}
for kind in ("q8_0", "q4_1"):
    q = BlockValues(kind, *data[kind]).to_weight()
    out[kind] = q.matmul(x)
    out[kind + "_alone"] = torch.cat([q.matmul(x[i : i + 1]) for i in range(x.shape[0])])
torch.save(out, sys.argv[2])
"""


@needs_kernels
def test_portable_loops_agree_with_the_vectorized_kernels(tmp_path: Path) -> None:
    """KVSERVE_BLOCK_KERNELS=portable (read once per process) runs the loops CPUs without AVX2 get:
    the same integer sums and the same fma sequence per output, so bitwise the same outputs as the
    path this CPU picks (test_block_kernel_paths.py compares every path in one process)."""
    if detect_cpu().block_kernels:  # this process runs the AVX2 path where the CPU has it
        assert torch.ops.kvserve.block_kernels_vectorized()
    torch.manual_seed(12)
    w = torch.randn(37, 160) * 0.05
    x = torch.randn(70, 160) * torch.rand(70, 1) * 10
    values = {"q8_0": quantize_q8_0(w), "q4_1": quantize_q4_1(w)}
    data = {kind: (v.q, v.d, v.m) for kind, v in values.items()}
    torch.save({**data, "x": x}, tmp_path / "in.pt")
    env = {**os.environ, "KVSERVE_BLOCK_KERNELS": "portable", "PYTHONPATH": repo_pythonpath()}
    script = [sys.executable, "-c", _PORTABLE_SCRIPT]
    result = subprocess.run(
        [*script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    portable = torch.load(tmp_path / "out.pt")
    for kind, v in values.items():
        assert torch.equal(portable[kind], portable[kind + "_alone"]), kind  # batch-invariant too
        assert torch.equal(portable[kind], v.to_weight().matmul(x)), kind
