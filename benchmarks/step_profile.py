"""Per-step cost of kvserve's engine: batch-B decode step time (and the CPU time outside the model
forward and the lm_head: scheduling, input preparation, sampling, outputs, detokenizing), 128-token
prefill time, and an optional torch.profiler / cProfile breakdown of one decode step. --stub-model
replaces the forward and the lm_head with ready tensors, so the whole step is the engine's own
overhead. Prints medians; never asserts a timing."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
import zlib
from typing import Any

import torch


def build_engine(options: dict[str, Any], max_batch: int) -> Any:
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    options = {"max_num_seqs": max(64, max_batch), "num_blocks": 64 + max_batch * 16, **options}
    return LLMEngine(EngineConfig.from_options(options.pop("model", None), **options))


def _prompts(engine: Any, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, engine.vocab_size) for _ in range(length)] for _ in range(batch)]


def _params(max_tokens: int) -> Any:
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _clear(engine: Any, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def _until_decoding(engine: Any, ids: list[str]) -> None:
    """Step until every request has prefilled and sampled its first token."""
    while any(engine.groups[rid].seqs[0].num_output_tokens == 0 for rid in ids):
        engine.step()


def _timed_runner(engine: Any) -> list[float]:
    """Wrap runner.execute to record its wall time (model forward + sampling) per step."""
    times: list[float] = []
    runner = engine.runner
    inner = type(runner).execute

    def execute(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = inner(runner, *args, **kwargs)
        times.append(time.perf_counter() - t0)
        return result

    runner.execute = execute
    return times


class _ModelTimer:
    """Record the CPU time of the model forward and the lm_head (compute_logits) in each step."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.forward = self.lm_head = 0.0
        self._inner = (model.forward, model.compute_logits)

    def _timed(self, fn: Any, field: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.process_time() - c0)

        return call

    def __enter__(self) -> _ModelTimer:
        self.model.forward = self._timed(self._inner[0], "forward")
        self.model.compute_logits = self._timed(self._inner[1], "lm_head")
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.forward, self.model.compute_logits = self._inner

    def take(self) -> tuple[float, float]:
        times, self.forward, self.lm_head = (self.forward, self.lm_head), 0.0, 0.0
        return times


def stub_model(model: Any, dtype: torch.dtype) -> None:
    """Replace the forward and the lm_head with fixed tensors of the right shapes (the logits are
    the real lm_head's of random hidden states, made once per row count): what is left of a step
    is the engine's own work."""
    hidden_size = model.hidden_size
    real_logits = model.compute_logits
    hidden_cache: dict[int, torch.Tensor] = {}
    logits_cache: dict[int, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        n = input_ids.shape[0]
        if n not in hidden_cache:
            hidden_cache[n] = torch.randn(n, hidden_size, generator=generator).to(dtype)
        return hidden_cache[n]

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        if n not in logits_cache:
            logits_cache[n] = real_logits(hidden)
        return logits_cache[n]

    model.forward = forward
    model.compute_logits = compute_logits


def decode_steps(engine: Any, batch: int, context: int, steps: int, tag: str) -> dict[str, float]:
    """Median engine.step and runner.execute ms of decode steps at `batch`, context ~`context`."""
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, _prompts(engine, batch, context, batch), strict=True):
        engine.add_request(rid, prompt, _params(steps + 8))
    _until_decoding(engine, ids)
    for _ in range(2):  # warm-up decodes
        engine.step()
    runner_times = _timed_runner(engine)
    step_times, cpu_times, outside, lm_head = [], [], [], []
    with _ModelTimer(engine.model) as timer:
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            step_times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            forward_cpu, lm_head_cpu = timer.take()
            outside.append(cpu_times[-1] - forward_cpu - lm_head_cpu)
            lm_head.append(lm_head_cpu)
    del engine.runner.execute
    _clear(engine, ids)
    return {
        "step_ms": 1e3 * statistics.median(step_times),
        # CPU time of this process: steadier than wall time on a shared, oversubscribed machine
        "cpu_ms": 1e3 * statistics.median(cpu_times),
        # CPU time of the step outside the model forward and the lm_head (the engine's own work)
        "outside_ms": 1e3 * statistics.median(outside),
        "lm_head_ms": 1e3 * statistics.median(lm_head),
        "runner_ms": 1e3 * statistics.median(runner_times),
        "tok_s": batch / statistics.median(step_times),
    }


