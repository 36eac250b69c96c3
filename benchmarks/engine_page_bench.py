"""Does watching the /engine page slow the engine? The same shared-prefix workload through one
AsyncLLMEngine with the page's snapshot stream open (its real event generator: a detailed snapshot and
the JSON payload up to 10 times a second) and closed, interleaved, reporting median throughput and the
ratio. Usage: python -m benchmarks.engine_page_bench [--rounds 6] [--requests 16] [--output-len 64]"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from typing import Any

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncLLMEngine
from server.engine_page import _events


class _Watcher:
    """Stands in for the browser's request: connected until told otherwise."""

    def __init__(self) -> None:
        self.disconnected = False

    async def is_disconnected(self) -> bool:
        return self.disconnected


def cpu_flags() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model}; flags: {' '.join(wanted) or 'none of avx2/avx512'}"


async def _workload(engine: AsyncLLMEngine, args: argparse.Namespace, round_id: str) -> int:
    prefix = list(range(1000, 1000 + args.prefix_len))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        prompt = prefix + [2000 + i] * args.suffix_len
        n = 0
        async for out in engine.generate(f"{round_id}-{i}", prompt, params):
            n = out.outputs[0].num_output_tokens
        return n

    counts = await asyncio.gather(*(one(i) for i in range(args.requests)))
    return sum(counts)


async def _run(
    engine: AsyncLLMEngine, args: argparse.Namespace, watch: bool, round_id: str
) -> dict[str, Any]:
    watcher = _Watcher()
    events = 0
    payload_bytes = 0

    async def consume() -> None:
        nonlocal events, payload_bytes
        limits = {"max_queued_requests": engine.max_queued_requests, "max_queued_tokens": None}
        async for frame in _events(engine, watcher, limits, lambda: False):  # type: ignore[arg-type]
            if frame.startswith("data: "):
                events += 1
                payload_bytes += len(frame)

    task = asyncio.create_task(consume()) if watch else None
    start = time.perf_counter()
    tokens = await _workload(engine, args, round_id)
    seconds = time.perf_counter() - start
    watcher.disconnected = True
    if task is not None:
        await task
    return {
        "watch": watch,
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "events": events,
        "events_per_s": events / seconds,
        "kib_per_event": payload_bytes / max(events, 1) / 1024,
    }


def _cost_per_event(engine: AsyncLLMEngine, repeats: int = 200) -> float:
    """Seconds one update costs, measured between steps on the engine as the runs left it."""
    from server.engine_page import page_payload

    limits = {"max_queued_requests": engine.max_queued_requests, "max_queued_tokens": None}
    start = time.perf_counter()
    for _ in range(repeats):
        snap = engine.core.publish(detail=True)
        json.dumps(page_payload(snap, limits, snap.num_steps - 10))  # ~10 new steps an event
    return (time.perf_counter() - start) / repeats


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "dtype": args.dtype,
        "device": args.device,
        "max_num_seqs": args.requests,
        "log_stats_interval": 0,
    }
    if args.num_kv_blocks:
        options["num_blocks"] = args.num_kv_blocks
    engine = await asyncio.to_thread(
        AsyncLLMEngine.from_config, EngineConfig.from_options(args.model, **options)
    )
    await engine.start()
    try:
        await _run(engine, args, False, "warmup")
        runs: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # interleaved, alternating first
            for watch in order:
                runs.append(await _run(engine, args, watch, f"r{r}-{int(watch)}"))
                print(json.dumps(runs[-1]), file=sys.stderr)
        per_event = _cost_per_event(engine)
    finally:
        await engine.shutdown()
    closed = statistics.median(x["tok_s"] for x in runs if not x["watch"])
    opened = statistics.median(x["tok_s"] for x in runs if x["watch"])
    return {
        "cpu": cpu_flags(),
        "kv_blocks": engine.snapshot().num_total_blocks,
        # The work one page update adds (detailed snapshot + payload + JSON), and what 10 a second
        # would cost at most as a share of one core: a noise-free bound next to the throughput ratio.
        "ms_per_event": round(1000 * per_event, 3),
        "max_share_of_a_core_at_10_per_s_pct": round(100 * 10 * per_event, 3),
        "rounds": args.rounds,
        "median_tok_s_closed": round(closed, 2),
        "median_tok_s_open": round(opened, 2),
        "open_over_closed": round(opened / closed, 4),
        "change_pct": round(100 * (opened / closed - 1), 2),
        "median_events_per_s": round(
            statistics.median(x["events_per_s"] for x in runs if x["watch"]), 2
        ),
        "median_kib_per_event": round(
            statistics.median(x["kib_per_event"] for x in runs if x["watch"]), 2
        ),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="model folder or file (default: the bundled one)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--rounds", type=int, default=6, help="open/closed pairs")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=96)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args)), indent=2))


if __name__ == "__main__":
    main()
