"""Decode step time per token of a Qwen3 random checkpoint shaped like Qwen3-0.6B (28 layers, hidden
1024, 16 q / 8 kv heads, head_dim 128) against a Llama checkpoint of the same shapes and parameter
count (everything but Qwen3's q/k norms), float32 and int8 blocks, engines stepped in turn in one
process. Prints medians and the Qwen3/Llama ratio; never asserts a timing.

    python benchmarks/family_step_time.py                  # full shape (~2.4 GB per float32 model)
    python benchmarks/family_step_time.py --layers 4       # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_utils import cpu_summary

SHAPE: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def write_checkpoint(family: str, layers: int, out: Path, seed: int = 0) -> Path:
    """A random-weight folder (config.json + model.safetensors) without running transformers'
    init: the parameter names and shapes come from the model built on the meta device."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_class = Qwen3Config if family == "qwen3" else LlamaConfig
    arch = "Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"
    config = config_class(**SHAPE, num_hidden_layers=layers, architectures=[arch])
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in meta_model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            tensors[name] = torch.randn(param.shape, generator=gen) * (param.shape[-1] ** -0.5)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    copy_tokenizer(out)
    return out


def copy_tokenizer(out: Path) -> None:
    from engine.models.loader import resolve_model

    smol = resolve_model(None)  # the bundled SmolLM2's tokenizer: prompts are random ids anyway
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smol / name).is_file():
            (out / name).write_bytes((smol / name).read_bytes())


def build_engine(folder: Path, quantization: str, batch: int) -> Any:
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    options = dict(
        dtype="float32",
        quantization=quantization,
        max_num_seqs=batch,
        num_blocks=18 * batch + 8,
        enable_prefix_caching=False,
        log_stats_interval=0,
    )
    return LLMEngine(EngineConfig.from_options(str(folder), **options))


def start_decoding(engine: Any, batch: int, prompt_len: int, seed: int) -> None:
    """Add `batch` requests and step until every one has its first token (all decode from then)."""
    import random

    from engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = [f"r{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(100, engine.vocab_size) for _ in range(prompt_len)]
        engine.add_request(rid, prompt, params)
    while any(engine.groups[rid].seqs[0].num_output_tokens == 0 for rid in ids):
        engine.step()


def timed_step(engine: Any) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def compare(folders: dict[str, Path], quantization: str, batch: int, args: Any) -> dict:
    engines = {name: build_engine(folder, quantization, batch) for name, folder in folders.items()}
    for engine in engines.values():
        start_decoding(engine, batch, args.prompt_len, seed=1)
        for _ in range(args.warmup):
            timed_step(engine)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.steps):  # interleaved: each round steps every engine once
        for name, engine in engines.items():
            times[name].append(timed_step(engine))
    per_token = {name: statistics.median(t) / batch * 1e3 for name, t in times.items()}
    ratio = per_token["qwen3"] / per_token["llama"]
    print(
        f"{quantization:>5} batch {batch:>2}: ms/token qwen3 {per_token['qwen3']:.2f}  "
        f"llama {per_token['llama']:.2f}  qwen3/llama {ratio:.3f}",
        flush=True,
    )
    for engine in engines.values():
        engine.runner.model = None
    return {"quantization": quantization, "batch": batch, "ms_per_token": per_token, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quantization", nargs="+", default=["none", "int8"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_summary())
    print(f"torch threads {torch.get_num_threads()}; {args.layers} layers, {SHAPE}")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvserve-family-") as tmp:
        folders = {
            family: write_checkpoint(family, args.layers, Path(tmp) / family)
            for family in ("qwen3", "llama")
        }
        for quantization in args.quantization:
            for batch in args.batch:
                results.append(compare(folders, quantization, batch, args))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
