"""KV offload tiers benchmark, in-process, variants interleaved in one run (CPU flags printed):

1. Multi-turn chat: S sessions take turns for T turns, each turn resending the whole history (user
   tokens + the answers so far) on a KV pool too small for all sessions, so a session's prefix is
   evicted before it comes back. Time to first token (median) and prompt tokens computed, with no
   tiers, with the host-memory tier and with the disk tier only.
2. Decode throughput at concurrency C when the tiers hold nothing that hits (every prompt distinct;
   two waves, so the second wave's blocks evict the first's and every eviction is saved): tiers off
   against host tier and disk tier.

The model is SmolLM2-135M's shape with `--layers` of its 30 layers and random weights (the ratios of
recompute to load-back scale with the layer count only weakly: both KV bytes and compute are per
layer), or the bundled SmolLM2 itself with `--layers 0`.

    python -m benchmarks.kv_offload      # 4 sessions x 20 turns of 200 tokens (to 4k), 4 layers
    python -m benchmarks.kv_offload --turns 5 --decode-reps 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import cpu_summary


def make_model(layers: int, out: Path) -> Path:
    """SmolLM2's config with `layers` layers and random weights, with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.loader import resolve_model

    smol = resolve_model(None)
    config = json.loads((smol / "config.json").read_text())
    config["num_hidden_layers"] = layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    model.save_pretrained(out, safe_serialization=True)
    for path in smol.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation")):
            (out / path.name).write_bytes(path.read_bytes())
    return out


def _engine(model: str | None, args: argparse.Namespace, variant: str, tmp: Path, **opts: Any):
    from engine import LLM

    tiers: dict[str, Any] = {}
    if variant == "memory":
        tiers = {"kv_offload_memory": 8 << 30}
    elif variant == "disk":
        tiers = {"kv_offload_dir": str(tmp / f"disk-{time.monotonic_ns()}")}
    return LLM(model, num_threads=args.threads, block_size=16, **tiers, **opts)


def chat(model: str | None, args: argparse.Namespace, variants: list[str], tmp: Path) -> dict:
    from engine import SamplingParams

    turn_tokens = args.user_tokens + args.answer_tokens
    max_history = args.turns * turn_tokens
    num_blocks = int(args.pool_sessions * max_history / 16) + 4
    engines = {
        v: _engine(model, args, v, tmp, num_blocks=num_blocks, max_model_len=max_history + 64)
        for v in variants
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    rng = random.Random(7)
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    ttft: dict[str, list[float]] = {v: [] for v in variants}
    computed = dict.fromkeys(variants, 0)
    prompt_total = 0
    same = True
    for turn in range(args.turns):
        for s in range(args.sessions):
            prompt = histories[s] + [rng.randrange(100, 40000) for _ in range(args.user_tokens)]
            prompt_total += len(prompt)
            answers = []
            order = variants[turn % len(variants) :] + variants[: turn % len(variants)]
            for v in order:
                out = engines[v].generate([prompt], params)[0]
                m = out.metrics
                assert m is not None and m.first_token_time is not None
                ttft[v].append(m.first_token_time - m.arrival_time)
                computed[v] += len(prompt) - out.num_cached_tokens
                answers.append(out.outputs[0].token_ids)
            same = same and all(a == answers[0] for a in answers)
            histories[s] = prompt + list(answers[0])
        print(f"  turn {turn + 1}/{args.turns}: history {len(histories[0])} tokens", flush=True)
    result: dict[str, Any] = {
        "pool_blocks": num_blocks,
        "max_history_tokens": max(len(h) for h in histories),
        "prompt_tokens": prompt_total,
        "greedy_identical": same,
    }
    for v in variants:
        result[v] = {
            "ttft_median_ms": 1000 * statistics.median(ttft[v]),
            "prompt_tokens_computed": computed[v],
        }
        stats = engines[v].engine.kv_store.stats if engines[v].engine.kv_store else None
        if stats is not None:
            result[v]["tier_hits"] = stats.memory_hits + stats.disk_hits
            result[v]["load_seconds"] = round(stats.load_seconds, 3)
    return result


def _decode_run(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(decode-step tokens/s, generated tokens/s end to end) for all `prompts` submitted at once."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params)
    decode_tokens, decode_time, generated = 0, 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        step = engine.last_step
        if step is not None:
            generated += step.num_generation_tokens
            if step.kind == "decode":
                decode_tokens += step.num_decode_tokens
                decode_time += step.duration
    return decode_tokens / decode_time, generated / (time.perf_counter() - t0)


def decode(model: str | None, args: argparse.Namespace, variants: list[str], tmp: Path) -> dict:
    c, plen, gen = args.concurrency, args.decode_prompt, args.decode_tokens
    num_blocks = int(1.25 * c * -(-(plen + gen) // 16))  # one wave fits; the next evicts it
    engines = {
        v: _engine(model, args, v, tmp, num_blocks=num_blocks, max_num_seqs=c) for v in variants
    }
    rates: dict[str, list[float]] = {v: [] for v in variants}
    e2e: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.decode_reps):
        rng = random.Random(1000 + rep)
        waves = [
            [[rng.randrange(100, 40000) for _ in range(plen)] for _ in range(c)] for _ in range(2)
        ]
        order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
        for v in order:
            for wave in waves:  # the second wave evicts (and the tiers save) the first's blocks
                r, e = _decode_run(engines[v], wave, gen)
                rates[v].append(r)
                e2e[v].append(e)
        print(f"  decode rep {rep + 1}/{args.decode_reps}", flush=True)
    result: dict = {"pool_blocks": num_blocks}
    for v in variants:
        stats = engines[v].engine.kv_store.stats if engines[v].engine.kv_store else None
        result[v] = {
            "decode_tok_s_median": statistics.median(rates[v]),
            "e2e_tok_s_median": statistics.median(e2e[v]),
            "tier_hits": (stats.memory_hits + stats.disk_hits) if stats else 0,
            "blocks_saved": stats.saved_blocks if stats else 0,
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="layers of SmolLM2's shape (0: SmolLM2)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--user-tokens", type=int, default=160, help="new user tokens per turn")
    ap.add_argument("--answer-tokens", type=int, default=40)
    ap.add_argument(
        "--pool-sessions", type=float, default=1.5, help="pool size in longest histories"
    )
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--decode-reps", type=int, default=3)
    # One thread: on a shared 2-core machine, 2 threads stall on descheduled peers (20x slower).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()

    print(cpu_summary(), flush=True)
    variants = ["off", "memory", "disk"]
    with tempfile.TemporaryDirectory(prefix="kv-offload-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model = None
        if args.layers:
            model = str(make_model(args.layers, tmp / "model"))
        print(
            f"model: {'SmolLM2-135M' if model is None else f'SmolLM2 shape, {args.layers} layers'}"
        )
        report: dict = {}
        if not args.skip_chat:
            chat_result = report["chat"] = chat(model, args, variants, tmp)
            off = chat_result["off"]
            for v in ("memory", "disk"):
                tier = chat_result[v]
                tier["ttft_ratio_off_over_tier"] = off["ttft_median_ms"] / tier["ttft_median_ms"]
                computed = max(1, tier["prompt_tokens_computed"])
                tier["computed_ratio_off_over_tier"] = off["prompt_tokens_computed"] / computed
        if not args.skip_decode:
            dec = report["decode"] = decode(model, args, variants, tmp)
            for v in ("memory", "disk"):
                off_rate = dec["off"]["decode_tok_s_median"]
                dec[v]["decode_cost_pct"] = 100 * (1 - dec[v]["decode_tok_s_median"] / off_rate)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
