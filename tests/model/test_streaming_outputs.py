"""Delta (streaming) outputs against final outputs on a tiny random model: the deltas join to the
final text, each choice reports its finish_reason exactly once, and neighbouring seeds differ."""

from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32")


def run_delta(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request("stream", prompt, dataclasses.replace(params, output_kind="delta"))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "stream"]
    return outs


def test_stream_deltas_join_to_the_final_text(llm):
    # Random weights pick arbitrary byte-level tokens, so outputs often end inside a character.
    prompt = llm.tokenizer.encode("日本の首都は 🚀")
    for seed in range(12):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=7, n=2)
        final = llm.generate([prompt], params)[0]
        chunks = run_delta(llm.engine, prompt, params)
        for choice in final.outputs:
            pieces = [c for o in chunks for c in o.outputs if c.index == choice.index]
            assert "".join(p.text for p in pieces) == choice.text
            assert [t for p in pieces for t in p.token_ids] == choice.token_ids
            assert [p.finish_reason for p in pieces if p.finish_reason] == [choice.finish_reason]
            assert all(p.text or p.finish_reason for p in pieces)  # no empty chunks mid-stream


def test_finished_choice_is_not_repeated_while_others_run(llm):
    prompt = llm.tokenizer.encode("Tell me a story")
    params = SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=12, stop_token_ids=list(range(0, 49152, 7))
    )
    chunks = run_delta(llm.engine, prompt, params)
    for index in range(3):
        reasons = [
            c.finish_reason
            for o in chunks
            for c in o.outputs
            if c.index == index and c.finish_reason
        ]
        assert len(reasons) == 1


def test_neighbouring_seeds_give_unrelated_samples(llm):
    prompt = llm.tokenizer.encode("Once upon a time")
    outs = [
        {
            tuple(c.token_ids)
            for c in llm.generate([prompt], SamplingParams(n=3, seed=s, max_tokens=6))[0].outputs
        }
        for s in (0, 1)
    ]
    assert not outs[0] & outs[1]
