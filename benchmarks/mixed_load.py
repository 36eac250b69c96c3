"""Mixed load against several kvserve variants side by side: the same requests (streamed and whole
completions and chats, 20-400-word prompts, aborted streams, JSON-schema, tool and score requests)
at one concurrency, each round sent to every variant in turn (order rotated), so a shared machine's
drift hits all variants alike. Prints p50 / p99 / max inter-token latency of the streams, TTFT and
total output tokens/s per variant, and each variant's ratio to the first.

    python -m benchmarks.mixed_load --rounds 3 --requests 48 \
        --variant fixed="--target-step-ms 0" --variant step150="--target-step-ms 150"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_utils import ServerProcess, cpu_summary, free_port
from server.bench import synthetic_prompts

logger = logging.getLogger(__name__)

# kind -> weight; the streamed kinds give the inter-token latencies
KINDS = {
    "stream": 4,
    "chat_stream": 3,
    "plain": 2,
    "chat": 2,
    "abort": 2,
    "json_schema": 1,
    "tool": 1,
    "score": 1,
}
STREAMED = {"stream", "chat_stream", "abort", "json_schema", "tool"}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass(frozen=True)
class Request:
    kind: str
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    abort_after: int  # chunks before an "abort" closes its stream


@dataclass
class Result:
    kind: str
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between content chunks
    error: str = ""


def make_requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    out = []
    for i, kind in enumerate(kinds):
        words = rng.randint(20, 400)
        prompt = synthetic_prompts(1, words, None, seed=seed * 100_003 + i)[0]
        out.append(
            Request(
                kind,
                prompt,
                rng.randint(16, 96),
                rng.choice([0.0, 0.7]),
                rng.randint(0, 999),
                rng.randint(2, 8),
            )
        )
    return out


def _body(r: Request) -> tuple[str, dict[str, Any]]:
    common = {"max_tokens": r.max_tokens, "temperature": r.temperature, "seed": r.seed}
    messages = [{"role": "user", "content": r.prompt}]
    if r.kind in ("plain", "stream", "abort"):
        return "/v1/completions", {"prompt": r.prompt, **common}
    if r.kind == "score":
        return "/v1/score", {"prompt": r.prompt, "choices": [" yes", " no", " maybe later"]}
    body: dict[str, Any] = {"messages": messages, **common}
    if r.kind == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA},
        }
    elif r.kind == "tool":
        body["tools"] = TOOLS
        body["tool_choice"] = "required"
    return "/v1/chat/completions", body


async def send(client: httpx.AsyncClient, base: str, r: Request) -> Result:
    path, body = _body(r)
    if r.kind not in STREAMED:
        response = await client.post(base + path, json=body)
        if response.status_code != 200:
            return Result(r.kind, False, error=f"HTTP {response.status_code}")
        usage = response.json().get("usage") or {}
        return Result(r.kind, True, int(usage.get("completion_tokens") or 0))
    body.update({"stream": True, "stream_options": {"include_usage": True}})
    result = Result(r.kind, True)
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    async with client.stream("POST", base + path, json=body) as response:
        if response.status_code != 200:
            return Result(r.kind, False, error=f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                result.output_tokens = int(event["usage"].get("completion_tokens") or 0)
            if not event.get("choices"):
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.gaps.append(now - last)
            last = now
            chunks += 1
            if r.kind == "abort" and chunks >= r.abort_after:
                result.output_tokens = chunks  # leaving the block closes the connection
                break
    return result


async def run_round(base: str, requests: list[Request], concurrency: int) -> dict[str, Any]:
    queue = list(reversed(requests))
    results: list[Result] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            r = queue.pop()
            try:
                results.append(await send(client, base, r))
            except httpx.HTTPError as e:
                results.append(Result(r.kind, False, error=type(e).__name__))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "results": results}


async def wait_idle(base: str, timeout: float = 60.0) -> None:
    """Aborted streams finish asynchronously: the next variant's round starts on a quiet machine."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            stats = (await client.get(base + "/v1/internal/stats")).json()
            if not stats.get("num_running") and not stats.get("num_waiting"):
                return
            await asyncio.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, float]:
    gaps = [g for r in rounds for res in r["results"] for g in res.gaps]
    ttfts = [res.ttft for r in rounds for res in r["results"] if res.ttft is not None]
    tokens = sum(res.output_tokens for r in rounds for res in r["results"])
    seconds = sum(r["seconds"] for r in rounds)
    errors = sum(1 for r in rounds for res in r["results"] if not res.ok)
    per_round = [sum(x.output_tokens for x in r["results"]) / r["seconds"] for r in rounds]
    return {
        "itl_p50_ms": 1e3 * pct(gaps, 0.5),
        "itl_p99_ms": 1e3 * pct(gaps, 0.99),
        "itl_max_ms": 1e3 * max(gaps, default=float("nan")),
        "ttft_p50_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "tokens_per_s_rounds": per_round,
        "output_tokens": tokens,
        "seconds": seconds,
        "errors": errors,
        "num_gaps": len(gaps),
    }


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant NAME=ARGS, got {text!r}")
    return name, args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 Q4_1 GGUF")
    p.add_argument("--server-args", default="", help="`kvserve serve` arguments of every variant")
    p.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        help="NAME=extra serve args (repeatable; the first is the baseline); "
        "default: fixed=--target-step-ms 0 (a fixed token budget) and step=--target-step-ms 200",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=48, help="requests per round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--json-out", default=None)
    return p


