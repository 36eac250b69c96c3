"""The step-time token budget in the engine (CPU): it learns from the engine's own steps, and since
the block-quantized kernels and the CPU attention are batch-invariant, the smaller chunks it gives
long prompts beside decoding streams change no token and no logprob."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")


def _run(llm: LLM, short: list[list[int]], long: list[list[int]]) -> dict[str, tuple]:
    """The short prompts start decoding, then the long ones arrive and prefill beside them."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", p, params)
    results = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                results[out.request_id] = (list(o.token_ids), [e.logprob for e in o.logprobs or []])

    step()
    step()  # the short ones decode now
    for i, p in enumerate(long):
        engine.add_request(f"l{i}", p, params)
    while engine.has_unfinished_requests():
        step()
    return results


def test_step_time_budget_changes_no_token(tiny_llama_dir):
    rng = random.Random(4)
    short = [[rng.randrange(100, 5000) for _ in range(n)] for n in (5, 9, 7)]
    long = [[rng.randrange(100, 5000) for _ in range(n)] for n in (300, 420)]
    options = {"quantization": "int8", "max_num_seqs": 8, "enable_prefix_caching": False}
    fixed = LLM(str(tiny_llama_dir), target_step_ms=0, **options)
    budgeted = LLM(str(tiny_llama_dir), target_step_ms=1, **options)  # the smallest chunks
    assert fixed.engine.scheduler.step_budget is None
    budget = budgeted.engine.scheduler.step_budget
    assert budget is not None and budget.target_s == 0.001
    got, want = _run(budgeted, short, long), _run(fixed, short, long)
    assert got == want and len(got) == 5
    assert budget.num_prefill_steps > 0  # it measured the engine's steps
    # beside decodes the long prompts went in chunks of at most the warm-up size, not whole
    assert budgeted.engine.totals.num_steps > fixed.engine.totals.num_steps
