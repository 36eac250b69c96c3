"""Micro-benchmark: every matmul of one decode step (all layers' linears + the lm_head) at 1 / 8 / 32 /
128 rows, float32 against kvserve's block kernels, interleaved and repeated; prints medians, GFLOP/s
and ratios, with the CPU flags.

    PYTHONPATH=. python -m benchmarks.quant_linears [--model DIR] [--rows 1,8,32,128] [--repeats 7]

Formats: float32 (F.linear), q8 (Q8_0 blocks, torch.ops.kvserve.q8_linear), q4 (Q4_1 blocks,
q4_linear; the layers only, the head stays Q8_0 as --quantization int4 serves it). Both block
kernels quantize activations to int8 per row and block of 32 (batch-invariant).
KVSERVE_BLOCK_KERNELS=portable times the portable loops CPUs without AVX2+FMA+F16C get.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

FORMATS = ("float32", "q8", "q4")


def _one_matmul(fmt: str, w: torch.Tensor, head: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The matmul of one [out, in] weight in `fmt`."""
    from engine.models.block_quant import BlockQ4Weight, BlockQ8Weight, quantize_q4_1, quantize_q8_0

    if fmt == "float32":
        return functools.partial(F.linear, weight=w)
    if fmt == "q8" or (fmt == "q4" and head):
        return BlockQ8Weight(quantize_q8_0(w)).matmul
    if fmt == "q4":
        return BlockQ4Weight(quantize_q4_1(w)).matmul
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def _step_fn(fmt: str, weights: list[tuple[torch.Tensor, bool]]) -> Callable[[dict], None]:
    """A function running every matmul once, on inputs keyed by input width."""
    calls = [(w.shape[1], _one_matmul(fmt, w, head)) for w, head in weights]

    def step(xs: dict[int, torch.Tensor]) -> None:
        for k, call in calls:
            call(xs[k])

    return step


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_utils import cpu_summary
    from engine.kernels import cpu_kernels
    from engine.models.loader import load_model, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path; default: the bundled SmolLM2")
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this process's CPU time (robust on a shared, oversubscribed machine; "
        "use with 1 thread), wall: elapsed time",
    )
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if any(f != "float32" for f in formats) and not cpu_kernels.available():
        parser.error("the block kernels could not be built or loaded (see the log)")
    vectorized = (
        bool(torch.ops.kvserve.block_kernels_vectorized()) if cpu_kernels.available() else False
    )
    print(cpu_summary(), f"threads {torch.get_num_threads()}")
    print(f"block kernels running: {'AVX2+FMA+F16C' if vectorized else 'portable loops'}")
    model: Any = load_model(resolve_model(args.model), "float32", "cpu").model
    weights = [
        (getattr(owner, attr).data, attr == "lm_head_weight")
        for owner, attr in model.quantizable_weights()
    ]
    weights = [(w, head) for w, head in weights if w.shape[1] % 32 == 0]
    widths = {w.shape[1] for w, _ in weights}
    macs = sum(w.numel() for w, _ in weights)  # multiply-adds per row
    print(
        f"{len(weights)} matmuls ({len(weights) - 1} linears + lm_head), {macs / 1e6:.1f}M weights"
    )
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    fns = {fmt: _step_fn(fmt, weights) for fmt in formats}
    print(
        f"{'rows':>4} "
        + " ".join(f"{f:>22}" for f in formats)
        + f"   (median {args.clock} ms, GFLOP/s, x = speed vs float32)"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in widths}
            samples: dict[str, list[float]] = {f: [] for f in formats}
            for fmt in formats:
                fns[fmt](xs)  # warm-up
            for _ in range(args.repeats):  # interleaved: each round runs every format once
                for fmt in formats:
                    start = clock()
                    fns[fmt](xs)
                    samples[fmt].append((clock() - start) * 1e3)
            med = {f: statistics.median(s) for f, s in samples.items()}
            base = med.get("float32")
            cells = []
            for f in formats:
                gflops = 2 * macs * rows / (med[f] * 1e-3) / 1e9
                ratio = f" {base / med[f]:4.1f}x" if base else ""
                cells.append(f"{med[f]:7.1f} {gflops:6.1f}{ratio}")
            print(f"{rows:>4} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
