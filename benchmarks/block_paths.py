"""Micro-benchmark: kvserve's block-kernel paths (avx512vnni, avxvnni, avx2, portable) against each
other on every matmul of one SmolLM2 decode step (all layers' linears + the lm_head), interleaved in
one process at 1 / 8 / 32 / 128 rows; prints medians, G int8 op/s, ratios to the AVX2 path and
the measured peak of vpdpbusd, with the CPU flags and the automatic choice.

    PYTHONPATH=. python -m benchmarks.block_paths [--model DIR] [--rows 1,8,32,128] [--repeats 7]

q8 = Q8_0 blocks everywhere; q4 = Q4_1 blocks for the layers (--types times Q4_0 too) with the
head in Q8_0, as --quantization int4 serves it. Paths whose probe fails here are skipped. A path
faster than the automatic choice on this CPU is a bug in the choice: it is flagged.

    PYTHONPATH=. python -m benchmarks.block_paths --types Q8_0,Q4_0,Q4_1,Q5_0,Q5_1,Q4_K,Q5_K,Q6_K

times the GGUF block types against each other instead (interleaved, on the path --paths names
first that runs, default the automatic one), on one Llama-shaped layer whose input widths are
multiples of 256 (--shape hidden,kv,inter; K-quants need them): G int8 op/s, bytes per weight as
served, weight GB/s, and speed against Q8_0.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.quant_linears import _step_fn

PATHS = ("avx512vnni", "avxvnni", "avx2", "portable")
_PEAK_SOURCE = Path(__file__).with_name("csrc") / "vpdpbusd_peak.cpp"


def vpdpbusd_peak(isa: str, threads: int) -> float | None:
    """G int8 op/s of back-to-back vpdpbusd on `threads` cores (None without a compiler)."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "peak"
        cmd = [compiler, "-O2", "-fopenmp", str(_PEAK_SOURCE), "-o", str(exe)]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        runs = [subprocess.run([str(exe), isa, str(threads)], capture_output=True, text=True)]
        runs += [subprocess.run([str(exe), isa, str(threads)], capture_output=True, text=True)]
        rates = [float(r.stdout.split()[-1]) for r in runs if r.returncode == 0 and r.stdout]
        return max(rates) if rates else None


