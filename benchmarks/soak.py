"""Soak test on loopback: many mixed requests (streamed, non-streamed, chat, aborted streams) against
kvserve, reporting server resident memory and KV cache usage before and after. Bounded in count and time."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.bench_utils import ServerProcess, free_port
from server.bench import http_get, synthetic_prompts

logger = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
KINDS = ("stream", "plain", "chat", "abort")


def server_pid(port: int) -> int | None:
    """The pid listening on a loopback `port` (needs psutil and permission to see sockets)."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    except psutil.AccessDenied:
        return None
    return None


def rss_mb(pid: int | None) -> float:
    """Resident memory of `pid` and its children, in MB (NaN when unknown)."""
    if pid is None:
        return float("nan")
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs) / 1e6
    except psutil.Error:
        return float("nan")


def kv_usage(base_url: str) -> dict[str, Any]:
    """KV usage and running counts from /v1/internal/stats, else the Prometheus /metrics gauge."""
    try:
        status, body = http_get(base_url + "/v1/internal/stats")
        if status == 200:
            stats = json.loads(body)
            return {
                k: stats.get(k)
                for k in ("kv_cache_usage", "num_running", "num_waiting", "num_free_blocks")
            }
        status, body = http_get(base_url + "/metrics")
        if status == 200:
            for line in body.splitlines():
                if line.startswith("kvserve_kv_cache_usage_ratio"):
                    return {"kv_cache_usage": float(line.rsplit(" ", 1)[1])}
    except (OSError, ValueError):
        pass
    return {"kv_cache_usage": None}


def snapshot(base_url: str, pid: int | None) -> dict[str, Any]:
    return {"rss_mb": rss_mb(pid), **kv_usage(base_url)}


async def one_request(
    client: httpx.AsyncClient, base_url: str, kind: str, prompt: str, rng: random.Random
) -> str:
    """Send one request of `kind`; return 'ok', 'aborted' or an error description."""
    max_tokens = rng.randint(1, 64)
    body: dict[str, Any]
    if kind == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
    else:
        url, body = "/v1/completions", {"prompt": prompt}
    body.update(
        {
            "max_tokens": max_tokens,
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": rng.randint(0, 99),
        }
    )
    if kind != "plain":
        body.update({"stream": True, "stream_options": {"include_usage": True}})
    if kind == "plain":
        response = await client.post(base_url + url, json=body)
        return "ok" if response.status_code == 200 else f"HTTP {response.status_code}"
    abort_after = rng.randint(1, 4) if kind == "abort" else None
    chunks = 0
    async with client.stream("POST", base_url + url, json=body) as response:
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    return "aborted"  # leaving the block closes the connection mid-stream
    return "ok"


async def soak(base_url: str, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    rng = random.Random(args.seed)
    lengths = [rng.choice([8, 32, 128, 512]) for _ in range(args.num_requests)]
    prompts = [synthetic_prompts(1, n, None, seed=i)[0] for i, n in enumerate(lengths)]
    kinds = rng.choices(KINDS, weights=(4, 2, 2, 2), k=args.num_requests)
    outcomes: dict[str, int] = {}
    samples: list[float] = []
    semaphore = asyncio.Semaphore(args.concurrency)
    deadline = time.perf_counter() + args.max_seconds

    async def run(kind: str, prompt: str, index: int) -> None:
        async with semaphore:
            if time.perf_counter() > deadline:
                outcomes["skipped (time)"] = outcomes.get("skipped (time)", 0) + 1
                return
            try:
                result = await one_request(client, base_url, kind, prompt, random.Random(index))
            except httpx.HTTPError as e:
                result = type(e).__name__
            key = result if result in ("ok", "aborted") else f"error: {result}"
            outcomes[key] = outcomes.get(key, 0) + 1
            if index % max(1, args.num_requests // 10) == 0:
                samples.append(rss_mb(pid))

    async with httpx.AsyncClient(timeout=300.0) as client:
        await asyncio.gather(
            *(run(k, p, i) for i, (k, p) in enumerate(zip(kinds, prompts, strict=True)))
        )
    return {"outcomes": outcomes, "rss_samples_mb": samples}


def wait_idle(base_url: str, timeout: float = 30.0) -> None:
    """Wait until the engine reports nothing running or waiting (aborts are asynchronous)."""
    end = time.perf_counter() + timeout
    while time.perf_counter() < end:
        stats = kv_usage(base_url)
        if not stats.get("num_running") and not stats.get("num_waiting"):
            return
        time.sleep(0.5)


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK:
        raise ValueError(f"soak only targets loopback servers; {url!r} is not 127.0.0.1/localhost")
    return url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", default=None, help="a running kvserve on loopback (default: start one)")
    p.add_argument("--model", default=None, help="model for the started server (default: bundled)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--server-args", default="", help="extra `kvserve serve` arguments")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup-requests", type=int, default=8, help="mixed requests before 'before'")
    p.add_argument("--max-seconds", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json-out", default=None)
    return p


def run(base_url: str, args: argparse.Namespace, pid: int | None) -> dict[str, Any]:
    if args.warmup_requests:  # first-use allocations (kernels, buffers) are not leaks
        warm = argparse.Namespace(
            **{**vars(args), "num_requests": args.warmup_requests, "seed": -1}
        )
        asyncio.run(soak(base_url, warm, None))
    wait_idle(base_url)
    before = snapshot(base_url, pid)
    start = time.perf_counter()
    result = asyncio.run(soak(base_url, args, pid))
    seconds = time.perf_counter() - start
    wait_idle(base_url)
    after = snapshot(base_url, pid)
    healthy = http_get(base_url + "/health")[0] == 200
    return {
        "before": before,
        "after": after,
        "seconds": seconds,
        "healthy_after": healthy,
        **result,
    }


def format_report(report: dict[str, Any]) -> str:
    b, a = report["before"], report["after"]
    samples = ", ".join(f"{s:.0f}" for s in report["rss_samples_mb"])
    return "\n".join(
        [
            f"soak: {sum(report['outcomes'].values())} requests in {report['seconds']:.1f}s: {report['outcomes']}",
            f"server RSS: before {b['rss_mb']:.0f} MB, after {a['rss_mb']:.0f} MB "
            f"(delta {a['rss_mb'] - b['rss_mb']:+.0f} MB); during: {samples}",
            f"KV cache usage: before {b.get('kv_cache_usage')}, after {a.get('kv_cache_usage')}; "
            f"running after {a.get('num_running')}, waiting after {a.get('num_waiting')}",
            f"healthy after: {report['healthy_after']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.url:
            base_url = check_loopback(args.url)
            report = run(base_url, args, server_pid(urlparse(base_url).port or 80))
        else:
            import shlex

            from engine.models.loader import resolve_model

            port = free_port()
            argv_ = [sys.executable, "-m", "server", "serve", str(resolve_model(args.model))]
            argv_ += ["--port", str(port), "--dtype", args.dtype, *shlex.split(args.server_args)]
            log_dir = Path(args.log_dir or "/tmp")
            with ServerProcess(
                "kvserve-soak", argv_, port, log_dir, {"HF_HUB_OFFLINE": "1"}
            ) as server:
                server.wait_healthy(timeout=300)
                assert server.proc is not None
                report = run(server.base_url, args, server.proc.pid)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    errors = sum(n for k, n in report["outcomes"].items() if k.startswith("error"))
    return 0 if report["healthy_after"] and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