def prefill_ms(engine: Any, length: int, repeats: int, tag: str) -> tuple[float, float]:
    """Median wall and CPU time of the step that prefills one `length`-token prompt (and samples its token)."""
    times, cpu = [], []
    for r in range(repeats + 1):
        rid = f"{tag}-prefill-{r}"
        # distinct within and across calls (the tag names the round): no prefix-cache hits
        prompt = _prompts(engine, 1, length, zlib.crc32(f"{tag}-{r}".encode()))[0]
        engine.add_request(rid, prompt, _params(1))
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        if r:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        _clear(engine, [rid])
    return 1e3 * statistics.median(times), 1e3 * statistics.median(cpu)


def profile_decode(engine: Any, batch: int, context: int, kind: str, rows: int) -> str:
    ids = [f"prof-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, _prompts(engine, batch, context, 7), strict=True):
        engine.add_request(rid, prompt, _params(64))
    _until_decoding(engine, ids)
    for _ in range(3):
        engine.step()
    if kind == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    else:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            engine.step()
        profiler.disable()
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(rows)
        table = buf.getvalue()
    _clear(engine, ids)
    return table


def measure(engine: Any, batches: list[int], args: argparse.Namespace, tag: str) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for b in batches:
        row[f"decode_b{b}"] = decode_steps(engine, b, args.context, args.steps, tag)
    row["prefill_ms"], row["prefill_cpu_ms"] = prefill_ms(
        engine, args.prefill_len, args.prefill_repeats, tag
    )
    return row


def _summary(row: dict[str, Any], batches: list[int]) -> str:
    parts = [
        f"b{b} step {d['step_ms']:.1f} ms cpu {d['cpu_ms']:.1f} ({d['tok_s']:.0f} tok/s; "
        f"outside forward+lm_head {d['outside_ms']:.2f}, lm_head {d['lm_head_ms']:.1f})"
        for b in batches
        for d in [row[f"decode_b{b}"]]
    ]
    return (
        " | ".join(parts) + f" | prefill {row['prefill_ms']:.1f} ms cpu {row['prefill_cpu_ms']:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before decoding")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    p.add_argument("--prefill-len", type=int, default=128)
    p.add_argument("--prefill-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: 2)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole measurement")
    p.add_argument(
        "--engine-options",
        default="{}",
        help='JSON engine options, e.g. {"quantization": "int8"}; a JSON list of them compares '
        "those engines in one process, round-robin",
    )
    p.add_argument(
        "--stub-model",
        action="store_true",
        help="replace the forward and the lm_head with ready tensors: time the engine's own work",
    )
    p.add_argument("--profile", choices=("none", "torch", "cprofile"), default="none")
    p.add_argument("--profile-batch", type=int, default=1)
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    parsed = json.loads(args.engine_options)
    variants = parsed if isinstance(parsed, list) else [parsed]  # a list: A/B in one process
    batches = [int(b) for b in args.batches.split(",") if b]
    engines = []
    for options in variants:
        t0 = time.perf_counter()
        engines.append(build_engine(dict(options), max(batches)))
        if args.stub_model:
            stub_model(engines[-1].model, engines[-1].dtype)
        print(f"engine {options} built in {time.perf_counter() - t0:.1f} s; threads={threads}")

    results: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for index, (options, engine) in enumerate(zip(variants, engines, strict=True)):
            row = measure(engine, batches, args, f"r{rnd}v{index}")
            row.update(round=rnd, variant=index, options=options)
            results.append(row)
            print(f"round {rnd} {json.dumps(options)}: {_summary(row, batches)}")
    if args.rounds > 1:
        for index, options in enumerate(variants):
            rows = [r for r in results if r["variant"] == index]
            med = {b: statistics.median(r[f"decode_b{b}"]["cpu_ms"] for r in rows) for b in batches}
            out = {
                b: statistics.median(r[f"decode_b{b}"]["outside_ms"] for r in rows) for b in batches
            }
            pre = statistics.median(r["prefill_cpu_ms"] for r in rows)
            shown = " | ".join(
                f"b{b} {ms:.1f} ms ({b / ms * 1e3:.0f} tok/s; outside {out[b]:.2f} ms)"
                for b, ms in med.items()
            )
            print(f"median CPU time {json.dumps(options)}: {shown} | prefill {pre:.1f} ms")
    engine = engines[0]
    if args.profile != "none":
        print(
            profile_decode(
                engine, args.profile_batch, args.context, args.profile, args.profile_rows
            )
        )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": threads, "rounds": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