def report(names: list[str], stats: dict[str, dict[str, float]]) -> str:
    base = stats[names[0]]
    lines = [
        "| variant | p50 ITL | p99 ITL | max ITL | p50 TTFT | p99 TTFT | out tok/s (per round) "
        f"| vs {names[0]} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        s = stats[name]
        rounds = ", ".join(f"{x:.1f}" for x in s["tokens_per_s_rounds"])  # type: ignore[attr-defined]
        lines.append(
            f"| {name} | {s['itl_p50_ms']:.0f} ms | {s['itl_p99_ms']:.0f} ms | "
            f"{s['itl_max_ms']:.0f} ms | {s['ttft_p50_s']:.2f} s | {s['ttft_p99_s']:.2f} s | "
            f"{s['tokens_per_s']:.1f} ({rounds}) | "
            f"p99 ITL {s['itl_p99_ms'] / base['itl_p99_ms']:.2f}x, "
            f"tok/s {s['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )
    errors = {n: stats[n]["errors"] for n in names if stats[n]["errors"]}
    if errors:
        lines.append(f"errors: {errors}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Explicit on both sides: the CPU default is itself a step-time budget under the block formats.
    variants = args.variant or [("fixed", "--target-step-ms 0"), ("step", "--target-step-ms 200")]
    names = [n for n, _ in variants]
    from engine.models.loader import resolve_model

    model = str(resolve_model(args.model))
    print(cpu_summary())
    print(
        f"mixed load: {args.rounds} rounds x {args.requests} requests, concurrency "
        f"{args.concurrency}, variants interleaved (order rotated per round); model {model}"
    )
    collected: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with ExitStack() as stack:
        servers = {}
        for name, extra in variants:
            port = free_port()
            argv_ = [sys.executable, "-m", "server", "serve", model, "--port", str(port)]
            argv_ += [*shlex.split(args.server_args), *shlex.split(extra)]
            server = stack.enter_context(
                ServerProcess(
                    f"mixed-{name}", argv_, port, Path(args.log_dir), {"HF_HUB_OFFLINE": "1"}
                )
            )
            servers[name] = server
        for server in servers.values():
            server.wait_healthy(timeout=600)
        warm = make_requests(args.concurrency, seed=-1)
        for name in names:  # first-use work (kernel probes, buffers) out of the figures
            asyncio.run(run_round(servers[name].base_url, warm, args.concurrency))
        for r in range(args.rounds):
            requests = make_requests(args.requests, seed=args.seed + r)
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                base = servers[name].base_url
                asyncio.run(wait_idle(base))
                result = asyncio.run(run_round(base, requests, args.concurrency))
                collected[name].append(result)
                s = summarize([result])
                logger.info(
                    "round %d %s: %.1f s, p99 ITL %.0f ms, %.1f tok/s",
                    r + 1, name, result["seconds"], s["itl_p99_ms"], s["tokens_per_s"],
                )  # fmt: skip
    stats = {n: summarize(collected[n]) for n in names}
    print(report(names, stats))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"variants": variants, "stats": stats}, indent=2))
    return 0 if not any(stats[n]["errors"] for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
