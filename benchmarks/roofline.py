"""Roofline for this machine: measured matmul throughput and memory bandwidth, the model's FLOPs and
bytes per token, and kvserve's achieved fraction of each limit (saturated throughput, batch-1 ITL)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _time_op(op: Callable[[], object], min_seconds: float, trial_seconds: float = 0.05) -> float:
    """Seconds per call of `op`: the best of short trials over `min_seconds` (a shared machine's
    noise only ever slows a trial down, so the fastest trial is the closest to the hardware)."""
    for _ in range(2):
        op()
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < min_seconds or best == math.inf:
        calls, trial_start = 0, time.perf_counter()
        while True:
            op()
            calls += 1
            elapsed = time.perf_counter() - trial_start
            if elapsed >= trial_seconds:
                break
        best = min(best, elapsed / calls)
    return best


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, min_seconds: float = 0.5) -> float:
    """GFLOP/s of F.linear([m, k], [n, k]) -> [m, n], the kernel a model's linear layers hit."""
    x = torch.randn(m, k, dtype=dtype)  # [m, k]
    w = torch.randn(n, k, dtype=dtype)  # [n, k]
    seconds = _time_op(lambda: F.linear(x, w), min_seconds)
    return 2.0 * m * k * n / seconds / 1e9


def memory_bandwidth(num_bytes: int = 1 << 28, min_seconds: float = 0.5) -> dict[str, float]:
    """GB/s of a large copy (read + write bytes) and of a streaming read (a sum)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _time_op(lambda: dst.copy_(src), min_seconds)
    read_s = _time_op(lambda: src.sum(), min_seconds)
    return {"copy_gbps": 2 * num_bytes / copy_s / 1e9, "read_gbps": num_bytes / read_s / 1e9}


@dataclass
class ModelCost:
    params_matmul: int  # weights multiplied per token (incl. lm_head)
    flops_per_token: float  # forward FLOPs per token at `context_len`
    weight_bytes: float  # bytes read per decode step for the weights
    kv_bytes_per_token: float  # K+V bytes per token of context, all layers
    context_len: int


def model_cost(config: dict[str, Any], weight_bits: float, context_len: int) -> ModelCost:
    """FLOPs and bytes per token of a Llama-family decoder described by its config.json."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    inter = config["intermediate_size"]
    layers = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o; k, v
    per_layer = attn + 3 * h * inter  # SwiGLU: gate, up, down
    params = layers * per_layer + h * vocab  # lm_head (tied or not, it is read every step)
    attention_flops = layers * 4 * heads * head_dim * context_len  # QK^T and AV
    kv_bytes = layers * 2 * kv_heads * head_dim * 2  # bf16/fp16 cache
    return ModelCost(
        params_matmul=params,
        flops_per_token=2.0 * params + attention_flops,
        weight_bytes=params * weight_bits / 8,
        kv_bytes_per_token=kv_bytes,
        context_len=context_len,
    )


def measure_machine(config: dict[str, Any], min_seconds: float, square: int) -> dict[str, Any]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "matmul_gflops": {}}
    for name in ("bfloat16", "float32"):
        dtype = DTYPES[name]
        shapes = {f"square {square}": matmul_gflops(square, square, square, dtype, min_seconds)}
        for m in (1, 8, 32, 128, 512):
            shapes[f"[{m},{h}]x[{h},{inter}]"] = matmul_gflops(m, h, inter, dtype, min_seconds)
        out["matmul_gflops"][name] = shapes
        logger.info("%s matmul: %s", name, {k: round(v, 1) for k, v in shapes.items()})
    out["memory"] = memory_bandwidth(min_seconds=min_seconds)
    return out


# ---------------------------------------------------------------- kvserve results


def load_result(path: str, concurrency: int | None = None) -> dict[str, Any]:
    """A `kvserve bench --json-out` JSON, or the kvserve entry at `concurrency` of a compare.py JSON."""
    data = json.loads(Path(path).read_text())
    if "output_throughput" in data:
        return data
    runs = data.get("results", {}).get("kvserve", {})
    key = str(concurrency)
    if key not in runs:
        raise ValueError(f"{path} has no kvserve result at concurrency {concurrency}")
    return runs[key]


def run_workload(url: str, concurrency: int, num_requests: int, args: argparse.Namespace) -> dict:
    from server.bench import BenchConfig, run_benchmark

    config = BenchConfig(
        base_url=url,
        concurrency=concurrency,
        num_requests=num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        max_seconds=args.max_seconds,
        tokenizer=args.tokenizer,
    )
    return run_benchmark(config)


