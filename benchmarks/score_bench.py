"""Scoring benchmark: a long context and a few choices scored by one score request (POST /v1/score,
`LLMEngine.add_score_request`) against one echo + logprobs request per choice, with prefix caching off
and on. Prints tokens computed, latency medians, and ratios to one prefill of the context alone.

    python -m benchmarks.score_bench                      # in-process engine (tokens and latency)
    python -m benchmarks.score_bench --url http://localhost:8000   # a running server (latency)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

WORDS = (
    "the committee reviewed every proposal in detail before the final vote while the public "
    "gallery listened to long arguments about budgets harbors schools and roads"
).split()


def cpu_flags() -> str:
    """The CPU model and the SIMD flags that matter for torch's CPU kernels."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 - read once
            if line.startswith("model name") and model in ("", "unknown", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    return f"{model}; " + " ".join(f for f in wanted if f in flags)


def make_inputs(tokenizer: Any, context_len: int, choice_lens: list[int], seed: int):
    """A context of exactly `context_len` tokens and choices of the given token lengths."""
    rng = random.Random(seed)

    def tokens(n: int, lead: str = "") -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += tokenizer.encode(lead + " ".join(rng.choice(WORDS) for _ in range(n)), False)
        return ids[:n]

    return tokens(context_len), [tokens(n, " ") for n in choice_lens]


def add_requests(
    engine: Any, kind: str, tag: str, ctx: list[int], choices: list[list[int]]
) -> None:
    """prefill: the context alone; score: one score request; echo: one echo request per choice."""
    from engine import SamplingParams

    if kind == "prefill":
        engine.add_request(tag, ctx, SamplingParams(max_tokens=0))
    elif kind == "score":
        engine.add_score_request(tag, ctx, choices)
    else:
        echo = SamplingParams(max_tokens=0, prompt_logprobs=0)
        for i, c in enumerate(choices):
            engine.add_request(f"{tag}/{i}", ctx + c, echo)


def run_engine(engine: Any, add: Callable[[], None]) -> tuple[float, int]:
    """Add the request(s), step to completion; (seconds, tokens computed)."""
    start = time.perf_counter()
    add()
    computed = 0
    while engine.has_unfinished_requests():
        engine.step()
        computed += engine.last_step.num_batched_tokens if engine.last_step else 0
    return time.perf_counter() - start, computed


def offline(args: argparse.Namespace) -> dict[str, Any]:
    from functools import partial

    from engine import LLM

    results: dict[str, Any] = {}
    for caching in (False, True):
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching)
        engine = llm.engine
        rows: dict[str, list[tuple[float, int]]] = {"prefill": [], "score": [], "echo": []}
        for rep in range(args.repeats + 1):  # repetition 0 warms up
            # A fresh context per repetition and kind: every run starts with a cold prefix cache.
            for kind in rows:
                ctx, choices = make_inputs(
                    llm.tokenizer, args.context_len, args.choice_lens, seed=rep * 10 + len(kind)
                )
                add = partial(add_requests, engine, kind, f"{kind}-{rep}", ctx, choices)
                seconds, computed = run_engine(engine, add)
                print(
                    f"caching={caching} rep={rep} {kind}: {seconds:.2f}s {computed} tokens",
                    flush=True,
                )
                if rep:
                    rows[kind].append((seconds, computed))
        medians = {k: statistics.median(s for s, _ in v) for k, v in rows.items()}
        results["caching_on" if caching else "caching_off"] = {
            "tokens_computed": {k: v[0][1] for k, v in rows.items()},
            "median_s": medians,
            "score_vs_prefill": medians["score"] / medians["prefill"],
            "echo_vs_prefill": medians["echo"] / medians["prefill"],
            "echo_vs_score": medians["echo"] / medians["score"],
        }
        del llm
    return results


def over_http(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from engine import Tokenizer
    from engine.models.loader import resolve_model

    tokenizer = Tokenizer.from_pretrained(resolve_model(args.model))
    client = httpx.Client(base_url=args.url, timeout=600)
    rows: dict[str, list[float]] = {"prefill": [], "score": [], "echo": []}
    for rep in range(args.repeats + 1):
        for kind in rows:
            ctx, choices = make_inputs(
                tokenizer, args.context_len, args.choice_lens, seed=1000 + rep * 10 + len(kind)
            )
            start = time.perf_counter()
            if kind == "prefill":
                client.post(
                    "/v1/completions", json={"prompt": ctx, "max_tokens": 0}
                ).raise_for_status()
            elif kind == "score":
                client.post(
                    "/v1/score", json={"prompt": ctx, "choices": choices}
                ).raise_for_status()
            else:
                body = {"max_tokens": 0, "echo": True, "logprobs": 0}
                with ThreadPoolExecutor(len(choices)) as pool:
                    futures = [
                        pool.submit(
                            client.post, "/v1/completions", json={**body, "prompt": ctx + c}
                        )
                        for c in choices
                    ]
                    for f in futures:
                        f.result().raise_for_status()
            if rep:
                rows[kind].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "median_s": medians,
        "score_vs_prefill": medians["score"] / medians["prefill"],
        "echo_vs_score": medians["echo"] / medians["score"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context-len", type=int, default=1000)
    parser.add_argument("--choice-lens", default="5,10,15,20", help="comma-separated token lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--url", default=None, help="a running kvserve server instead of in-process"
    )
    args = parser.parse_args()
    args.choice_lens = [int(x) for x in args.choice_lens.split(",")]
    print(f"cpu: {cpu_flags()}")
    print(f"context {args.context_len} tokens, choices {args.choice_lens} tokens")
    result = over_http(args) if args.url else offline(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
