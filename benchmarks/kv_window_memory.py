"""KV memory one sequence holds with and without sliding-window release, for a sequence 8x its window
long: the real scheduler and KV cache manager (no model, no torch) on the layer layouts of Gemma 3
(1B, 4B: 5 local : 1 global) and Mistral 7B (every layer slides), from their transformers configs.
Bytes are what the cache tensors reserve for the blocks held (block rounding and the padding of a
shorter last group included); "one window" is the sliding layers' KV of `window` tokens. With
--engine, the same measurement on the real engine with a tiny random-weight Gemma 3 checkpoint.

    python -m benchmarks.kv_window_memory [--block-size 16] [--budget 2048] [--engine]
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_groups import KVCacheSpec, kv_cache_spec
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

DECODE_TOKENS = 64  # the sequence ends with this many decode steps
BF16 = 2  # bytes per cached element


@dataclass(frozen=True)
class Layout:
    name: str
    windows: list[int | None]  # per layer
    num_kv_heads: int
    head_dim: int

    @property
    def window(self) -> int:
        return next(w for w in self.windows if w is not None)


def layouts() -> list[Layout]:
    from transformers import Gemma3TextConfig, MistralConfig

    from engine.models.decoder import layer_windows_of

    found = []
    for name, layers, window, kv_heads in (("Gemma 3 1B", 26, 512, 1), ("Gemma 3 4B", 34, 1024, 4)):
        cfg = Gemma3TextConfig(
            num_hidden_layers=layers, sliding_window=window, num_key_value_heads=kv_heads
        )
        found.append(Layout(name, layer_windows_of(cfg), kv_heads, cfg.head_dim))
    mistral = MistralConfig(max_position_embeddings=32768)  # Mistral 7B v0.1: 4096-token window
    head_dim = mistral.hidden_size // mistral.num_attention_heads
    found.append(
        Layout("Mistral 7B", layer_windows_of(mistral), mistral.num_key_value_heads, head_dim)
    )
    return found


def bytes_per_block(spec: KVCacheSpec, layout: Layout, block_size: int) -> int:
    """What one block id reserves: its slot in each of the group_size cache tensors, K and V."""
    return 2 * spec.group_size * block_size * layout.num_kv_heads * layout.head_dim * BF16


def simulate(layout: Layout, block_size: int, budget: int) -> dict[str, float]:
    """One sequence of 8 windows (prompt chunked by `budget`, then DECODE_TOKENS decodes) through
    the scheduler; KV bytes its sliding groups hold at the end and at their peak."""
    length = 8 * layout.window
    spec = kv_cache_spec(layout.windows)
    num_blocks = len(spec.groups) * -(-length // block_size) + 1
    kv = KVCacheManager(num_blocks, block_size, windows=spec.windows)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=budget), kv)
    prompt = [7 + i % 1000 for i in range(length - DECODE_TOKENS)]
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
    group = RequestGroup("r", None, prompt, params, DECODE_TOKENS)
    seq = Sequence("r/0", group, 0, list(prompt), len(prompt))
    group.seqs.append(seq)
    sched.add_group(group)
    peak_decode = peak_step = held = 0
    while seq.num_tokens < length or seq.num_computed_tokens < seq.num_tokens - 1:
        out = sched.schedule()
        # While a step runs its chunk's blocks are held next to the window's (given back after).
        peak_step = max(peak_step, sliding_blocks(kv, seq))
        sched.update_from_output(out, RunnerOutput())
        held = sliding_blocks(kv, seq)
        if seq.num_output_tokens:
            peak_decode = max(peak_decode, held)
        for s in out.scheduled:
            if s.needs_sample:
                s.seq.append_token(11)
    full_held = kv.num_held_blocks(seq) - held
    per_block = bytes_per_block(spec, layout, block_size)
    num_sliding = sum(1 for w in layout.windows if w is not None)
    per_token_sliding = 2 * num_sliding * layout.num_kv_heads * layout.head_dim * BF16
    one_window = layout.window * per_token_sliding
    full_blocks = -(-seq.num_tokens // block_size)
    without = full_blocks * block_size * per_token_sliding  # every block kept, no window
    sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
    assert kv.num_free_blocks == kv.num_blocks
    per_token_all = 2 * len(layout.windows) * layout.num_kv_heads * layout.head_dim * BF16
    return {
        "tokens": seq.num_tokens,
        "groups": len(spec.groups),
        "all_without": full_blocks * block_size * per_token_all,
        "all_with": (held + full_held) * per_block,
        "without": without,
        "with": held * per_block,
        "peak_decode": peak_decode * per_block,
        "peak_step": peak_step * per_block,
        "one_window": one_window,
    }


def sliding_blocks(kv: KVCacheManager, seq: Sequence) -> int:
    """Blocks `seq` holds in the sliding groups (placeholders left out)."""
    tables, skipped = kv.get_block_tables(seq), kv.num_skipped[seq.seq_id]
    return sum(len(tables[g]) - skipped[g] for g in kv.sliding)


def engine_run(block_size: int, budget: int, window: int = 128) -> dict[str, float]:
    """The same on the real engine: a random-weight 6-layer Gemma 3 (5 local : 1 global, float32),
    one sequence of 8 windows, blocks read from the running engine's tables."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from engine import SamplingParams as Params
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.decoder import layer_windows_of
    from engine.models.loader import resolve_model

    smol = resolve_model(None)
    cfg = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=window,
        max_position_embeddings=16 * window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    windows = layer_windows_of(cfg)
    layout = Layout("engine", windows, cfg.num_key_value_heads, cfg.head_dim)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        Gemma3ForCausalLM(cfg).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (smol / name).exists():
                (folder / name).write_bytes((smol / name).read_bytes())
        num_blocks = 6 * 16 * window // block_size
        options: dict[str, Any] = dict(
            dtype="float32",
            quantization="none",
            block_size=block_size,
            max_num_batched_tokens=budget,
            num_blocks=num_blocks,
        )
        engine = LLMEngine(EngineConfig.from_options(str(folder), **options))
        kv = engine.kv
        prompt = [100 + i % 1000 for i in range(8 * window - DECODE_TOKENS)]
        engine.add_request("r", prompt, Params(max_tokens=DECODE_TOKENS, ignore_eos=True))
        (seq,) = engine.groups["r"].seqs
        held = total = peak = peak_step = 0
        execute = engine.runner.execute

        def measured(*a: Any, **kw: Any) -> Any:  # blocks held while the step runs
            nonlocal peak_step
            peak_step = max(peak_step, sliding_blocks(kv, seq))
            return execute(*a, **kw)

        engine.runner.execute = measured  # type: ignore[method-assign]
        while engine.has_unfinished_requests():
            engine.step()
            if kv.holds_blocks(seq):
                held, total = sliding_blocks(kv, seq), kv.num_held_blocks(seq)
                peak = max(peak, held) if seq.num_output_tokens else peak
        assert kv.num_free_blocks == kv.num_blocks
    element = torch.empty((), dtype=torch.float32).element_size()
    per_block = bytes_per_block(engine.kv_spec, layout, block_size) // BF16 * element
    per_layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim * element
    full_blocks = -(-8 * window // block_size)
    return {
        "tokens": 8 * window,
        "groups": len(engine.kv_spec.groups),
        "all_without": full_blocks * block_size * per_layer_token * len(windows),
        "all_with": total * per_block,
        "without": full_blocks * block_size * per_layer_token * 5,
        "with": held * per_block,
        "peak_decode": peak * per_block,
        "peak_step": peak_step * per_block,
        "one_window": window * per_layer_token * 5,
    }


def _row(name: str, window: int, r: dict[str, float]) -> str:
    mib = 1 << 20
    return (
        f"{name:<20} {window:>6} {int(r['tokens']):>6} {int(r['groups']):>6} "
        f"{r['all_without'] / mib:>9.1f} {r['all_with'] / mib:>8.1f} "
        f"{r['without'] / mib:>9.1f} {r['with'] / mib:>8.1f} {r['with'] / r['one_window']:>7.3f}x "
        f"{r['peak_decode'] / r['one_window']:>7.3f}x {r['peak_step'] / r['one_window']:>7.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="max tokens per step")
    parser.add_argument("--engine", action="store_true", help="also measure the real engine")
    args = parser.parse_args()
    print(
        "KV MiB one sequence of 8 windows holds (bf16; block size "
        f"{args.block_size}, {args.budget}-token steps, last {DECODE_TOKENS} tokens decoded)"
    )
    print(
        f"{'':<20} {'':>6} {'':>6} {'':>6} {'all layers':>18} {'sliding layers':>18} "
        f"{'sliding held / one window':>26}"
    )
    print(
        f"{'layout':<20} {'window':>6} {'tokens':>6} {'groups':>6} {'no window':>9} {'window':>8} "
        f"{'no window':>9} {'window':>8} {'end':>8} {'decode':>8} {'in step':>8}"
    )
    for layout in layouts():
        print(_row(layout.name, layout.window, simulate(layout, args.block_size, args.budget)))
    if args.engine:
        result = engine_run(args.block_size, min(args.budget, 256))
        print(_row("engine tiny Gemma 3", 128, result))
    print(
        "'end': held after the last step; 'decode': the most held after any decode step; 'in step':"
        " the most held while a step runs (a prefill chunk's blocks join the window's until the "
        "step ends). One window = the sliding layers' KV of `window` tokens. The engine row: a "
        "float32 6-layer random Gemma 3 (5 local : 1 global), from the running engine's tables."
    )


if __name__ == "__main__":
    main()
