"""Mixture-of-experts decode throughput: kvserve's grouped experts (each expert runs only on the tokens
routed to it) against a dense pass over all experts (every expert on every token, then the routed
outputs picked) on the same random Qwen3-MoE checkpoint, in one process, rounds interleaved; prints
decode tokens/s at the batch size, the ratio and the CPU flags.

    PYTHONPATH=. python -m benchmarks.moe_throughput [--batch 32] [--quantization none,int8]

The default checkpoint is Qwen3-30B-A3B's expert layout (128 experts, top-8, expert width 0.375x
hidden) at hidden 512 with 4 layers and an 8k vocabulary, so the experts dominate a step as they
do in the full model. Both variants give the same tokens (checked and printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("grouped", "dense")


def dense_run_experts(block: Any, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The reference: every expert on all n tokens, then each (token, slot)'s output picked
    ([n, k, hidden]), as SparseMoeBlock.run_experts returns it."""
    every = torch.stack([expert(x) for expert in block.experts])  # [E, n, hidden]
    return every[ids, torch.arange(x.shape[0], device=x.device)[:, None]]


def save_checkpoint(out: Path, args: argparse.Namespace) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.models.loader import resolve_model

    smol = resolve_model(None)
    hidden = args.hidden
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a config kwarg transformers types omit
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        moe_intermediate_size=args.expert_width or (3 * hidden) // 8,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # spread the router so that tokens use many experts, as trained ones do
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smol / name).is_file():
            (out / name).write_bytes((smol / name).read_bytes())
    return out


def decode_rounds(llm: Any, prompts: list[list[int]], steps: int) -> tuple[float, float, list]:
    """Prefill every prompt (untimed), then `steps` decode steps of the whole batch: (wall s,
    process CPU s) per step, and the generated tokens."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + 1, ignore_eos=True, output_kind="cumulative"
    )
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params, None)
    produced: dict[str, list[int]] = {}
    while len(produced) < len(ids):  # prefill steps: until every request has its first token
        for out in engine.step():
            produced[out.request_id] = list(out.outputs[0].token_ids)
    wall, cpu, decoded = time.perf_counter(), time.process_time(), 0
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        decoded += 1
        for out in outs:
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / decoded, cpu / decoded, [finals.get(i) for i in ids]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_utils import cpu_summary
    from engine import LLM
    from engine.models.moe import SparseMoeBlock

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default="none,int8")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_summary(), f"threads {torch.get_num_threads()}")
    grouped_run = SparseMoeBlock.run_experts
    runs = {"grouped": grouped_run, "dense": dense_run_experts}
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_checkpoint(Path(tmp), args)
        cfg = json.loads((folder / "config.json").read_text())
        print(
            f"Qwen3-MoE checkpoint: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
            f"{cfg['num_local_experts']} experts of width {cfg['moe_intermediate_size']}, "
            f"top-{cfg['num_experts_per_tok']}; batch {args.batch} decode, {args.steps} steps x "
            f"{args.rounds} rounds per variant, interleaved"
        )
        gen = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist()
            for _ in range(args.batch)
        ]
        for quantization in args.quantization.split(","):
            llm = LLM(
                str(folder),
                dtype="float32",
                quantization=quantization,
                max_num_seqs=args.batch,
                enable_prefix_caching=False,
                num_threads=args.threads,
            )
            samples: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
            tokens: dict[str, list] = {}
            for round_index in range(args.rounds + 1):  # round 0 warms up
                for variant in VARIANTS:
                    SparseMoeBlock.run_experts = runs[variant]  # type: ignore[method-assign, assignment]
                    try:
                        wall, cpu, out = decode_rounds(llm, prompts, args.steps)
                    finally:
                        SparseMoeBlock.run_experts = grouped_run  # type: ignore[method-assign]
                    tokens[variant] = out
                    if round_index:
                        samples[variant].append((wall, cpu))
            same = sum(a == b for a, b in zip(tokens["grouped"], tokens["dense"], strict=True))
            rates = {}
            for variant in VARIANTS:
                wall = statistics.median(s[0] for s in samples[variant])
                cpu = statistics.median(s[1] for s in samples[variant])
                rates[variant] = (args.batch / wall, args.batch / cpu)
                print(
                    f"  {quantization:>5} {variant:>8}: {rates[variant][0]:8.1f} tokens/s wall, "
                    f"{rates[variant][1]:8.1f} tokens/s per CPU-second (median step {wall * 1e3:.1f} ms)"
                )
            print(
                f"  {quantization:>5} grouped / dense: {rates['grouped'][0] / rates['dense'][0]:.2f}x "
                f"wall, {rates['grouped'][1] / rates['dense'][1]:.2f}x CPU; same tokens for "
                f"{same}/{args.batch} sequences",
                flush=True,
            )
            del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
