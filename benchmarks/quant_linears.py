"""Micro-benchmark: every matmul of one decode step (all layers' linears + the lm_head) at 1 / 8 / 32
rows, float32 against each weight format, interleaved and repeated; prints medians and ratios.

    PYTHONPATH=. python -m benchmarks.quant_linears [--model DIR] [--rows 1,8,32] [--repeats 7]

Formats: float32, int8 (kvserve's: per-row activation scales, batch-invariant), int8-batch (fbgemm's
plain dynamic linear: one activation scale per batch, NOT batch-invariant; the kernel's own speed),
bfloat16, int4 (torch's weight-only kernel).
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

FORMATS = ("float32", "int8", "int8-batch", "bfloat16", "int4")


def _step_fn(fmt: str, weights: list[torch.Tensor]) -> Callable[[dict[int, torch.Tensor]], None]:
    """A function running every matmul once, on inputs keyed by input width (negative: bf16)."""
    calls: list[tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = []
    for w in weights:
        calls.append(_one_matmul(fmt, w))

    def step(xs: dict[int, torch.Tensor]) -> None:
        for key, call in calls:
            call(xs[key])

    return step


def _one_matmul(fmt: str, w: torch.Tensor) -> tuple[int, Callable[[torch.Tensor], torch.Tensor]]:
    """(input key, the matmul) for one weight in `fmt`."""
    from engine.models.quantization import Int4Weight, Int8Weight, linear

    k = w.shape[1]
    if fmt == "float32":
        return k, functools.partial(F.linear, weight=w)
    if fmt == "bfloat16":
        return -k, functools.partial(F.linear, weight=w.to(torch.bfloat16))
    if fmt == "int8":
        return k, functools.partial(linear, weight=Int8Weight(w))
    if fmt == "int8-batch":
        packed = Int8Weight(w).packed
        return k, lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)
    if fmt == "int4":
        return k, functools.partial(linear, weight=Int4Weight(w, 32))
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def _inputs(rows: int, widths: set[int]) -> dict[int, torch.Tensor]:
    xs: dict[int, torch.Tensor] = {}
    for k in widths:
        xs[k] = torch.randn(rows, k)
        xs[-k] = xs[k].to(torch.bfloat16)  # negative key: the bf16 copy
    return xs


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_utils import cpu_summary
    from engine.models.loader import load_model, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path; default: the bundled SmolLM2")
    parser.add_argument("--rows", default="1,8,32")
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
    print(cpu_summary(), f"threads {torch.get_num_threads()}")
    model: Any = load_model(resolve_model(args.model), "float32", "cpu").model
    weights = [getattr(owner, attr).data for owner, attr in model.quantizable_weights()]
    widths = {w.shape[1] for w in weights}
    print(f"{len(weights)} matmuls ({len(weights) - 1} linears + lm_head), "
          f"{sum(w.numel() for w in weights) / 1e6:.1f}M weights")  # fmt: skip
    formats = args.formats.split(",")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    fns = {fmt: _step_fn(fmt, weights) for fmt in formats}
    print(
        f"{'rows':>4} "
        + " ".join(f"{f:>11}" for f in formats)
        + f"   (median {args.clock} ms; x = vs float32)"
    )
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = _inputs(rows, widths)
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
            cells = [
                f"{med[f]:7.1f}" + (f" {base / med[f]:4.1f}x" if base else "") for f in formats
            ]
            print(f"{rows:>4} " + " ".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
