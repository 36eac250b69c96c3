"""`kvserve bench` options and report: parse the flags into a BenchConfig, run it, print the table
and optionally write the metrics as JSON."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any

from server.bench.driver import HTTP_CLIENTS, BenchConfig, run_benchmark

# ---------------------------------------------------------------- reporting


def _fmt(value: float, digits: int = 2) -> str:
    return "n/a" if isinstance(value, float) and math.isnan(value) else f"{value:,.{digits}f}"


def format_table(metrics: dict[str, Any]) -> str:
    """A plain-text report of one run's metrics."""
    cfg = metrics.get("config", {})
    load = (f"rate {cfg.get('request_rate')} req/s" if cfg.get("request_rate") else "") + (
        f" concurrency {cfg.get('concurrency')}" if cfg.get("concurrency") else ""
    )
    rows = [
        ("Target", f"{cfg.get('url', '?')} ({load.strip()})"),
        ("Input / output tokens", f"{cfg.get('input_len')} / {cfg.get('output_len')}"),
        (
            "Completed / failed / cancelled",
            f"{metrics['completed']} / {metrics['failed']} / {metrics['cancelled']}",
        ),
        ("Duration (s)", _fmt(metrics["duration_s"])),
        ("Request throughput (req/s)", _fmt(metrics["request_throughput"], 3)),
        ("Output token throughput (tok/s)", _fmt(metrics["output_throughput"])),
        ("Total token throughput (tok/s)", _fmt(metrics["total_token_throughput"])),
    ]
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        for stat, value in metrics[key].items():
            rows.append((f"{label} {stat} (ms)", _fmt(value)))
    for error in metrics.get("errors", []):
        rows.append(("Error", error))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvserve bench",
        description="Benchmark an OpenAI-compatible server with synthetic streamed requests.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--model", default=None, help="model name to send (default: first of /v1/models)"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    p.add_argument("--num-requests", type=int, default=32, help="requests to send (after warm-up)")
    p.add_argument(
        "--max-seconds", type=float, default=120.0, help="stop (and cancel) after this long"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight (default 8 without a rate)",
    )
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="omit ignore_eos (servers that reject it)"
    )
    p.add_argument("--no-stream", action="store_true", help="non-streamed requests (TTFT = E2E)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="model folder for prompt lengths; 'auto' = kvserve's bundled model; 'none' = words",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed requests sent first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument(
        "--percentiles",
        default="99",
        help="comma-separated latency percentiles (mean and median always)",
    )
    p.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="auto",
        help="HTTP client library (auto: aiohttp where installed, about half httpx's CPU a chunk)",
    )
    p.add_argument("--json-out", default=None, help="write the metrics as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    concurrency = args.concurrency
    if concurrency is None and args.request_rate is None:
        concurrency = 8
    if concurrency is not None and concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError("--request-rate must be positive")
    if args.num_requests < 1 or args.output_len < 1:
        raise ValueError("--num-requests and --output-len must be at least 1")
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        max_seconds=args.max_seconds,
        concurrency=concurrency,
        request_rate=args.request_rate,
        ignore_eos=not args.no_ignore_eos,
        stream=not args.no_stream,
        extra_body=extra,
        tokenizer=args.tokenizer,
        warmup=args.warmup,
        seed=args.seed,
        timeout=args.timeout,
        percentiles=tuple(float(q) for q in args.percentiles.split(",") if q.strip()),
        progress=not args.no_progress,
        http_client=args.http_client,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = config_from_args(args)
        metrics = run_benchmark(config)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        print(format_table(metrics), flush=True)
    except BrokenPipeError:  # `kvserve bench ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(metrics, f, indent=2)
    return 0 if metrics["completed"] else 1
