"""The block kernels' ISA paths (avx512vnni, avxvnni, avx2, portable): every path this CPU runs
gives bitwise the portable loops' outputs for each format over odd shapes, in any batch and thread
count; the automatic choice is the fastest path whose probe (a child process) passed;
KVSERVE_BLOCK_KERNELS forces a path, and a path that cannot run is refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from engine.kernels import cpu_kernels
from engine.models.block_quant import (
    BlockQ4Weight,
    BlockQ8Weight,
    from_gguf_blocks,
    quantize_q4_1,
    quantize_q8_0,
)
from engine.models.cpu_features import BLOCK_KERNEL_PATHS, block_kernel_probe, detect_cpu
from tests import repo_pythonpath

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)
VECTOR_PATHS = [p for p in BLOCK_KERNEL_PATHS if p != "portable"]


def _ops():  # noqa: ANN202 (torch's op namespace has no useful static type)
    return torch.ops.kvserve


@pytest.fixture
def restore_path() -> Iterator[None]:
    before = str(_ops().block_kernels_path())
    yield
    _ops().block_kernels_select(before)


def _formats(n: int, k: int) -> dict[str, BlockQ4Weight | BlockQ8Weight]:
    """Each format the kernels serve, with the extreme values each admits: Q8_0 (with -128), Q4_1,
    and Q4_0 as a GGUF file stores it (no m: its integer sums take the weights as q - 8)."""
    w = torch.randn(n, k) * 0.05
    w[0, :32] = 0.0  # an all-zero block
    q8 = quantize_q8_0(w)
    q8.q[1, :40] = -128  # GGUF allows -128, which the quantizer never writes
    q8.q[2, 7::9] = 127
    raw = gguf_quantize(w.numpy().astype(np.float32), GGMLQuantizationType.Q4_0)
    return {
        "q8_0": BlockQ8Weight(q8),
        "q4_1": BlockQ4Weight(quantize_q4_1(w)),
        "q4_0": from_gguf_blocks("Q4_0", raw, (n, k)).to_weight(),
    }


def _activations(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k) * torch.logspace(-2, 3, rows)[:, None]
    x[rows // 2, : min(k, 64)] = 0.0  # zero blocks: scale 0
    x[-1, 5] = 1e4  # one large value dominates its block's scale
    return x


def _run(path: str, weight: BlockQ4Weight | BlockQ8Weight, x: torch.Tensor) -> torch.Tensor:
    _ops().block_kernels_select(path)
    return weight.matmul(x)


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_each_path_gives_the_portable_loops_bits(path: str, restore_path: None) -> None:
    """Rows 1..130 (every row-tile remainder and panel boundary), K a multiple of 32 and N a
    multiple of 8 but not of 16 (a lone last column group), for each format."""
    why = block_kernel_probe(path)
    if why:
        pytest.skip(f"{path} does not run here: {why}")
    torch.manual_seed(3)
    for n, k in ((24, 96), (40, 160), (48, 64), (8, 32)):
        weights = _formats(n, k)
        x = _activations(130, k)
        for kind, weight in weights.items():
            expected = _run("portable", weight, x)
            assert torch.equal(_run(path, weight, x), expected), (kind, n, k)
            for rows in range(1, 131):
                got = _run(path, weight, x[:rows].contiguous())
                assert torch.equal(got, expected[:rows]), (kind, n, k, rows)


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_each_path_is_batch_and_thread_invariant(path: str, restore_path: None) -> None:
    """SmolLM2-shaped columns (N = 576, not a multiple of 64): a row's output is the same alone,
    in a batch of 130 on 1 or 2 threads, and on the portable loops."""
    if block_kernel_probe(path):
        pytest.skip(f"{path} does not run here: {block_kernel_probe(path)}")
    torch.manual_seed(4)
    previous = torch.get_num_threads()
    for kind, weight in _formats(576, 192).items():
        x = _activations(130, 192)
        alone = torch.cat([_run(path, weight, x[i : i + 1]) for i in range(0, 130, 13)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                batch = _run(path, weight, x)
            finally:
                torch.set_num_threads(previous)
            assert torch.equal(batch[::13], alone), (kind, threads)
        assert torch.equal(_run("portable", weight, x), batch), kind


def test_the_automatic_choice_is_the_fastest_path_that_runs(restore_path: None) -> None:
    running = [p for p in BLOCK_KERNEL_PATHS if block_kernel_probe(p) == ""]
    assert running[-1] == "portable" and block_kernel_probe("portable") == ""
    assert _ops().block_kernels_select("auto") == running[0]
    reason = str(_ops().block_kernels_reason())
    assert "auto: the fastest path that runs here" in reason
    for p in BLOCK_KERNEL_PATHS:  # the reason names every path and whether it runs
        assert p in reason
    cpu = detect_cpu()
    assert cpu.kernel_path is not None and cpu.kernel_path in cpu.describe()
    assert cpu.block_kernels == ("avx2" in running)


def test_a_path_that_cannot_run_or_does_not_exist_is_refused(restore_path: None) -> None:
    with pytest.raises(RuntimeError, match="unknown block-kernel path 'avx9'; choose from auto"):
        _ops().block_kernels_select("avx9")
    missing = [p for p in VECTOR_PATHS if block_kernel_probe(p)]
    for path in missing:
        with pytest.raises(RuntimeError, match=f"{path} cannot run here"):
            _ops().block_kernels_select(path)


_ENV_SCRIPT = """
import torch
from engine.kernels import cpu_kernels
assert cpu_kernels.available()
print(torch.ops.kvserve.block_kernels_path())
print(torch.ops.kvserve.block_kernels_reason())
"""


@pytest.mark.parametrize("value", ["avx2", "avx9"])  # portable: test_quantization.py
def test_kvserve_block_kernels_forces_a_path(value: str) -> None:
    """The env var (read once per process) forces a path that runs; an unusable value falls back
    to the automatic choice and says why."""
    if value == "avx2" and block_kernel_probe("avx2"):
        pytest.skip("avx2 does not run here")
    env = {**os.environ, "KVSERVE_BLOCK_KERNELS": value, "PYTHONPATH": repo_pythonpath()}
    result = subprocess.run(
        [sys.executable, "-c", _ENV_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    path, reason = result.stdout.splitlines()[-2:]
    if value == "avx9":
        assert path == [p for p in BLOCK_KERNEL_PATHS if block_kernel_probe(p) == ""][0]
        assert "KVSERVE_BLOCK_KERNELS ignored (unknown block-kernel path 'avx9'" in reason
    else:
        assert path == value and f"KVSERVE_BLOCK_KERNELS={value}: {value} forced" in reason
