"""Prefix caching benchmark: K questions over one long shared document, with caching on and off,
printing prefill tokens computed, time to first token and end-to-end time, and their ratios."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import ServerProcess, free_port
from server.bench import RequestRecord, load_tokenizer, ratio, synthetic_prompts

logger = logging.getLogger(__name__)


def make_prompts(model_dir: Path, doc_len: int, num_questions: int, question_len: int) -> list[str]:
    """One document of `doc_len` tokens followed by each of K distinct questions."""
    tokenizer = load_tokenizer(str(model_dir))
    document = synthetic_prompts(1, doc_len, tokenizer, seed=1234)[0]
    questions = synthetic_prompts(num_questions, question_len, tokenizer, seed=99)
    return [
        f"Read this document.\n\n{document}\n\nQuestion {i + 1}: {q}?\nAnswer:"
        for i, q in enumerate(questions)
    ]


def _summary(
    prompt_tokens: list[int], cached: list[int], ttfts: list[float], seconds: float
) -> dict:
    computed = sum(prompt_tokens) - sum(cached)
    return {
        "requests": len(prompt_tokens),
        "prompt_tokens": sum(prompt_tokens),
        "cached_tokens": sum(cached),
        "prefill_tokens_computed": computed,
        "ttft_mean_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else float("nan"),
        "ttft_first_ms": 1000 * ttfts[0] if ttfts else float("nan"),
        "ttft_rest_mean_ms": 1000 * sum(ttfts[1:]) / max(1, len(ttfts) - 1),
        "e2e_s": seconds,
    }


# ---------------------------------------------------------------- offline (in-process LLM)


def run_offline(
    model_dir: Path, args: argparse.Namespace, prompts: list[str], caching: bool
) -> dict:
    """The first question alone (it fills the cache), then the other K-1 submitted together."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=args.dtype, enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(["Warm-up: count to three."], SamplingParams(max_tokens=2, temperature=0.0))
    start = time.perf_counter()
    outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    seconds = time.perf_counter() - start
    ttfts = []
    for out in outputs:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            ttfts.append(m.first_token_time - m.arrival_time)
    result = _summary(
        [len(o.prompt_token_ids) for o in outputs],
        [o.num_cached_tokens for o in outputs],
        ttfts,
        seconds,
    )
    del llm
    gc.collect()
    return result


# ---------------------------------------------------------------- over HTTP (a kvserve server)


async def _http_run(base_url: str, prompts: list[str], args: argparse.Namespace) -> dict:
    from server.bench import BenchConfig, build_body, open_client, send_request

    config = BenchConfig(base_url=base_url, output_len=args.output_len, extra_body={})
    url = base_url.rstrip("/") + "/v1/completions"
    async with open_client(config) as client:
        warm = build_body(config, "Warm-up: count to three.", None)
        await send_request(
            client, url, {**warm, "max_tokens": 2}, RequestRecord(time.perf_counter())
        )
        start = time.perf_counter()
        first = await send_request(
            client, url, build_body(config, prompts[0], None), RequestRecord(time.perf_counter())
        )
        rest = await asyncio.gather(
            *(
                send_request(
                    client, url, build_body(config, p, None), RequestRecord(time.perf_counter())
                )
                for p in prompts[1:]
            )
        )
        seconds = time.perf_counter() - start
    records = [first, *rest]
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return _summary(
        [r.prompt_tokens for r in records],
        [r.cached_tokens for r in records],
        [r.ttft or 0.0 for r in records],
        seconds,
    )


def run_server(
    model_dir: Path, args: argparse.Namespace, prompts: list[str], caching: bool
) -> dict:
    """Start kvserve with caching on or off, run the questions over HTTP, stop it."""
    port = free_port()
    argv = [sys.executable, "-m", "server", "serve", str(model_dir), "--port", str(port)]
    argv += ["--dtype", args.dtype]
    argv += ["--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    name = f"kvserve-cache-{'on' if caching else 'off'}"
    log_dir = Path(args.log_dir or "/tmp")
    with ServerProcess(name, argv, port, log_dir, {"HF_HUB_OFFLINE": "1"}) as server:
        server.wait_healthy(timeout=300)
        return asyncio.run(_http_run(server.base_url, prompts, args))


# ---------------------------------------------------------------- CLI


def _ratio_text(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def format_report(on: dict, off: dict) -> str:
    rows = [
        ("prefill tokens computed", "prefill_tokens_computed", "{:,.0f}"),
        ("cached prompt tokens", "cached_tokens", "{:,.0f}"),
        ("TTFT mean (ms)", "ttft_mean_ms", "{:,.1f}"),
        ("TTFT first question (ms)", "ttft_first_ms", "{:,.1f}"),
        ("TTFT other questions (ms)", "ttft_rest_mean_ms", "{:,.1f}"),
        ("end-to-end (s)", "e2e_s", "{:,.2f}"),
    ]
    lines = [f"{'figure':<28}{'cache on':>12}{'cache off':>12}{'on/off':>10}"]
    for label, key, fmt in rows:
        lines.append(
            f"{label:<28}{fmt.format(on[key]):>12}{fmt.format(off[key]):>12}"
            f"{_ratio_text(ratio(float(on[key]), float(off[key]))):>10}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--model", default=None, help="model folder or .gguf (default: the bundled SmolLM2)"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", choices=("offline", "server"), default="offline")
    p.add_argument("--doc-len", type=int, default=1024, help="shared document length in tokens")
    p.add_argument("--num-questions", type=int, default=8, help="K")
    p.add_argument("--question-len", type=int, default=16, help="tokens per question")
    p.add_argument("--output-len", type=int, default=8, help="answer tokens (ignore_eos)")
    p.add_argument("--log-dir", default=None, help="server logs (server backend)")
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.num_questions < 2:
        print("error: --num-questions must be at least 2", file=sys.stderr)
        return 1
    from engine.models.loader import resolve_model

    model_dir = resolve_model(args.model)
    prompts = make_prompts(model_dir, args.doc_len, args.num_questions, args.question_len)
    runner = run_offline if args.backend == "offline" else run_server
    results: dict[str, Any] = {}
    for caching in (True, False):
        results["on" if caching else "off"] = runner(model_dir, args, prompts, caching)
        logger.info(
            "caching %s: %s", "on" if caching else "off", results["on" if caching else "off"]
        )
    print(
        f"{args.num_questions} questions over a {args.doc_len}-token document, "
        f"{args.output_len} answer tokens each ({args.backend}, {args.dtype})"
    )
    print(format_report(results["on"], results["off"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
