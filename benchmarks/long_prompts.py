"""Long prompts on CPU, engine-level, variants interleaved in one run (only their ratios count on a
noisy machine), CPU flags printed; never asserts a timing.

`ttft`: time to first token of 1k / 4k / 8k-token prompts (distinct random tokens, so no prefix
hits) with the prefill attention kernel (csrc/paged_prefill.cpp, "tiled") against the decode kernel
run once per query token ("per-token", what every prefill did before), and the attention's share of
the prefill time (of the whole prompt, and of its last step).

`mixed`: a few streams decode while long prompts arrive (each arrival keyed on the streams'
progress, so both variants see the same work); p99 / max inter-token latency of the streams and
total throughput, with the fixed token budget (--target-step-ms 0) against the step-time budget.

    python -m benchmarks.long_prompts ttft --lengths 1024,4096,8192
    python -m benchmarks.long_prompts mixed --streams 4 --prompts 3 --prompt-len 3000
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch

from benchmarks.bench_utils import cpu_summary


def build_engine(**options: Any) -> Any:
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_options(options.pop("model", None), **options))


def _params(max_tokens: int, stream: bool = False) -> Any:
    from engine import SamplingParams

    # streamed: an output every step that makes a token
    kind: Literal["cumulative", "final"] = "cumulative" if stream else "final"
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=kind)


def _prompt(engine: Any, length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, engine.vocab_size) for _ in range(length)]


def _per_token_attention(
    q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window=None, softcap=None
):
    """The path before the prefill kernel: each query token's own table row and context length,
    then the decode kernel over all of them (metadata.token_context's tensors)."""
    from engine.kernels import cpu_kernels

    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    tables = block_tables[: len(counts)].repeat_interleave(counts, dim=0)
    lens = torch.cat(
        [
            torch.arange(int(s) - int(n) + 1, int(s) + 1, dtype=torch.int32)
            for n, s in zip(counts.tolist(), seq_lens.tolist(), strict=True)
        ]
    )
    return cpu_kernels.paged_decode_attention(q, kv_cache, tables, lens, scale, window, softcap)


class AttentionTimer:
    """Patches the CPU backend's prefill attention entry point: the variant, and its time."""

    def __init__(self) -> None:
        from engine.kernels import cpu_kernels

        self.module = cpu_kernels
        self.tiled = cpu_kernels.paged_prefill_attention
        self.seconds = 0.0

    @contextlib.contextmanager
    def variant(self, name: str) -> Iterator[None]:
        impl = self.tiled if name == "tiled" else _per_token_attention

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            out = impl(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out

        self.module.paged_prefill_attention = timed
        try:
            yield
        finally:
            self.module.paged_prefill_attention = self.tiled


def ttft(args: argparse.Namespace) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = build_engine(
        max_model_len=max(lengths) + 16, enable_prefix_caching=False, **_options(args)
    )
    # A prompt plus its one token must fit the model's context (8k: 8191 tokens on an 8192 model).
    lengths = [min(n, engine.max_model_len - 1) for n in lengths]
    timer, rng = AttentionTimer(), random.Random(0)
    engine.add_request("warm", _prompt(engine, 64, rng), _params(1))
    while engine.has_unfinished_requests():
        engine.step()
    rows: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {}
    for rnd in range(args.rounds):
        for length in lengths:
            order = (
                ("per-token", "tiled")
                if (rnd + length // 1024) % 2 == 0
                else ("tiled", "per-token")
            )
            for name in order:
                with timer.variant(name):
                    timer.seconds = 0.0
                    engine.add_request(
                        f"{name}{length}.{rnd}", _prompt(engine, length, rng), _params(1)
                    )
                    t0 = time.perf_counter()
                    step_s = step_att = 0.0
                    while engine.has_unfinished_requests():
                        before, s0 = timer.seconds, time.perf_counter()
                        engine.step()
                        step_s, step_att = time.perf_counter() - s0, timer.seconds - before
                    total = time.perf_counter() - t0
                rows.setdefault((length, name), []).append((total, timer.seconds, step_s, step_att))
                print(
                    f"  round {rnd} {length:5d} tokens {name:9s}: TTFT {total * 1000:8.0f} ms, "
                    f"attention {timer.seconds / total:5.1%} of it, last step {step_s * 1000:6.0f} "
                    f"ms ({step_att / step_s:5.1%} attention)",
                    flush=True,
                )
    print(cpu_summary())
    print(f"threads={torch.get_num_threads()}, budget {args.max_num_batched_tokens} tokens a step")
    print(
        "| prompt | TTFT per-token | TTFT tiled | tiled / per-token | attention share per-token "
        "-> tiled (whole prefill) | last step |"
    )
    print("|---|---|---|---|---|---|")
    for length in lengths:
        old = [statistics.median(x) for x in zip(*rows[(length, "per-token")], strict=True)]
        new = [statistics.median(x) for x in zip(*rows[(length, "tiled")], strict=True)]
        print(
            f"| {length} | {old[0] * 1000:.0f} ms | {new[0] * 1000:.0f} ms | {new[0] / old[0]:.2f}x "
            f"| {old[1] / old[0]:.0%} -> {new[1] / new[0]:.0%} | {old[3] / old[2]:.0%} -> "
            f"{new[3] / new[2]:.0%} |"
        )


def mixed_run(engine: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Streams decode; long prompt i arrives once stream 0 has made `gap` * (i + 1) tokens."""
    rng = random.Random(seed)
    streams = [f"s{seed}.{i}" for i in range(args.streams)]
    for rid in streams:
        engine.add_request(
            rid, _prompt(engine, args.stream_prompt, rng), _params(args.stream_tokens, stream=True)
        )
    last: dict[str, float] = {}
    gaps: list[float] = []
    made = {rid: 0 for rid in streams}
    arrived = 0
    tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = out.outputs[0].num_output_tokens if out.outputs else 0
            if out.request_id in made:
                if n > made[out.request_id]:
                    if out.request_id in last:
                        gaps.append(now - last[out.request_id])
                    last[out.request_id] = now
                    tokens += n - made[out.request_id]
                    made[out.request_id] = n
            elif out.finished:
                tokens += args.prompt_len + n
        if arrived < args.prompts and made[streams[0]] >= args.gap * (arrived + 1):
            rid = f"p{seed}.{arrived}"
            engine.add_request(rid, _prompt(engine, args.prompt_len, rng), _params(8))
            arrived += 1
    wall = time.perf_counter() - t0
    gaps.sort()
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return {
        "p99": p99,
        "max": gaps[-1],
        "median": statistics.median(gaps),
        "tok_s": tokens / wall,
        "wall": wall,
    }


def mixed(args: argparse.Namespace) -> None:
    from engine.core.step_budget import StepBudget

    engine = build_engine(enable_prefix_caching=False, **_options(args))
    fixed_budget = args.max_num_batched_tokens
    results: dict[str, list[dict[str, float]]] = {"fixed": [], "step-time": []}
    for rnd in range(args.rounds):
        order = ("fixed", "step-time") if rnd % 2 == 0 else ("step-time", "fixed")
        for name in order:
            # A fresh fit each run, as a fresh server would start.
            engine.scheduler.step_budget = (
                StepBudget(args.target_step_ms / 1000, fixed_budget)
                if name == "step-time"
                else None
            )
            r = mixed_run(engine, args, seed=2 * rnd + (name == "fixed"))
            results[name].append(r)
            print(
                f"  round {rnd} {name:9s}: p99 ITL {r['p99'] * 1000:6.0f} ms, max {r['max'] * 1000:6.0f}"
                f" ms, median {r['median'] * 1000:5.0f} ms, {r['tok_s']:6.1f} tok/s "
                f"({r['wall']:.1f} s)",
                flush=True,
            )
    print(cpu_summary())
    print(
        f"threads={torch.get_num_threads()}; {args.streams} streams x {args.stream_tokens} tokens, "
        f"{args.prompts} prompts of {args.prompt_len} tokens; fixed budget {fixed_budget} tokens, "
        f"target step {args.target_step_ms:.0f} ms"
    )
    print("| budget | p99 ITL | max ITL | median ITL | tokens/s (prompt + output) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {med['p99'] * 1000:.0f} ms | {med['max'] * 1000:.0f} ms | "
            f"{med['median'] * 1000:.0f} ms | {med['tok_s']:.1f} |"
        )
    ratio = statistics.median(r["tok_s"] for r in results["step-time"]) / statistics.median(
        r["tok_s"] for r in results["fixed"]
    )
    print(f"step-time / fixed throughput: {ratio:.2f}x")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"max_num_batched_tokens": args.max_num_batched_tokens}
    if args.model:
        options["model"] = args.model
    return options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=("ttft", "mixed"))
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 Q4_1 GGUF")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--lengths", default="1024,4096,8192", help="ttft: prompt lengths")
    p.add_argument("--streams", type=int, default=4, help="mixed: decoding streams")
    p.add_argument("--stream-prompt", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=300)
    p.add_argument("--prompts", type=int, default=3, help="mixed: long prompts arriving")
    p.add_argument("--prompt-len", type=int, default=3000)
    p.add_argument("--gap", type=int, default=40, help="mixed: stream tokens between arrivals")
    p.add_argument("--target-step-ms", type=float, default=200.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    (ttft if args.mode == "ttft" else mixed)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
