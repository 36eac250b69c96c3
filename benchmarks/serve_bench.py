"""Load generator for any OpenAI-compatible server: streamed completions or chat at a fixed concurrency
or a Poisson request rate, reporting throughput and TTFT/TPOT/ITL/E2E latency as a table and JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from benchmarks.bench_utils import (
    RequestRecord,
    compute_metrics,
    first_model_id,
    load_tokenizer,
    synthetic_prompts,
)

logger = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # None -> the first id of /v1/models, else omitted
    input_len: int = 128
    output_len: int = 64
    num_requests: int = 32
    max_seconds: float = 120.0
    concurrency: int | None = 8
    request_rate: float | None = None  # requests/s (Poisson); None -> as fast as concurrency allows
    ignore_eos: bool = True
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = "auto"
    warmup: int = 1
    seed: int = 0
    timeout: float = 600.0
    percentiles: tuple[float, ...] = (99,)
    progress: bool = True


def build_body(config: BenchConfig, prompt: str, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": config.output_len, "temperature": 0.0}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if model:
        body["model"] = model
    if config.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord
) -> RequestRecord:
    """POST one request and fill `record` with chunk arrival times and token counts."""
    try:
        if body.get("stream"):
            await _send_streaming(client, url, body, record)
        else:
            response = await client.post(url, json=body)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            _read_usage(response.json().get("usage") or {}, record)
        record.end = time.perf_counter()
        record.ok = record.error is None
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as e:  # noqa: BLE001 - every failure is counted, never fatal to the run
        record.error = f"{type(e).__name__}: {e}"[:300]
        record.end = time.perf_counter()
    return record


async def _send_streaming(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord
) -> None:
    usage: dict[str, Any] | None = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {response.status_code}: {text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            if _chunk_text(chunk):
                record.chunk_times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if usage:
        _read_usage(usage, record)
    else:  # no usage: count one token per text chunk
        record.output_tokens = len(record.chunk_times)
    if record.output_tokens and not record.chunk_times:
        raise RuntimeError("the stream carried no text")


def _read_usage(usage: dict[str, Any], record: RequestRecord) -> None:
    record.prompt_tokens = usage.get("prompt_tokens") or 0
    record.output_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens") or 0


def _endpoint_url(config: BenchConfig) -> str:
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    return config.base_url.rstrip("/") + path


async def run_benchmark_async(config: BenchConfig) -> dict[str, Any]:
    """Run the workload and return the metrics dict (also carries the config and prompt length)."""
    if config.concurrency is None and config.request_rate is None:
        raise ValueError("give a --concurrency, a --request-rate, or both")
    tokenizer = load_tokenizer(config.tokenizer)
    prompts = synthetic_prompts(
        config.num_requests + config.warmup, config.input_len, tokenizer, config.seed
    )
    model = config.model or first_model_id(config.base_url)
    url = _endpoint_url(config)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for prompt in prompts[: config.warmup]:
            warm = await send_request(
                client, url, build_body(config, prompt, model), RequestRecord(time.perf_counter())
            )
            if not warm.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {warm.error}")
        records, duration = await _drive(client, url, config, prompts[config.warmup :], model)
    metrics = compute_metrics(records, duration, config.percentiles)
    metrics["config"] = {**asdict(config), "model": model, "url": url}
    return metrics


async def _drive(
    client: httpx.AsyncClient,
    url: str,
    config: BenchConfig,
    prompts: Sequence[str],
    model: str | None,
) -> tuple[list[RequestRecord], float]:
    """Issue requests under the concurrency cap and arrival process until done or out of time."""
    rng = random.Random(config.seed + 1)
    semaphore = asyncio.Semaphore(config.concurrency or len(prompts) or 1)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord]] = []
    progress = _progress_bar(config, len(prompts))
    start = time.perf_counter()
    deadline = start + config.max_seconds

    async def one(prompt: str) -> RequestRecord:
        async with semaphore:
            record = RequestRecord(time.perf_counter())
            records.append(record)
            if time.perf_counter() >= deadline:
                record.error = "cancelled"
                return record
            await send_request(client, url, build_body(config, prompt, model), record)
            if progress is not None:
                progress.update(1)
            return record

    for prompt in prompts:
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(prompt)))
        if config.request_rate:
            await asyncio.sleep(rng.expovariate(config.request_rate))
        else:
            await asyncio.sleep(0)
    remaining = max(0.0, deadline - time.perf_counter())
    _done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    unsent = len(prompts) - len(records)  # never started: cut off by the deadline
    records.extend(RequestRecord(start, error="cancelled") for _ in range(unsent))
    finished = [r.end for r in records if r.ok]
    duration = (max(finished) if finished else time.perf_counter()) - start
    if pending:
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return records, duration


def _progress_bar(config: BenchConfig, total: int) -> Any:
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, leave=False)


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    return asyncio.run(run_benchmark_async(config))


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
    print(format_table(metrics))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(metrics, f, indent=2)
    return 0 if metrics["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
