"""Quality of each weight format against float32 on the same model: greedy continuations of the
engine-parity prompt set (matching-prefix lengths), perplexity on a fixed public-domain text, and the
weight error of each block format against the loaded float32 weights. Prints the CPU it ran on.

    PYTHONPATH=. python -m benchmarks.quant_quality                # bundled SmolLM2: gguf, int8, int4
    PYTHONPATH=. python -m benchmarks.quant_quality --formats int8 --max-tokens 64

Formats: float32 (the reference, always run first), gguf (a .gguf model's own blocks, as stored),
int8 (Q8_0 blocks packed from the float weights), int4 (Q4_1 blocks, Q8_0 head). The block formats
all run int8 activations per row and block of 32 on kvserve's C++ kernels.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).parent / "data" / "public_domain.txt"
FORMATS = ("gguf", "int8", "int4")


def perplexity(llm: Any, text: str, window: int) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the text's tokens, in windows of `window` tokens."""
    from engine import SamplingParams

    ids = llm.tokenizer.encode(text)
    chunks = [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i:]) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for out in llm.generate(chunks, params):
        for entry in out.prompt_logprobs[1:]:
            nll -= entry.logprob
            count += 1
    return math.exp(nll / count), count


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def weight_errors(model_dir: Path, formats: list[str]) -> dict[str, float]:
    """Median relative Frobenius error of each block format's matmul weights against the loaded
    float32 weights (for a .gguf model: its blocks dequantized exactly, so gguf is 0 by design)."""
    from engine.models.block_quant import quantize_q4_1, quantize_q8_0
    from engine.models.loader import load_model

    model = load_model(model_dir, "float32", "cpu").model
    packers = {"int8": quantize_q8_0, "int4": quantize_q4_1}
    errors: dict[str, list[float]] = {f: [] for f in formats if f in packers}
    for owner, attr in model.quantizable_weights():
        w = getattr(owner, attr).data
        if w.shape[1] % 32:
            continue  # stays float in every format
        for fmt in errors:
            head = attr == "lm_head_weight"
            packed = (quantize_q8_0 if head else packers[fmt])(w).dequantize()
            errors[fmt].append(((packed - w).norm() / w.norm()).item())
    return {fmt: statistics.median(e) for fmt, e in errors.items()}


def build(model: str | None, fmt: str, options: dict[str, Any]) -> Any:
    """`fmt` is a format, or `format/kv:DTYPE` for that format over a KV cache of DTYPE."""
    from engine import LLM

    fmt, _, kv = fmt.partition("/kv:")
    quantization = "none" if fmt == "float32" else fmt
    return LLM(
        model, dtype="float32", quantization=quantization, kv_cache_dtype=kv or "auto", **options
    )


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_utils import cpu_summary
    from engine.models.loader import gguf_source, resolve_model
    from tests.model.test_engine_vs_transformers import make_prompts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path; default: the bundled SmolLM2")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--window", type=int, default=256, help="perplexity window in tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma-separated KV cache dtypes for each block format (auto: float16 on CPU); "
        "e.g. auto,float32 also runs each format over a float32 cache, labelled FORMAT/kv:float32",
    )
    args = parser.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f and f != "float32"]
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    model_dir = resolve_model(args.model)
    if "gguf" in formats and gguf_source(model_dir) is None:
        print("skipping gguf: the model is not a .gguf file")
        formats.remove("gguf")
    kv_dtypes = [k for k in args.kv_cache_dtypes.split(",") if k]
    formats = [f if kv == "auto" else f"{f}/kv:{kv}" for f in formats for kv in kv_dtypes]
    print(cpu_summary(), f"threads {torch.get_num_threads()}")
    options = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
    text = DATA.read_text()
    results: dict[str, Any] = {}
    reference_tokens: list[list[int]] = []
    print(
        f"{'format':<16} {'ppl':>8} {'vs fp32':>8} {'identical':>10} {'median prefix':>14}  prefixes"
    )
    for fmt in ["float32", *formats]:
        llm = build(args.model, fmt, options)
        prompts = make_prompts(llm.tokenizer)
        ppl, count = perplexity(llm, text, args.window)
        tokens = greedy(llm, prompts, args.max_tokens)
        if fmt == "float32":
            reference_tokens = tokens
        prefixes = [common_prefix(r, t) for r, t in zip(reference_tokens, tokens, strict=True)]
        base = results.get("float32", {}).get("perplexity", ppl)
        results[fmt] = {
            "perplexity": ppl,
            "perplexity_vs_float32": ppl / base - 1.0,
            "tokens_scored": count,
            "matching_prefixes": prefixes,
            "identical": sum(p == args.max_tokens for p in prefixes),
            "median_prefix": statistics.median(prefixes),
        }
        del llm
        gc.collect()
        r = results[fmt]
        print(
            f"{fmt:<16} {r['perplexity']:8.3f} {100 * r['perplexity_vs_float32']:+7.2f}% "
            f"{r['identical']:>4}/{len(r['matching_prefixes'])}{'':<4} "
            f"{r['median_prefix']:>10}/{args.max_tokens}  {r['matching_prefixes']}",
            flush=True,
        )
    print(f"perplexity over {results['float32']['tokens_scored']} tokens of {DATA.name}")
    errors = weight_errors(model_dir, formats)
    if errors:
        print(
            "median relative weight error vs the loaded float32 weights: "
            + ", ".join(f"{fmt} {100 * e:.2f}%" for fmt, e in errors.items())
            + ("; gguf 0 (its blocks are those weights)" if "gguf" in formats else "")
        )
    results["weight_errors"] = errors
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