def _time_paths(
    fns: dict[str, Callable[[dict], None]],
    paths: list[str],
    xs: dict[int, torch.Tensor],
    repeats: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Median ms per path, the paths interleaved: each round runs every path once."""
    ops: Any = torch.ops.kvserve
    samples: dict[str, list[float]] = {p: [] for p in paths}
    for path in paths:  # warm-up
        ops.block_kernels_select(path)
        fns[path](xs)
    for _ in range(repeats):
        for path in paths:
            ops.block_kernels_select(path)
            start = clock()
            fns[path](xs)
            samples[path].append((clock() - start) * 1e3)
    return {p: statistics.median(s) for p, s in samples.items()}


def _type_weight(kind: str, w: torch.Tensor, rng: Any) -> Any:
    """`w`'s shape as a block weight of GGUF type `kind` (K-quants: valid random blocks)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from engine.models.block_q5 import Q5_BLOCK_BYTES, from_gguf_q5blocks
    from engine.models.block_quant import from_gguf_blocks, quantize_q4_1, quantize_q8_0
    from engine.models.kquant import KQUANT_BLOCK_BYTES, from_gguf_kblocks, synthetic_kblocks

    n, k = w.shape
    if kind in KQUANT_BLOCK_BYTES:
        return from_gguf_kblocks(kind, synthetic_kblocks(kind, n, k, rng), (n, k)).to_weight()
    if kind == "Q4_0":
        raw = quantize(w.numpy().astype(np.float32), GGMLQuantizationType.Q4_0)
        return from_gguf_blocks("Q4_0", raw, (n, k)).to_weight()
    if kind in Q5_BLOCK_BYTES:  # Q5_0, Q5_1 as the gguf package quantizes them
        raw = quantize(w.numpy().astype(np.float32), GGMLQuantizationType[kind])
        return from_gguf_q5blocks(kind, raw, (n, k)).to_weight()
    return (quantize_q8_0(w) if kind == "Q8_0" else quantize_q4_1(w)).to_weight()


def compare_types(
    types: list[str], shape: str, rows_list: list[int], repeats: int, clock: Callable[[], float]
) -> None:
    """Every GGUF block type on one layer's matmuls, the types interleaved in each round."""
    import numpy as np

    hidden, kv, inter = (int(v) for v in shape.split(","))
    shapes = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    floats = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    layers = {t: [_type_weight(t, w, rng) for w in floats] for t in types}
    macs = sum(n * k for n, k in shapes)
    per_weight = {t: sum(w.nbytes for w in ws) / macs for t, ws in layers.items()}
    base = "Q8_0" if "Q8_0" in types else types[0]
    print(
        f"layer {shape} (hidden, kv, inter): {macs / 1e6:.1f}M weights; cells: median ms, "
        f"G int8 op/s, weight GB/s, speed vs {base}"
    )
    print("type  bytes/weight: " + ", ".join(f"{t} {per_weight[t]:.3f}" for t in types))
    print(f"{'rows':>4} " + " ".join(f"{t:>27}" for t in types))
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        samples: dict[str, list[float]] = {t: [] for t in types}
        for t in types:  # warm-up
            for w in layers[t]:
                w.matmul(xs[w.in_features])
        for _ in range(repeats):
            for t in types:
                start = clock()
                for w in layers[t]:
                    w.matmul(xs[w.in_features])
                samples[t].append(clock() - start)
        med = {t: statistics.median(v) for t, v in samples.items()}
        cells = [
            f"{med[t] * 1e3:7.2f} {2 * macs * rows / med[t] / 1e9:6.1f} "
            f"{per_weight[t] * macs / med[t] / 1e9:5.1f} {med[base] / med[t]:4.2f}x"
            for t in types
        ]
        print(f"{rows:>4} " + " ".join(f"{c:>27}" for c in cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_utils import cpu_summary
    from engine.kernels import cpu_kernels
    from engine.models.cpu_features import block_kernel_probe
    from engine.models.loader import load_model, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path; default: the bundled SmolLM2")
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", default="q8,q4")
    parser.add_argument("--paths", default=",".join(PATHS), help="those that run here are timed")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this process's CPU time (robust on a shared machine), wall: elapsed time",
    )
    parser.add_argument("--types", default=None, help="compare GGUF block types instead")
    parser.add_argument("--shape", default="2048,512,5632", help="--types: hidden,kv,inter")
    args = parser.parse_args(argv)
    if not cpu_kernels.available():
        parser.error("the block kernels could not be built or loaded (see the log)")
    ops: Any = torch.ops.kvserve
    auto = str(ops.block_kernels_path())
    print(cpu_summary(), f"threads {torch.get_num_threads()}")
    print(f"automatic choice: {auto} ({ops.block_kernels_reason()})")
    paths = [p for p in args.paths.split(",") if block_kernel_probe(p) == ""]
    skipped = [f"{p}: {block_kernel_probe(p)}" for p in args.paths.split(",") if p not in paths]
    if skipped:
        print("skipped:", "; ".join(skipped))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.types:
        path = paths[0] if args.paths != ",".join(PATHS) else auto
        ops.block_kernels_select(path)
        print(f"path: {path}")
        with torch.inference_mode():
            counts = [int(r) for r in args.rows.split(",")]
            compare_types(args.types.split(","), args.shape, counts, args.repeats, clock)
        ops.block_kernels_select(auto)
        return 0
    threads = torch.get_num_threads()
    for isa in ("avx512vnni", "avxvnni"):
        if isa in paths:
            peak = vpdpbusd_peak(isa, threads)
            print(f"vpdpbusd peak ({isa}, {threads} threads, CPU time): {peak} G int8 op/s")
    model: Any = load_model(resolve_model(args.model), "float32", "cpu").model
    weights = [
        (getattr(owner, attr).data, attr == "lm_head_weight")
        for owner, attr in model.quantizable_weights()
    ]
    weights = [(w, head) for w, head in weights if w.shape[1] % 32 == 0]
    widths = {w.shape[1] for w, _ in weights}
    macs = sum(w.numel() for w, _ in weights)  # multiply-adds per row
    print(
        f"{len(weights)} matmuls, {macs / 1e6:.1f}M weights; cells: median {args.clock} ms, "
        "G int8 op/s, speed vs avx2"
    )
    base = "avx2" if "avx2" in paths else paths[-1]
    with torch.inference_mode():
        for fmt in args.formats.split(","):
            step = _step_fn(fmt, weights)  # the same weights for every path (layout is shared)
            fns = {p: step for p in paths}
            print(f"{fmt}: {'rows':>4} " + " ".join(f"{p:>22}" for p in paths))
            for rows in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(rows, k) for k in widths}
                med = _time_paths(fns, paths, xs, args.repeats, clock)
                cells = [
                    f"{med[p]:7.2f} {2 * macs * rows / (med[p] * 1e-3) / 1e9:6.1f} "
                    f"{med[base] / med[p]:4.2f}x"
                    for p in paths
                ]
                fastest = min(med, key=med.__getitem__)
                flag = (
                    ""
                    if fastest == auto or med[auto] <= 1.05 * med[fastest]
                    else (f"  <- {fastest} beats the automatic {auto}")
                )
                print(f"{fmt}: {rows:>4} " + " ".join(f"{c:>22}" for c in cells) + flag, flush=True)
    ops.block_kernels_select(auto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
