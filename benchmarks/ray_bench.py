"""kvserve on Ray Serve: 1 vs 2 replicas (one thread each) on a shared-prefix workload (a few long
documents, many questions each) and a distinct-prompt workload, with kvserve's prefix-affinity
router and Ray's default power-of-two router. Prints throughput, median TTFT and the prefix cache
hit rate (cached / prompt tokens, as the responses' usage reports them), and ratios.

    PYTHONPATH=. python -m benchmarks.ray_bench [--model DIR] [--requests 32] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_utils import ServerProcess, free_port

logger = logging.getLogger(__name__)
WORDS = (
    "river stone cloud maple harbor lantern orbit meadow copper violin quartz tiger "
    "canyon ember glacier falcon willow marble thunder saffron"
).split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workloads(num_requests: int, doc_words: int, num_docs: int) -> dict[str, list[str]]:
    rng = random.Random(7)
    docs = [text(rng, doc_words) for _ in range(num_docs)]
    shared = [
        f"Document {i % num_docs}: {docs[i % num_docs]}\nQuestion {i}: {text(rng, 12)}?\nAnswer:"
        for i in range(num_requests)
    ]
    distinct = [
        f"Document: {text(rng, doc_words)}\nQuestion: {text(rng, 12)}?\nAnswer:"
        for _ in range(num_requests)
    ]
    return {"shared-prefix": shared, "distinct": distinct}


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - start,
        "prompt": usage.get("prompt_tokens", 0),
        "cached": cached,
        "output": usage.get("completion_tokens", 0),
    }


async def run_workload(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one(client, "warm up", 2)

        async def limited(p: str) -> dict[str, float]:
            async with limit:
                return await one(client, p, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    prompt_tokens = sum(r["prompt"] for r in results)
    return {
        "req_per_s": len(results) / elapsed,
        "out_tok_per_s": sum(r["output"] for r in results) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in results),
        "prefix_hit_rate": sum(r["cached"] for r in results) / max(prompt_tokens, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the bundled model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=300)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvserve-ray-bench"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    flags = (
        " ".join(
            f
            for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
            if f in Path("/proc/cpuinfo").read_text()
        )
        if Path("/proc/cpuinfo").exists()
        else "?"
    )
    print(f"# {platform.processor() or platform.machine()}; CPU flags: {flags}")
    loads = workloads(args.requests, args.doc_words, args.docs)
    configs = [(1, "pow2"), (2, "pow2"), (2, "prefix")]
    table: dict[tuple[int, str, str], dict] = {}
    for replicas, router in configs:
        port = free_port()
        argv_ = [sys.executable, "-m", "server", "serve", *([args.model] if args.model else []),
                 "--port", str(port), "--replicas", str(replicas), "--threads", "1",
                 "--replica-cpus", "1", "--request-router", router, "--max-model-len", "2048",
                 "--log-level", "warning", "--log-stats-interval", "0"]  # fmt: skip
        env = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        with ServerProcess(f"ray-{replicas}-{router}", argv_, port, args.log_dir, env) as server:
            server.wait_healthy(timeout=600)
            for name, prompts in loads.items():
                result = asyncio.run(
                    run_workload(server.base_url, prompts, args.concurrency, args.max_tokens)
                )
                table[(replicas, router, name)] = result
                logger.info("%d replica(s), %s, %s: %s", replicas, router, name, result)
    print("| replicas | router | workload | req/s | output tok/s | TTFT p50 ms | prefix hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (replicas, router, name), r in table.items():
        print(
            f"| {replicas} | {router} | {name} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} | {r['prefix_hit_rate']:.2f} |"
        )
    for name in loads:
        one_ = table[(1, "pow2", name)]
        for router in ("pow2", "prefix"):
            two = table[(2, router, name)]
            print(
                f"{name}: 2 replicas ({router}) / 1 replica: throughput x"
                f"{two['req_per_s'] / one_['req_per_s']:.2f}, TTFT x"
                f"{two['ttft_p50_ms'] / one_['ttft_p50_ms']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
