"""Quality of each weight format against float32 on the same model: greedy continuations of the
engine-parity prompt set (matching-prefix lengths), perplexity on a fixed public-domain text, and the
weight error of re-quantizing the loaded weights. Prints the CPU it ran on.

    PYTHONPATH=. python -m benchmarks.quant_quality                # bundled SmolLM2, int8 and int4
    PYTHONPATH=. python -m benchmarks.quant_quality --formats int8 --max-tokens 64
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


def weight_errors(model_dir: Path) -> dict[str, float]:
    """Median relative Frobenius error of each format's weights against the loaded float32 weights
    (for the bundled GGUF these are its Q4_1 values, dequantized exactly)."""
    from engine.models.int8_linear import Int8Weight
    from engine.models.loader import load_model
    from engine.models.quantization import Int4Weight

    model = load_model(model_dir, "float32", "cpu").model
    errors: dict[str, list[float]] = {"int8": [], "int4": []}
    for owner, attr in model.quantizable_weights():
        w = getattr(owner, attr).data
        for fmt, packed in (("int8", Int8Weight(w)), ("int4", Int4Weight(w, 32))):
            errors[fmt].append(((packed.dequantize().float() - w).norm() / w.norm()).item())
    return {fmt: statistics.median(e) for fmt, e in errors.items()}


def build(model: str | None, fmt: str, options: dict[str, Any]) -> Any:
    """An LLM serving `fmt`. int4 is torch's weight-only kernel (float activations), whose output is
    the float matmul with the dequantized int4 weights; that matmul stands in for it here, since
    the kernel itself is ~2 GFLOP/s on AVX2 CPUs (start-up refuses int4 there)."""
    from engine import LLM
    from engine.models.quantization import Int4Weight

    quantization = "none" if fmt in ("float32", "int4") else fmt
    llm = LLM(model, dtype="float32", quantization=quantization, **options)
    if fmt == "int4":
        with torch.no_grad():
            for owner, attr in llm.engine.model.quantizable_weights():
                weight = getattr(owner, attr)
                packed = Int4Weight(weight.data, 32).dequantize().float()
                # a new tensor, not .data: a tied head's embedding lookups stay float, as served
                setattr(owner, attr, torch.nn.Parameter(packed, requires_grad=False))
    return llm


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_utils import cpu_summary
    from tests.model.test_engine_vs_transformers import make_prompts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path; default: the bundled SmolLM2")
    parser.add_argument("--formats", default="int8,int4", help="comma-separated formats")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--window", type=int, default=256, help="perplexity window in tokens")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(cpu_summary())
    options = {"max_num_seqs": 32, "max_num_batched_tokens": 1024}
    text = DATA.read_text()
    results: dict[str, Any] = {}
    reference_tokens: list[list[int]] = []
    print(
        f"{'format':<8} {'ppl':>8} {'vs fp32':>8} {'identical':>10} {'median prefix':>14}  prefixes"
    )
    for fmt in ["float32", *args.formats.split(",")]:
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
            f"{fmt:<8} {r['perplexity']:8.3f} {100 * r['perplexity_vs_float32']:+7.2f}% "
            f"{r['identical']:>4}/{len(r['matching_prefixes'])}{'':<4} "
            f"{r['median_prefix']:>10}/{args.max_tokens}  {r['matching_prefixes']}",
            flush=True,
        )
    from engine.models.loader import resolve_model

    model_dir = resolve_model(args.model)
    errors = weight_errors(model_dir)
    print(
        "median relative weight error vs the loaded float32 weights: "
        + ", ".join(f"{fmt} {100 * e:.2f}%" for fmt, e in errors.items())
    )
    results["weight_errors"] = errors
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
