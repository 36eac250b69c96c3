"""LoRA serving throughput: the bundled model (its GGUF Q4_1 blocks on CPU, the default) at concurrency
32 with every request on the base model, every request on one adapter, and requests spread over four
adapters (rank 16 on every linear module), rounds interleaved in one process on one engine; prints
output tokens/s per variant, the ratios to the base model, the decode step times and the CPU flags.

    PYTHONPATH=. python -m benchmarks.lora_throughput [--concurrency 32] [--rounds 3] [--rank 16]

The adapters are random PEFT folders written here (adapter_config.json + adapter_model.safetensors).
Targets (issue 27): one adapter >= 0.8x the base model's throughput, four adapters >= 0.75x.
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

import torch
from safetensors.torch import save_file

from benchmarks.bench_utils import cpu_summary

MODULES = {  # PEFT module path -> (out_features, in_features) of SmolLM2-135M
    "self_attn.q_proj": (576, 576),
    "self_attn.k_proj": (192, 576),
    "self_attn.v_proj": (192, 576),
    "self_attn.o_proj": (576, 576),
    "mlp.gate_proj": (1536, 576),
    "mlp.up_proj": (1536, 576),
    "mlp.down_proj": (576, 1536),
}
VARIANTS = ("base", "one adapter", "4 adapters")


def write_adapter(out: Path, rank: int, num_layers: int, seed: int) -> Path:
    """A random PEFT LoRA folder for SmolLM2-135M on every linear module."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (out_f, in_f) in MODULES.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted(m.rsplit(".", 1)[1] for m in MODULES),
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def add_all(
    engine: Any, prompts: list[list[int]], loras: list[str | None], max_tokens: int
) -> None:
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras[: len(prompts)], strict=True)):
        engine.add_request(f"r{i}", prompt, params, lora=lora)


def run_interleaved(
    engines: dict[str, Any],
    plans: dict[str, list[str | None]],
    prompts: list[list[int]],
    max_tokens: int,
) -> dict[str, dict[str, float]]:
    """All variants' requests at once, one engine each, stepped in turn (so machine noise hits all
    alike); per variant: output tokens / its own step time, and its median decode step."""
    for name, engine in engines.items():
        add_all(engine, prompts, plans[name], max_tokens)
    busy = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    decode: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outs = engine.step()
            busy[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
            stats = engine.last_step
            if stats is not None and stats.kind == "decode":
                decode[name].append(stats.duration)
    return {
        name: {
            "tok_s": tokens[name] / busy[name],
            "decode_ms": 1e3 * statistics.median(decode[name]),
        }
        for name in engines
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            (f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", args.rank, 30, seed=i)))
            for i in range(4)
        ]
        config = EngineConfig.from_options(
            None,
            max_num_seqs=args.concurrency,
            enable_prefix_caching=False,
            kv_cache_memory=256 << 20,
            lora_modules=adapters,
            max_loras=4,
            max_lora_rank=max(64, args.rank),
            num_threads=args.threads,
        )
        # One engine per variant (the same weights and adapters), stepped in turn.
        engines = {variant: LLMEngine(config) for variant in VARIANTS}
        rng = random.Random(0)
        n = args.concurrency
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(n)]
        plans: dict[str, list[str | None]] = {
            "base": [None] * n,
            "one adapter": ["a0"] * n,
            "4 adapters": [f"a{i % 4}" for i in range(n)],
        }
        model: Any = engines["base"].model
        print(cpu_summary())
        print(
            f"bundled model, {type(model.layers[0].mlp.down_weight).__name__} weights, "
            f"rank {args.rank} on all linear modules, concurrency {n}, prompt {args.prompt_len}, "
            f"{args.max_tokens} output tokens, torch threads {torch.get_num_threads()}"
        )
        run_interleaved(engines, plans, prompts[:4], 4)  # warm-up
        results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant, got in run_interleaved(engines, plans, prompts, args.max_tokens).items():
                results[variant].append(got)
        base_tok = statistics.median(x["tok_s"] for x in results["base"])
        base_step = statistics.median(x["decode_ms"] for x in results["base"])
        for variant in VARIANTS:
            tok = statistics.median(x["tok_s"] for x in results[variant])
            step = statistics.median(x["decode_ms"] for x in results[variant])
            print(
                f"{variant:>12}: {tok:7.1f} output tok/s ({tok / base_tok:.2f}x base), "
                f"decode step {step:6.1f} ms ({base_step / step:.2f}x base speed)"
            )


if __name__ == "__main__":
    main()
