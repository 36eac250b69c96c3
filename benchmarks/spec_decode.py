"""Speculative decoding against plain decoding in ONE engine and one run: the same model copy serves
every variant (the scheduler's speculator is swapped between interleaved rounds, the order rotating
each round): plain, ngram, suffix, layer_skip (the target's first layers) and draft_model (by default
a checkpoint of the target's first layers, written to a temporary folder: the draft-model path with
its own weights, KV and prefill; --draft-model names another), on input-grounded prompts (rewrite,
quote, code edit: the answer copies the prompt) and random-word prompts (little to copy). Prints,
per workload and concurrency, the median inter-token latency (concurrency 1) or the median
throughput of the rounds (higher concurrency), the median over rounds of its ratio to plain decoding
in the same round (ITL: below 1 is faster; throughput: above 1 is faster) with the rounds' range,
the acceptance rate and mean accepted length, and the CPU line.

    python -m benchmarks.spec_decode [--rounds 3] [--max-tokens 128] [--concurrency 1 32]
        [--variants plain ngram suffix layer_skip draft_model] [--draft-layers 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_utils import cpu_summary
from engine import LLM, SamplingParams
from engine.core.spec_config import DRAFT_METHODS, SpeculativeConfig
from engine.core.speculator import Speculator
from engine.executor.draft_model import build_drafter

PARAGRAPH = (
    "The city council met on Tuesday evening to discuss the new bicycle lanes on Main Street. "
    "Residents raised concerns about parking, delivery trucks and the safety of children walking "
    "to school. The council agreed to run a six-month trial, collect traffic data every week, and "
    "publish a report before deciding whether the lanes become permanent."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
"""
GROUNDED = [
    f"Rewrite the following paragraph, replacing 'council' with 'committee' and changing "
    f"nothing else:\n\n{PARAGRAPH}",
    f"Quote the second and third sentences of this text exactly, word for word:\n\n{PARAGRAPH}",
    f"Rename the variable `subtotal` to `net` in this function and show the whole function:\n\n"
    f"```python\n{CODE}```",
    f"Repeat this text exactly:\n\n{PARAGRAPH}",
]
WORDS = (
    "river lantern copper meadow violin glacier orbit pepper canyon marble tunnel harvest "
    "falcon velvet thunder quartz saddle ember willow compass prism anchor bramble cinder"
).split()


def random_word_prompts(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        "Write a short story that uses these words: " + ", ".join(rng.sample(WORDS, 6)) + "."
        for _ in range(num)
    ]


@dataclass
class Tally:
    itl: list[float] = field(default_factory=list)  # per request: decode seconds / token gaps
    throughput: list[float] = field(default_factory=list)  # per round: output tokens / second
    round_itl: list[float] = field(default_factory=list)  # per round: the median of its requests
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


