"""The pieces of scripts/gpu-check.sh: the device's measured limits (copy bandwidth, bf16 matmul
rate), a same-run transformers baseline (`generate` at batch 1, `generate_batch` continuous
batching), and the final table of kvserve's `kvserve bench` results against both, with ratios.

    python -m benchmarks.gpu_check limits --device cuda --json-out limits.json
    python -m benchmarks.gpu_check baseline --model DIR --device cuda --json-out hf.json
    python -m benchmarks.gpu_check engine --model DIR --device cuda --json-out engine.json
    python -m benchmarks.gpu_check table --model DIR --results DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.openmp_policy import set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads libgomp: the CPU runs (dry, engine alone) as served

import torch  # noqa: E402

from benchmarks.roofline import model_cost  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
TARGETS = "targets (H200, SmolLM2-135M bf16): batch-1 ITL < 2 ms; c256 >= 20,000 output tok/s; >= 5x HF CB"


def _seconds_per_call(op: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean seconds per call over `repeats` calls after warm-up (CUDA events on a GPU)."""
    for _ in range(3):
        op()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            op()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        op()
    return (time.perf_counter() - begin) / repeats


def _copy_seconds(device: torch.device, num_bytes: int, repeats: int) -> float:
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    return _seconds_per_call(lambda: dst.copy_(src), device, repeats)


def measure_limits(device: torch.device, num_bytes: int, square: int, repeats: int) -> dict:
    """Copy bandwidth (bytes read + written per second) and the bf16 matmul rate on random data."""
    copy_s = _copy_seconds(device, num_bytes, repeats)  # its buffers are freed on return
    a = torch.randn(square, square, dtype=torch.bfloat16, device=device)
    b = torch.randn(square, square, dtype=torch.bfloat16, device=device)
    mm_s = _seconds_per_call(lambda: a @ b, device, repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": name,
        "copy_bytes": num_bytes,
        "bandwidth_gbps": 2 * num_bytes / copy_s / 1e9,
        "matmul_square": square,
        "bf16_tflops": 2 * square**3 / mm_s / 1e12,
    }


# ---------------------------------------------------------------- transformers baseline


def _prompts(model_dir: Path, num: int, input_len: int) -> list[list[int]]:
    """The same synthetic prompts `kvserve bench` sends, as token ids cut to input_len."""
    from transformers import AutoTokenizer

    from server.bench import synthetic_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = synthetic_prompts(num, input_len, None, seed=0)
    return [tokenizer.encode(t, add_special_tokens=False)[:input_len] for t in texts]


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 `generate`, then `generate_batch`; the JSON is rewritten after each part, so a
    time limit that stops the second still leaves the first."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    device = torch.device(args.device)
    model_dir = Path(args.model)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype])
    model = model.to(device).eval()
    prompts = _prompts(model_dir, args.num_requests, args.input_len)
    out: dict[str, Any] = {
        "num_requests": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
    }

    # generate(), one request at a time: its per-token time is the batch-1 baseline.
    def one(ids: list[int], new: int) -> None:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    one(prompts[0], 2)
    n = min(args.batch1_requests, len(prompts))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for ids in prompts[:n]:
        one(ids, args.output_len)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    out["generate_batch1"] = {
        "requests": n,
        "output_tok_s": n * args.output_len / seconds,
        "ms_per_token": seconds / (n * args.output_len) * 1e3,
    }
    Path(args.json_out).write_text(json.dumps(out, indent=2))

    # generate_batch(): transformers' continuous-batching manager over every prompt at once.
    try:
        from transformers.generation import ContinuousBatchingConfig

        # No EOS: every request runs to max_new_tokens, like kvserve's ignore_eos requests.
        config = GenerationConfig(
            max_new_tokens=args.output_len, do_sample=False, eos_token_id=None
        )
        cb = ContinuousBatchingConfig(num_blocks=args.cb_num_blocks)  # None: sized by memory
        run = dict(generation_config=config, continuous_batching_config=cb, progress_bar=False)
        model.generate_batch(inputs=prompts[:2], **run)
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, **run)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.generated_tokens) for r in results.values())
        out["continuous_batching"] = {
            "output_tok_s": tokens / seconds,
            "tokens": tokens,
            "seconds": seconds,
        }
    except Exception as e:  # an API change in transformers must not sink the rest of the check
        out["continuous_batching"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """kvserve's engine alone, in this process (no HTTP, no streaming): the same prompts as one
    offline batch, `max_num_seqs` of them at a time, timed on its second run. Its output rate over the server's at the same
    concurrency splits the cost between the engine and the front end. With --profile, a second run
    under cProfile writes the top functions by own time (the engine's Python per step)."""
    import cProfile
    import io
    import pstats
    import statistics

    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    model_dir = Path(args.model)
    prompts = _prompts(model_dir, args.num_requests, args.input_len)
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    # Warm up on the whole workload: the first prefills of each shape compile Triton kernels (the
    # first H200 run counted seconds of it), and that is start-up cost, not the engine's rate.
    llm.generate(prompts, params)
    llm.engine.reset_prefix_cache()  # the timed run computes its prompts again
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    full = [
        r.duration
        for r in llm.engine.recent_steps
        if r.num_prefill_tokens == 0 and r.num_decode_tokens == args.max_num_seqs
    ]
    out: dict[str, Any] = {
        "num_requests": len(prompts),
        "max_num_seqs": args.max_num_seqs,
        "output_tok_s": tokens / seconds,
        "seconds": seconds,
        "full_decode_steps": len(full),
        "full_decode_step_ms_p50": statistics.median(full) * 1e3 if full else None,
    }
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts, params)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
        Path(args.profile).write_text(text.getvalue())
    return out


