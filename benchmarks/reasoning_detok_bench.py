"""Per-token cost of splitting reasoning from the answer while detokenizing: the incremental
detokenizer on a thinking-model-shaped output (a long `<think>` block, then the answer), with and
without a reasoning format, interleaved in one run (bundled SmolLM2 tokenizer, no model).

    python -m benchmarks.reasoning_detok_bench --repeats 15
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench_utils import cpu_summary
from engine.core.sampling_params import ReasoningFormat
from engine.models.loader import resolve_model
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer


def _run(tok: Tokenizer, ids: list[int], fmt: ReasoningFormat | None) -> float:
    """Seconds to stream `ids` through a fresh detokenizer (with one stop string), as the
    output processor does in delta mode."""
    detok = IncrementalDetokenizer(tok, ids[:3], True, ["STOP"], False, fmt)
    started = time.perf_counter()
    for token_id in ids[3:]:
        detok.add_tokens([token_id])
        detok.take_delta(False)
        detok.take_reasoning_delta(False)
    detok.take_delta(True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--thinking-sentences", type=int, default=150)
    args = parser.parse_args()
    tok = Tokenizer.from_pretrained(resolve_model(None))
    text = (
        "<think>"
        + "Let me think about this step by step. " * args.thinking_sentences
        + "</think>"
        + "The answer is here. " * 50
    )
    ids = tok.encode(text, add_special_tokens=False)
    plain, split = [], []
    for _ in range(args.repeats):  # interleaved: the machine's noise hits both alike
        plain.append(_run(tok, ids, None))
        split.append(_run(tok, ids, ReasoningFormat()))
    n = len(ids) - 3
    print(cpu_summary())
    print(
        f"{n} tokens; best of {args.repeats}: plain {min(plain) / n * 1e6:.2f} us/token, with "
        f"reasoning {min(split) / n * 1e6:.2f} us/token, ratio {min(split) / min(plain):.2f}x"
    )


if __name__ == "__main__":
    main()
