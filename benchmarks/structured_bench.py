"""Cost of constrained decoding: output tokens/s and inter-token latency at concurrency 1 and 16, with
and without a JSON schema, on the same prompts; and grammar compile time for a typical and a large
schema. In-process engine (no HTTP), closed loop: each finished request is replaced by the next.

    python -m benchmarks.structured_bench --requests 32 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

from server.bench.metrics import percentile, ratio

TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 60},
                "city": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}


def large_schema(num_props: int = 120) -> dict[str, Any]:
    """Many properties, enums, nested objects and $refs: a big tool/API schema."""
    defs = {
        f"Item{i}": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "label": {"type": "string", "maxLength": 30},
                "kind": {"enum": [f"k{i}_{j}" for j in range(12)]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["id", "label", "kind"],
            "additionalProperties": False,
        }
        for i in range(20)
    }
    props: dict[str, Any] = {}
    for i in range(num_props):
        if i % 3 == 0:
            props[f"field_{i}"] = {"$ref": f"#/$defs/Item{i % 20}"}
        elif i % 3 == 1:
            props[f"field_{i}"] = {
                "type": "array",
                "items": {"$ref": f"#/$defs/Item{(i * 7) % 20}"},
            }
        else:
            props[f"field_{i}"] = {"anyOf": [{"type": "string", "maxLength": 50}, {"type": "null"}]}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[:40],
        "additionalProperties": False,
        "$defs": defs,
    }


def run_closed_loop(
    engine: Any, prompts: list[list[int]], params: Any, concurrency: int
) -> dict[str, float]:
    """Keep `concurrency` requests in flight until all prompts ran; token timestamps per request."""
    import dataclasses

    params = dataclasses.replace(params, output_kind="delta")
    pending = list(enumerate(prompts))
    times: dict[str, list[float]] = {}
    in_flight = 0
    tokens = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, ids = pending.pop(0)
            engine.add_request(f"r{i}", ids, params)
            times[f"r{i}"] = [time.perf_counter()]
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            for c in out.outputs:
                times[out.request_id].extend([now] * len(c.token_ids))
                tokens += len(c.token_ids)
            if out.finished:
                in_flight -= 1
    seconds = time.perf_counter() - start
    itl = [b - a for ts in times.values() for a, b in zip(ts[1:], ts[2:], strict=False)]
    ttft = [ts[1] - ts[0] for ts in times.values() if len(ts) > 1]
    return {
        "tok_s": tokens / seconds,
        "tokens": tokens,
        "itl_ms_median": 1e3 * statistics.median(itl) if itl else 0.0,
        "itl_ms_p99": 1e3 * percentile(itl, 99) if itl else 0.0,
        "ttft_ms_median": 1e3 * statistics.median(ttft) if ttft else 0.0,
    }


def compile_times(engine: Any, repeats: int = 3) -> dict[str, float]:
    """Cold compile (cache cleared) in ms, median over repeats; plus the cached lookup."""
    from engine import StructuredOutputs

    out: dict[str, float] = {}
    engine.grammars.compile(StructuredOutputs(json_object=True))  # builds the llguidance tokenizer
    for name, schema in (("typical", TYPICAL_SCHEMA), ("large", large_schema())):
        constraint = StructuredOutputs(json=json.dumps(schema))
        cold = []
        for _ in range(repeats):
            engine.grammars._cache.clear()
            t = time.perf_counter()
            engine.grammars.compile(constraint)
            cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.grammars.compile(constraint)
        out[f"{name}_cold_ms"] = 1e3 * statistics.median(cold)
        out[f"{name}_cached_ms"] = 1e3 * (time.perf_counter() - t)
        out[f"{name}_schema_bytes"] = len(json.dumps(schema))
    return out


def cpu_flags() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    flags = set(
        next(
            (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
        )
    )
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma") if f in flags]
    return f"{model}; flags: {' '.join(wanted) or 'none of avx2/avx512'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per setting")
    args = parser.parse_args()

    import torch

    from engine import LLM, SamplingParams, StructuredOutputs

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=16)
    engine = llm.engine
    print(
        f"device={engine.device} dtype={engine.dtype} torch={torch.__version__} threads={torch.get_num_threads()}"
    )
    print(f"cpu: {cpu_flags()}")
    questions = ["a person", "a customer", "an employee", "a student", "a doctor", "an artist"]
    prompts = [
        llm.tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Write a JSON profile of {questions[i % len(questions)]} number {i}.",
                }
            ]
        )
        for i in range(args.requests)
    ]
    schema = StructuredOutputs(json=json.dumps(TYPICAL_SCHEMA))
    settings = {
        "plain": SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True
        ),
        "json_schema": SamplingParams(
            max_tokens=args.max_tokens, temperature=0.8, seed=1, structured_outputs=schema
        ),
    }
    run_closed_loop(engine, prompts[:2], settings["json_schema"], 2)  # warm-up (and compile)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for c in [int(x) for x in args.concurrency.split(",")]:
            for name, params in settings.items():  # interleaved: same conditions for both
                results.setdefault((name, c), []).append(
                    run_closed_loop(engine, prompts, params, c)
                )
    print(
        f"\n{'setting':<12} {'conc':>4} {'tok/s':>8} {'ITL med ms':>11} {'ITL p99 ms':>11} {'tokens':>7}"
    )
    summary: dict[tuple[str, int], dict[str, float]] = {}
    for (name, c), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        summary[(name, c)] = med
        print(
            f"{name:<12} {c:>4} {med['tok_s']:>8.1f} {med['itl_ms_median']:>11.2f} {med['itl_ms_p99']:>11.2f} {med['tokens']:>7.0f}"
        )
    for c in sorted({c for _, c in summary}):
        plain, constrained = summary[("plain", c)], summary[("json_schema", c)]
        print(
            f"c={c}: json_schema/plain throughput {ratio(constrained['tok_s'], plain['tok_s']):.3f}, "
            f"ITL {ratio(constrained['itl_ms_median'], plain['itl_ms_median']):.3f}"
        )
    print("\ngrammar compile (llguidance):")
    for key, value in compile_times(engine).items():
        print(f"  {key}: {value:.2f}")


if __name__ == "__main__":
    main()
