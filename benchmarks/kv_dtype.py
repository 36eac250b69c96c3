"""The KV cache's element type on CPU: float32, float16 and bfloat16 (`--kv-cache-dtype`), side by
side in one process, CPU flags printed; never asserts a timing.

`kernels`: the paged attention ops alone at a model's shape (default SmolLM2-135M: 9 query heads, 3
KV heads, head dim 64, 30 layers, each layer its own cache so nothing stays in the CPU's caches):
one decode token (batch 1 and 8) over 128..4096 tokens of context, and a 512-token prefill chunk
after such a context. Median ms per token for all layers, each against float32; bfloat16 runs its
bf16 arithmetic (csrc/attention_bf16.h) on AVX-512 BF16 where it runs, and emulated with AVX2
("bfloat16 emulated", the path of CPUs without it).

`engine`: the bundled model (or --model) in two engines, one per cache type, stepped in turn: time
to first token of a fresh prompt of each length, then the inter-token latency of 32 decoded tokens
after it (median step); a third variant runs the float32 cache with torch's silu(gate) * up in
prefill steps instead of the one-pass kernel (csrc/silu_mul.cpp), what prefill did before both.

    python -m benchmarks.kv_dtype kernels --contexts 128,1024,4096 --rounds 5
    python -m benchmarks.kv_dtype engine --lengths 128,1024,4096 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.bench_utils import cpu_summary

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# kernels: name -> (cache dtype, the bf16 path: 1 the hardware's where it runs, 0 emulated)
KERNEL_VARIANTS = {
    "float32": ("float32", 1),
    "float16": ("float16", 1),
    "bfloat16": ("bfloat16", 1),
    "bfloat16 emulated": ("bfloat16", 0),
}


def _caches(layers: int, blocks: int, block_size: int, kv_heads: int, d: int, dtype: torch.dtype):
    from engine.kernels.attention import allocate_kv_cache

    caches = allocate_kv_cache(layers, blocks, block_size, kv_heads, d, dtype, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape).to(dtype))
    return caches


def kernels(args: argparse.Namespace) -> None:
    from engine.kernels import cpu_kernels
    from engine.kernels.attention import AttentionMetadata

    heads, kv_heads, d, layers, bs = args.heads, args.kv_heads, args.head_dim, args.layers, 16
    contexts = [int(x) for x in args.contexts.split(",")]
    rng = random.Random(0)
    print(cpu_summary())
    print(
        f"threads={torch.get_num_threads()}, {heads} heads / {kv_heads} KV heads, d {d}, {layers} layers"
    )
    names = list(KERNEL_VARIANTS)
    print(f"bf16 attention: {torch.ops.kvserve.attention_bf16_path()}")
    print("| work | context | " + " | ".join(f"{n} ms" for n in names) + " | vs float32 |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for ctx in contexts:
        for batch, chunk in ((1, 1), (8, 1), (1, args.chunk)):
            n_seq, seq_len = batch, ctx + chunk - 1  # the chunk's last row sees ctx + chunk keys
            per_seq = -(-seq_len // bs)
            blocks = n_seq * per_seq + 1
            free = list(range(1, blocks))
            rng.shuffle(free)
            tables = [[free.pop() for _ in range(per_seq)] for _ in range(n_seq)]
            meta = AttentionMetadata.from_lists([chunk] * n_seq, [seq_len] * n_seq, tables, bs)
            q = torch.randn(n_seq * chunk, heads, d)
            times: dict[str, list[float]] = {name: [] for name in names}
            caches = {
                name: _caches(layers, blocks, bs, kv_heads, d, dt) for name, dt in DTYPES.items()
            }
            for rnd in range(args.rounds + 1):
                order = names if rnd % 2 == 0 else names[::-1]
                for name in order:
                    kv, path = KERNEL_VARIANTS[name]
                    saved = torch.ops.kvserve.attention_bf16_select(path)
                    t0 = time.perf_counter()
                    for cache in caches[kv]:
                        if chunk == 1:
                            cpu_kernels.paged_decode_attention(
                                q, cache, meta.block_tables, meta.seq_lens, d**-0.5
                            )
                        else:
                            cpu_kernels.paged_prefill_attention(
                                q, cache, meta.block_tables, meta.query_start_loc,
                                meta.seq_lens, d**-0.5,
                            )  # fmt: skip
                    if rnd:  # the first round warms up
                        times[name].append((time.perf_counter() - t0) * 1000)
                    torch.ops.kvserve.attention_bf16_select(saved)
            med = [statistics.median(times[n]) for n in names]
            work = f"decode, batch {batch}" if chunk == 1 else f"prefill chunk of {chunk}"
            ratios = ", ".join(f"{m / med[0]:.2f}x" for m in med[1:])
            cells = " | ".join(f"{m:.2f}" for m in med)
            print(f"| {work} | {ctx} | {cells} | {ratios} |", flush=True)


def _engine(kv: str, args: argparse.Namespace, max_len: int) -> Any:
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig.from_options(
        args.model, kv_cache_dtype=kv, num_threads=args.threads, max_model_len=max_len,
        enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens,
    )  # fmt: skip
    return LLMEngine(config)


def _run(engine: Any, rid: str, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(TTFT, median inter-token step) of one request alone."""
    from engine import SamplingParams

    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind="cumulative"
    )
    engine.add_request(rid, prompt, params)
    steps: list[float] = []
    last = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    # The steps up to the first token are the prefill; the rest each decode one token.
    decode = steps[-(tokens - 1) :] if tokens > 1 else []
    ttft = sum(steps[: len(steps) - len(decode)])
    return ttft, statistics.median(decode) if decode else 0.0