def run_round(llm: LLM, prompts: list[list[int]], params: SamplingParams, tally: Tally) -> None:
    totals = llm.engine.totals
    before = (totals.spec_num_drafts, totals.spec_num_draft_tokens, totals.spec_num_accepted_tokens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = 0
    for out in outs:
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        tokens += len(out.outputs[0].token_ids)
        if m.num_token_gaps:
            tally.itl.append((m.last_token_time - m.first_token_time) / m.num_token_gaps)
    tally.throughput.append(tokens / seconds)
    tally.drafts += totals.spec_num_drafts - before[0]
    tally.draft_tokens += totals.spec_num_draft_tokens - before[1]
    tally.accepted += totals.spec_num_accepted_tokens - before[2]


def first_layers_checkpoint(folder: Path, num_layers: int, out: Path) -> Path:
    """A copy of the HF folder `folder` keeping its first `num_layers` layers (same tokenizer)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    tensors: dict[str, Any] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    for f in folder.iterdir():
        if (
            f.is_file()
            and f.suffix in (".json", ".jinja", ".txt", ".model")
            and f.name != "config.json"
        ):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def speculator_for(llm: LLM, config: dict[str, Any]) -> Speculator:
    """A speculator for `config` over the engine's own model (a draft gets its own KV pool)."""
    e = llm.engine
    spec = SpeculativeConfig.parse(config)
    assert spec is not None
    drafter = None
    if spec.method in DRAFT_METHODS:
        drafter = build_drafter(
            spec, e.model, e.device, e.dtype, e.tokenizer, e.config.model, e.kv.num_blocks,
            e.kv.block_size, e.max_model_len, e.config.scheduler.max_num_batched_tokens,
            e.kv, lambda: e.runner.kv_caches,
        )  # fmt: skip
    return Speculator(spec, e.max_model_len, drafter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=5)
    parser.add_argument(
        "--variants", nargs="+", default=["plain", "ngram", "suffix", "layer_skip", "draft_model"]
    )
    parser.add_argument("--draft-layers", type=int, default=8, help="layer_skip's draft layers")
    parser.add_argument("--draft-model", default=None, help="default: the target's first layers")
    parser.add_argument("--workloads", nargs="+", default=["grounded", "random-words"])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: a shared machine's OpenMP spin)"
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_seqs=64, num_threads=args.threads)
    tok = llm.tokenizer
    k = args.num_speculative_tokens
    tmp = tempfile.TemporaryDirectory()
    draft_model = args.draft_model
    if draft_model is None and "draft_model" in args.variants:
        draft_model = str(
            first_layers_checkpoint(llm.engine.model_dir, args.draft_layers, Path(tmp.name))
        )
    configs: dict[str, dict[str, Any]] = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": k},
        "layer_skip": {"method": "layer_skip", "num_draft_layers": args.draft_layers,
                       "num_speculative_tokens": k},
        "draft_model": {"method": "draft_model", "model": draft_model, "num_speculative_tokens": k},
    }  # fmt: skip
    speculators: dict[str, Speculator | None] = {"plain": None}
    for name in args.variants:
        if name != "plain":
            speculators[name] = speculator_for(llm, configs[name])

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )

    all_workloads = {
        "grounded": [chat(p) for p in GROUNDED],
        "random-words": [chat(p) for p in random_word_prompts(4, 0)],
    }
    workloads = {name: all_workloads[name] for name in args.workloads}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for spec in speculators.values():  # warm-up, each variant
        llm.engine.scheduler.speculator = spec
        llm.generate(all_workloads["grounded"][:1], SamplingParams(max_tokens=8))
    print(cpu_summary())
    print(f"threads: {args.threads}, max_tokens: {args.max_tokens}, rounds: {args.rounds}")
    for name in speculators:
        print(f"  {name}: {configs.get(name, 'no speculation')}")
    names = list(speculators)
    results = []
    for concurrency in args.concurrency:
        for workload, prompts in workloads.items():
            tallies = {name: Tally() for name in names}
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]  # rotating who is first
                for name in order:
                    llm.engine.scheduler.speculator = speculators[name]
                    if concurrency == 1:
                        first = len(tallies[name].itl)
                        for prompt in prompts:
                            run_round(llm, [prompt], params, tallies[name])
                        itls = tallies[name].itl[first:]
                        tallies[name].round_itl.append(statistics.median(itls))
                    else:
                        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
                        run_round(llm, batch, params, tallies[name])
            plain = tallies["plain"] if "plain" in tallies else None
            print(f"{workload} c={concurrency} ({args.rounds} interleaved rounds)")
            for name in names:
                t = tallies[name]
                row = {
                    "workload": workload, "concurrency": concurrency, "variant": name,
                    "itl_ms": 1e3 * statistics.median(t.itl),
                    "tok_s": statistics.median(t.throughput),
                    "acceptance_rate": t.accepted / t.draft_tokens if t.draft_tokens else 0.0,
                    "mean_accepted_length": 1 + t.accepted / t.drafts if t.drafts else 1.0,
                    "drafts": t.drafts,
                }  # fmt: skip
                spread = ""
                if plain is not None:
                    # Paired per round (the variants of a round ran back to back): the median of
                    # the rounds' ratios, and their range, are what the machine's load moves least.
                    if concurrency == 1:
                        ratios = [a / b for a, b in zip(t.round_itl, plain.round_itl, strict=True)]
                        row["itl_ratio"] = statistics.median(ratios)
                    else:
                        ratios = [
                            a / b for a, b in zip(t.throughput, plain.throughput, strict=True)
                        ]
                        row["throughput_ratio"] = statistics.median(ratios)
                    row["round_ratios"] = ratios
                    spread = f" [{min(ratios):.2f}-{max(ratios):.2f}]"
                results.append(row)
                measure = (
                    f"ITL {row['itl_ms']:7.2f} ms, x{row.get('itl_ratio', 1):.2f} of plain{spread}"
                    if concurrency == 1
                    else f"{row['tok_s']:7.1f} tok/s, x{row.get('throughput_ratio', 1):.2f} of "
                    f"plain{spread}"
                )
                print(
                    f"  {name:11s} {measure}  acceptance {100 * row['acceptance_rate']:3.0f}%  "
                    f"mean accepted length {row['mean_accepted_length']:.2f} ({t.drafts} drafts)"
                )
    for name, spec in speculators.items():  # what each variant's cost model measured
        if spec is not None and spec.measured is not None:
            m = spec.measured
            forward = f", a draft forward {m.forward_cost:.2f} of a plain step" if m.drafts else ""
            print(f"  {name}: a verified draft row costs {m.row_cost:.2f} decode rows{forward}")
    tmp.cleanup()
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