# ---------------------------------------------------------------- the table


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}"


def build_table(model_dir: Path, results: Path, levels: list[int], dtype: str) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    limits = _load(results / "limits.json") or {}
    hf = _load(results / "hf_baseline.json") or {}
    alone = _load(results / "engine.json") or {}
    runs = {c: _load(results / f"bench_c{c}.json") for c in levels}
    bits = 32 if dtype == "float32" else 16
    lines = [TARGETS]
    if limits:
        lines.append(
            f"device {limits['device']}: copy {limits['bandwidth_gbps']:,.0f} GB/s (read+write), "
            f"bf16 matmul {limits['bf16_tflops']:,.0f} TFLOP/s ({limits['matmul_square']}^3)"
        )
    lines.append(
        f"{'concurrency':>11} {'out tok/s':>11} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} "
        f"{'ITL p99 ms':>11} {'of limit':>20}"
    )
    for c, run in runs.items():
        if run is None:
            lines.append(f"{c:>11} {'(no result)':>11}")
            continue
        cfg = run.get("config", {})
        done = run.get("completed") or 0
        prompt_len = run["total_prompt_tokens"] / done if done else cfg.get("input_len", 128)
        cost = model_cost(config, bits, int(prompt_len + cfg.get("output_len", 64) / 2))
        note = ""
        itl = run["itl_ms"]["median"]
        if limits and c == 1 and not math.isnan(itl):
            # Each decode step reads the weights and the context's KV once: those bytes over the
            # copy's rate (bytes read + written per second) is the floor.
            bytes_per_step = cost.weight_bytes + cost.kv_bytes_per_token * cost.context_len
            floor_ms = bytes_per_step / (limits["bandwidth_gbps"] * 1e9) * 1e3
            note = f"{100 * floor_ms / itl:.1f}% of bandwidth"
        elif limits and c == max(levels):
            achieved = run["total_token_throughput"] * cost.flops_per_token
            note = f"{100 * achieved / (limits['bf16_tflops'] * 1e12):.2f}% of bf16 compute"
        lines.append(
            f"{c:>11} {_fmt(run['output_throughput']):>11} {_fmt(run['ttft_ms']['median'], 2):>12} "
            f"{_fmt(itl, 3):>11} {_fmt(run['itl_ms'].get('p99'), 3):>11} {note:>20}"
        )
    top_run = runs.get(max(levels))
    if alone.get("output_tok_s"):
        step = alone.get("full_decode_step_ms_p50")
        line = (
            f"kvserve engine alone (no HTTP), {alone['max_num_seqs']} at a time: "
            f"{_fmt(alone['output_tok_s'])} output tok/s"
            + (f", full decode step p50 {step:.2f} ms" if step else "")
        )
        if top_run and top_run.get("output_throughput"):
            line += f"; the server at c{max(levels)} reaches {top_run['output_throughput'] / alone['output_tok_s']:.0%} of it"
        lines.append(line)
    if hf:
        b1 = hf.get("generate_batch1", {})
        cb = hf.get("continuous_batching", {})
        lines.append(
            f"transformers generate, batch 1: {_fmt(b1.get('ms_per_token'), 3)} ms/token "
            f"({_fmt(b1.get('output_tok_s'))} tok/s)"
        )
        lines.append(
            "transformers continuous batching: "
            + (cb["error"] if "error" in cb else f"{_fmt(cb.get('output_tok_s'))} output tok/s")
        )
        one, top = runs.get(1), runs.get(max(levels))
        if one and b1.get("ms_per_token"):
            speedup = b1["ms_per_token"] / one["itl_ms"]["median"]
            lines.append(f"ratio batch 1: generate ms/token over kvserve ITL = {speedup:.2f}x")
        if top and cb.get("output_tok_s"):
            ratio = top["output_throughput"] / cb["output_tok_s"]
            lines.append(f"ratio c{max(levels)}: kvserve {ratio:.2f}x transformers CB output tok/s")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    lim = sub.add_parser("limits", help="measure copy bandwidth and bf16 matmul rate")
    lim.add_argument("--device", default="cuda")
    lim.add_argument("--bytes", type=int, default=2 << 30, help="bytes per copied tensor")
    lim.add_argument("--square", type=int, default=8192, help="square bf16 matmul size")
    lim.add_argument("--repeats", type=int, default=10)
    lim.add_argument("--json-out", required=True)
    base = sub.add_parser("baseline", help="transformers generate + continuous batching")
    base.add_argument("--model", required=True, help="model folder (same weights as kvserve)")
    base.add_argument("--device", default="cuda")
    base.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    base.add_argument("--input-len", type=int, default=128)
    base.add_argument("--output-len", type=int, default=64)
    base.add_argument("--num-requests", type=int, default=256, help="prompts for generate_batch")
    base.add_argument("--batch1-requests", type=int, default=3, help="sequential generate calls")
    base.add_argument("--cb-num-blocks", type=int, default=None, help="KV blocks (default: auto)")
    base.add_argument("--json-out", required=True)
    eng = sub.add_parser("engine", help="kvserve's engine alone: offline generate, no HTTP")
    eng.add_argument("--model", required=True)
    eng.add_argument("--device", default="cuda")
    eng.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    eng.add_argument("--input-len", type=int, default=128)
    eng.add_argument("--output-len", type=int, default=128)
    eng.add_argument("--num-requests", type=int, default=768)
    eng.add_argument("--max-num-seqs", type=int, default=256)
    eng.add_argument("--profile", default=None, help="write a cProfile top-45 (own time) here")
    eng.add_argument("--json-out", required=True)
    tab = sub.add_parser("table", help="print the final table from the results folder")
    tab.add_argument("--model", required=True)
    tab.add_argument("--results", required=True)
    tab.add_argument("--levels", default="1,32,256")
    tab.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "limits":
        result = measure_limits(torch.device(args.device), args.bytes, args.square, args.repeats)
    elif args.command == "baseline":
        result = run_baseline(args)
    elif args.command == "engine":
        result = run_engine(args)
    else:
        levels = [int(c) for c in args.levels.split(",")]
        print(build_table(Path(args.model), Path(args.results), levels, args.dtype))
        return 0
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
