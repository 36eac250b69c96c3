"""Offline throughput: the same prompts through kvserve's `LLM` and through transformers `generate`
(one prompt at a time, and as one left-padded batch), greedy with fixed output lengths."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_utils import cpu_summary
from server.bench import load_tokenizer, ratio, synthetic_prompts

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("kvserve", "hf-sequential", "hf-batched")


def make_prompts(
    model_dir: Path, num: int, input_len: int, spread: float, seed: int
) -> list[list[int]]:
    """Token-id prompts with lengths spread over [input_len * (1 - spread), input_len]."""
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer is not None
    rng = random.Random(seed)
    texts = synthetic_prompts(num, input_len, tokenizer, seed)
    prompts = []
    for text in texts:
        ids = tokenizer.encode(text)[:input_len]
        length = rng.randint(max(1, round(input_len * (1 - spread))), input_len)
        prompts.append(ids[:length])
    return prompts


def run_kvserve(
    model_dir: Path, dtype: str, prompts: list[list[int]], output_len: int, options: dict[str, Any]
) -> tuple[float, list[list[int]]]:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, **options)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    gc.collect()
    return seconds, tokens


def _hf_model(model_dir: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch_dtype = TORCH_DTYPES.get(dtype, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
    return model.eval()


def _gen_kwargs(model: Any, output_len: int) -> dict[str, Any]:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id
    return {
        "max_new_tokens": output_len,
        "min_new_tokens": output_len,  # EOS suppressed: every request yields output_len tokens
        "do_sample": False,
        "pad_token_id": pad if isinstance(pad, int) else pad[0],
    }


@torch.inference_mode()
def run_hf_sequential(
    model: Any, prompts: list[list[int]], output_len: int
) -> tuple[float, list[list[int]]]:
    kwargs = _gen_kwargs(model, output_len)
    warm = {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
    model.generate(torch.tensor([prompts[0]]), **warm)
    tokens = []
    start = time.perf_counter()
    for ids in prompts:
        input_ids = torch.tensor([ids])  # [1, prompt_len]
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        tokens.append(out[0, len(ids) :].tolist())
    return time.perf_counter() - start, tokens


@torch.inference_mode()
def run_hf_batched(
    model: Any, prompts: list[list[int]], output_len: int
) -> tuple[float, list[list[int]]]:
    kwargs = _gen_kwargs(model, output_len)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), kwargs["pad_token_id"])  # [batch, width]
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):  # left padding: every prompt ends at the last column
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    warm = {**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
    model.generate(input_ids[:1], attention_mask=mask[:1], **warm)
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - start
    return seconds, [row[width:].tolist() for row in out]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--model", default=None, help="model folder or .gguf (default: the bundled SmolLM2)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", *TORCH_DTYPES),
        default="auto",
        help="kvserve's --dtype (auto: its default); transformers runs auto as float32",
    )
    p.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "int4"),
        default="auto",
        help="kvserve's weight format (auto: its default, int8 on x86 CPUs)",
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128, help="longest prompt in tokens")
    p.add_argument(
        "--length-spread",
        type=float,
        default=0.5,
        help="prompt lengths vary down to (1-spread)*input-len",
    )
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}"
    )
    p.add_argument(
        "--engine-options", default="{}", help="JSON engine options, e.g. '{\"max_num_seqs\": 32}'"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown or not 0.0 <= args.length_spread < 1.0:
        print(
            f"error: unknown modes {sorted(unknown)} or --length-spread not in [0, 1)",
            file=sys.stderr,
        )
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.models.loader import resolve_model

    model_dir = resolve_model(args.model)
    prompts = make_prompts(
        model_dir, args.num_prompts, args.input_len, args.length_spread, args.seed
    )
    results: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[list[int]]] = {}
    if "kvserve" in modes:
        options = {"quantization": args.quantization, **json.loads(args.engine_options)}
        seconds, tokens["kvserve"] = run_kvserve(
            model_dir, args.dtype, prompts, args.output_len, options
        )
        results["kvserve"] = {"seconds": seconds}
    hf_modes = [m for m in modes if m.startswith("hf-")]
    if hf_modes:
        model = _hf_model(model_dir, args.dtype)
        for mode in hf_modes:
            runner = run_hf_sequential if mode == "hf-sequential" else run_hf_batched
            seconds, tokens[mode] = runner(model, prompts, args.output_len)
            results[mode] = {"seconds": seconds}
    for mode, entry in results.items():
        entry["output_tokens"] = sum(len(t) for t in tokens[mode])
        entry["output_tok_s"] = entry["output_tokens"] / entry["seconds"]
        if "kvserve" in tokens and mode != "kvserve":
            same = sum(a == b for a, b in zip(tokens["kvserve"], tokens[mode], strict=True))
            entry["identical_to_kvserve"] = same
    print(format_report(results, args, prompts))
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2)
        )
    return 0


def format_report(
    results: dict[str, dict[str, Any]], args: argparse.Namespace, prompts: list
) -> str:
    lengths = [len(p) for p in prompts]
    lines = [
        f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.output_len} output "
        f"tokens each, kvserve dtype {args.dtype} quantization {args.quantization}, "
        f"{torch.get_num_threads()} threads; {cpu_summary()}",
        f"{'mode':<15}{'seconds':>10}{'out tokens':>12}{'out tok/s':>12}{'kvserve/this':>14}{'same tokens':>13}",
    ]
    kv = results.get("kvserve", {}).get("output_tok_s", float("nan"))
    for mode, r in results.items():
        same = f"{r['identical_to_kvserve']}/{len(prompts)}" if "identical_to_kvserve" in r else "-"
        lines.append(
            f"{mode:<15}{r['seconds']:>10.2f}{r['output_tokens']:>12}{r['output_tok_s']:>12.1f}"
            f"{ratio(kv, r['output_tok_s']):>13.2f}x{same:>13}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