# name -> (KV cache dtype, the one-pass SwiGLU in prefill steps); the first is the baseline
VARIANTS = {
    "float32 KV, torch SwiGLU": ("float32", False),
    "float32 KV": ("float32", True),
    "float16 KV": ("float16", True),
    "bfloat16 KV": ("bfloat16", True),
}


@contextlib.contextmanager
def _swiglu(one_pass: bool) -> Iterator[None]:
    """Prefill steps with torch's silu(gate) * up instead of csrc/silu_mul.cpp (the one-call decode
    layer always takes the one-pass kernel, so decode steps are the same in every variant)."""
    from engine.models.layers import GatedMLP

    real = GatedMLP._one_pass_silu
    if not one_pass:
        GatedMLP._one_pass_silu = lambda self, gate_up: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        GatedMLP._one_pass_silu = real  # type: ignore[method-assign]


def engine_bench(args: argparse.Namespace) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.tokens + 16
    engines = {kv: _engine(kv, args, max_len) for kv in DTYPES}
    rng = random.Random(0)
    vocab = next(iter(engines.values())).vocab_size
    for kv, eng in engines.items():  # warm-up
        _run(eng, f"warm-{kv}", [rng.randrange(100, vocab) for _ in range(64)], 4)
    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}
    names = list(VARIANTS)
    for rnd in range(args.rounds):
        for length in lengths:
            prompt = [rng.randrange(100, vocab) for _ in range(length)]
            shift = (rnd + length // 1024) % len(names)
            for name in names[shift:] + names[:shift]:
                kv, one_pass = VARIANTS[name]
                with _swiglu(one_pass):
                    ttft, itl = _run(engines[kv], f"{name}{length}.{rnd}", prompt, args.tokens)
                rows.setdefault((length, name), []).append((ttft, itl))
                print(f"  round {rnd} {length:5d} tokens {name}: TTFT {ttft * 1000:7.0f} ms, "
                      f"ITL {itl * 1000:6.2f} ms", flush=True)  # fmt: skip
    print(cpu_summary())
    print(f"threads={torch.get_num_threads()}, {args.tokens} tokens decoded after each prompt")
    base = names[0]
    print(f"ratios against {base!r}")
    print("| prompt | variant | TTFT | ratio | ITL after it | ratio |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        a = [statistics.median(x) for x in zip(*rows[(length, base)], strict=True)]
        for name in names:
            b = [statistics.median(x) for x in zip(*rows[(length, name)], strict=True)]
            print(
                f"| {length} | {name} | {b[0] * 1000:.0f} ms | {b[0] / a[0]:.2f}x | "
                f"{b[1] * 1000:.2f} ms | {b[1] / a[1]:.2f}x |"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=("kernels", "engine"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", default="128,1024,4096", help="kernels: context lengths")
    p.add_argument("--chunk", type=int, default=512, help="kernels: prefill chunk rows")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--model", default=None, help="engine: default the bundled SmolLM2 Q4_1 GGUF")
    p.add_argument("--lengths", default="128,1024,4096", help="engine: prompt lengths")
    p.add_argument("--tokens", type=int, default=32, help="engine: tokens decoded per prompt")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.mode == "kernels":
        kernels(args)
    else:
        engine_bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
