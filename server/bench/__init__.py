"""`kvserve bench`: a small load generator for any OpenAI-compatible server (request driver, latency
statistics, table/JSON report). Installed with kvserve; the repo's benchmarks/ scripts build on it."""

from __future__ import annotations

from server.bench.cli import build_parser, config_from_args, format_table, main
from server.bench.driver import (
    BenchConfig,
    HttpClient,
    build_body,
    first_model_id,
    http_get,
    open_client,
    run_benchmark,
    run_benchmark_async,
    send_request,
)
from server.bench.metrics import RequestRecord, compute_metrics, percentile, ratio, summarize
from server.bench.prompts import TextTokenizer, load_tokenizer, synthetic_prompts

__all__ = [
    "BenchConfig",
    "HttpClient",
    "RequestRecord",
    "TextTokenizer",
    "build_body",
    "build_parser",
    "compute_metrics",
    "config_from_args",
    "first_model_id",
    "format_table",
    "http_get",
    "load_tokenizer",
    "main",
    "open_client",
    "percentile",
    "ratio",
    "run_benchmark",
    "run_benchmark_async",
    "send_request",
    "summarize",
    "synthetic_prompts",
]
