"""Speculative decoding (ngram) against plain decoding in ONE engine and one run: the same model copy
serves both (the scheduler's speculator is switched on and off between interleaved rounds), on
input-grounded prompts (rewrite, quote, code edit: the answer copies the prompt) and random-word
prompts (little to copy). Prints inter-token latency per workload at concurrency 1 (and throughput at
higher concurrency), their ratios, the acceptance rate and mean accepted length, and the CPU line.

    python -m benchmarks.spec_decode [--rounds 3] [--max-tokens 128] [--concurrency 1 32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from benchmarks.bench_utils import cpu_summary
from engine import LLM, SamplingParams
from engine.core.speculator import Speculator

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
    tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


def run_round(llm: LLM, prompts: list[list[int]], params: SamplingParams, tally: Tally) -> None:
    totals = llm.engine.totals
    before = (totals.spec_num_drafts, totals.spec_num_draft_tokens, totals.spec_num_accepted_tokens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    tally.seconds += time.perf_counter() - start
    for out in outs:
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        tally.tokens += len(out.outputs[0].token_ids)
        if m.num_token_gaps:
            tally.itl.append((m.last_token_time - m.first_token_time) / m.num_token_gaps)
    tally.drafts += totals.spec_num_drafts - before[0]
    tally.draft_tokens += totals.spec_num_draft_tokens - before[1]
    tally.accepted += totals.spec_num_accepted_tokens - before[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}',
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()

    llm = LLM(args.model, speculative_config=args.speculative_config, max_num_seqs=64)
    speculator: Speculator | None = llm.engine.scheduler.speculator
    assert speculator is not None
    tok = llm.tokenizer

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )

    workloads = {
        "grounded": [chat(p) for p in GROUNDED],
        "random-words": [chat(p) for p in random_word_prompts(4, 0)],
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(workloads["grounded"][:1], SamplingParams(max_tokens=8))  # warm-up
    print(cpu_summary())
    print(f"speculative config: {args.speculative_config}")
    results = []
    for concurrency in args.concurrency:
        for name, prompts in workloads.items():
            tallies = {"plain": Tally(), "ngram": Tally()}
            for r in range(args.rounds):
                order = ("plain", "ngram") if r % 2 == 0 else ("ngram", "plain")
                for mode in order:  # interleaved, alternating who goes first
                    llm.engine.scheduler.speculator = speculator if mode == "ngram" else None
                    if concurrency == 1:
                        for prompt in prompts:
                            run_round(llm, [prompt], params, tallies[mode])
                    else:
                        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
                        run_round(llm, batch, params, tallies[mode])
            plain, ngram = tallies["plain"], tallies["ngram"]
            row = {
                "workload": name,
                "concurrency": concurrency,
                "plain_itl_ms": 1e3 * statistics.median(plain.itl),
                "ngram_itl_ms": 1e3 * statistics.median(ngram.itl),
                "plain_tok_s": plain.tokens / plain.seconds,
                "ngram_tok_s": ngram.tokens / ngram.seconds,
                "acceptance_rate": ngram.accepted / ngram.draft_tokens
                if ngram.draft_tokens
                else 0.0,
                "mean_accepted_length": 1 + ngram.accepted / ngram.drafts if ngram.drafts else 1.0,
                "drafts": ngram.drafts,
            }
            results.append(row)
            print(
                f"{name:13s} c={concurrency:<3d} ITL plain {row['plain_itl_ms']:6.2f} ms  "
                f"ngram {row['ngram_itl_ms']:6.2f} ms  (x{row['ngram_itl_ms'] / row['plain_itl_ms']:.2f})  "
                f"throughput x{row['ngram_tok_s'] / row['plain_tok_s']:.2f}  "
                f"acceptance {100 * row['acceptance_rate']:.0f}%  "
                f"mean accepted length {row['mean_accepted_length']:.2f} ({row['drafts']} drafts)"
            )
    llm.engine.scheduler.speculator = speculator
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