def analyse(
    machine: dict[str, Any],
    cost: ModelCost,
    dtype: str,
    saturation: dict[str, Any] | None,
    batch1: dict[str, Any] | None,
) -> dict[str, Any]:
    peaks = machine["matmul_gflops"][dtype]
    peak = max(peaks.values())
    bandwidth = machine["memory"]["read_gbps"]
    decode_bytes = cost.weight_bytes + cost.kv_bytes_per_token * cost.context_len
    limit_itl_ms = decode_bytes / (bandwidth * 1e9) * 1e3
    report: dict[str, Any] = {
        "dtype": dtype,
        "peak_gflops": peak,
        "read_bandwidth_gbps": bandwidth,
        "model_gflop_per_token": cost.flops_per_token / 1e9,
        "weight_mb": cost.weight_bytes / 1e6,
        "compute_limit_tokens_per_s": peak * 1e9 / cost.flops_per_token,
        "bandwidth_limit_itl_ms": limit_itl_ms,
    }
    if saturation:
        achieved = saturation["total_token_throughput"] * cost.flops_per_token / 1e9
        report["saturation"] = {
            "concurrency": saturation.get("config", {}).get("concurrency"),
            "output_tok_s": saturation["output_throughput"],
            "total_tok_s": saturation["total_token_throughput"],
            "achieved_gflops": achieved,
            "fraction_of_compute_limit": achieved / peak,
        }
    if batch1:
        itl = batch1["itl_ms"]["median"]
        if math.isnan(itl):
            itl = batch1["tpot_ms"]["median"]
        report["batch1"] = {
            "itl_median_ms": itl,
            "itl_over_limit": itl / limit_itl_ms,
            "fraction_of_bandwidth_limit": limit_itl_ms / itl,
        }
    return report


def format_report(machine: dict[str, Any], cost: ModelCost, report: dict[str, Any]) -> str:
    lines = [f"torch threads: {machine['threads']}"]
    for dtype, shapes in machine["matmul_gflops"].items():
        for shape, gflops in shapes.items():
            lines.append(f"  matmul {dtype:<9} {shape:<22} {gflops:8.1f} GFLOP/s")
    mem = machine["memory"]
    lines.append(
        f"  memory copy {mem['copy_gbps']:.1f} GB/s (read+write), read {mem['read_gbps']:.1f} GB/s"
    )
    lines += [
        f"model: {cost.params_matmul / 1e6:.1f} M matmul weights, "
        f"{report['model_gflop_per_token']:.3f} GFLOP/token at context {cost.context_len}, "
        f"{report['weight_mb']:.0f} MB weights read per decode step",
        f"compute limit ({report['dtype']}, {report['peak_gflops']:.0f} GFLOP/s): "
        f"{report['compute_limit_tokens_per_s']:.0f} tokens/s (prefill + decode)",
        f"bandwidth limit: batch-1 decode ITL >= {report['bandwidth_limit_itl_ms']:.2f} ms",
    ]
    if "saturation" in report:
        s = report["saturation"]
        lines.append(
            f"saturation (concurrency {s['concurrency']}): {s['total_tok_s']:.1f} total tok/s "
            f"({s['output_tok_s']:.1f} output) = {s['achieved_gflops']:.1f} GFLOP/s = "
            f"{100 * s['fraction_of_compute_limit']:.1f}% of the compute limit"
        )
    if "batch1" in report:
        b = report["batch1"]
        lines.append(
            f"batch-1 decode: median ITL {b['itl_median_ms']:.2f} ms = {b['itl_over_limit']:.2f}x "
            f"the bandwidth limit ({100 * b['fraction_of_bandwidth_limit']:.1f}% of it)"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="model folder (default: kvserve's bundled model)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="served dtype")
    p.add_argument(
        "--weight-bits",
        type=float,
        default=None,
        help="bits per weight (default: from dtype; 8/4 for int8/int4)",
    )
    p.add_argument(
        "--context", type=int, default=160, help="context length for attention FLOPs/KV bytes"
    )
    p.add_argument("--square", type=int, default=2048, help="square matmul size for the peak")
    p.add_argument("--min-seconds", type=float, default=0.5, help="timing per measurement")
    p.add_argument("--url", default=None, help="run concurrency-1 and saturation workloads here")
    p.add_argument(
        "--saturation-json", default=None, help="kvserve bench (or compare) JSON at saturation"
    )
    p.add_argument(
        "--batch1-json", default=None, help="kvserve bench (or compare) JSON at concurrency 1"
    )
    p.add_argument("--saturation-concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64, help="requests at saturation (--url)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-seconds", type=float, default=180.0)
    p.add_argument("--tokenizer", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json-out", default=None)
    return p


def _model_config(model: str | None) -> dict[str, Any]:
    from engine.models.loader import resolve_model

    return json.loads((resolve_model(model) / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = _model_config(args.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    bits = args.weight_bits or (32 if args.dtype == "float32" else 16)
    cost = model_cost(config, bits, args.context)
    saturation = batch1 = None
    if args.url:
        batch1 = run_workload(args.url, 1, max(4, args.num_requests // 8), args)
        saturation = run_workload(args.url, args.saturation_concurrency, args.num_requests, args)
    if args.saturation_json:
        saturation = load_result(args.saturation_json, args.saturation_concurrency)
    if args.batch1_json:
        batch1 = load_result(args.batch1_json, 1)
    machine = measure_machine(config, args.min_seconds, args.square)
    report = analyse(machine, cost, args.dtype, saturation, batch1)
    print(format_report(machine, cost, report))
    if args.json_out:
        payload = {"machine": machine, "model": asdict(cost), "report": report}
        Path(args.json_out).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
