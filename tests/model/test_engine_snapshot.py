"""Snapshots and fault hooks on a real tiny model: a thread reading snapshots while the engine steps sees
only consistent, monotonic states; the per-block detail matches the counts; the fault-injecting runner
is chosen at construction and fails only its marked request."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, EngineSnapshot, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.executor.model_runner import ModelRunner
from engine.faults import FAULT_INJECTION_ENV, NAN_AFTER_TOKENS, NAN_LOGITS, FaultInjectingRunner
from engine.llm_engine import LLMEngine

MAX_NUM_SEQS = 3


def _core(model_dir: Path, **options: object) -> LLMEngine:
    config = EngineConfig.from_options(
        str(model_dir),
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=32,  # prompts are chunked: steps mix prefill and decode
        block_size=4,
        num_blocks=40,  # tight enough that some sequences get preempted
        **options,
    )
    return LLMEngine(config)


def _check(snap: EngineSnapshot) -> None:
    """What must hold in every snapshot, whatever step it comes from."""
    assert 0 <= snap.num_requests_running <= snap.num_running <= MAX_NUM_SEQS
    assert snap.num_requests_waiting >= 0
    rows = snap.requests  # one per request in a detailed snapshot, none in the per-step one
    if snap.detail is None:
        assert rows == ()
    else:
        assert snap.num_requests_running + snap.num_requests_waiting == len(rows)
        assert sum(r.state == "running" for r in rows) == snap.num_requests_running
    assert 0 <= snap.num_free_blocks <= snap.num_total_blocks == 40
    assert snap.kv_cache_usage == pytest.approx(1 - snap.num_free_blocks / snap.num_total_blocks)
    assert snap.prefix_cache_hits <= snap.prefix_cache_queries
    for r in rows:
        assert 0 <= r.num_computed_tokens <= r.num_prompt_tokens + r.num_output_tokens
        if r.state != "running":
            assert r.num_computed_tokens == 0 or r.state == "waiting"


async def test_snapshot_reads_concurrent_with_steps_are_consistent(tiny_llama_dir: Path) -> None:
    engine = AsyncLLMEngine(_core(tiny_llama_dir))
    await engine.start()
    stop = threading.Event()
    errors: list[BaseException] = []
    steps_seen: list[int] = []
    generated_seen: list[int] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                snap = engine.snapshot()
                _check(snap)
                steps_seen.append(snap.num_steps)
                generated_seen.append(snap.num_generation_tokens)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
                return
            time.sleep(0)  # let the stepping thread have the GIL between reads

    async def run(i: int) -> int:
        params = SamplingParams(
            n=1 + i % 2, max_tokens=6 + i, temperature=0.8, seed=i, ignore_eos=True
        )
        last = None
        async for out in engine.generate(f"r{i}", list(range(5, 9 + 3 * i)), params):
            last = out
        assert last is not None and last.finished
        return sum(len(c.token_ids) for c in last.outputs)

    detailed_seen: list[int] = []

    async def watch(runs: asyncio.Future) -> None:
        """Detailed snapshots (built between two steps) while the requests run."""
        while not runs.done():
            snap = await engine.detailed_snapshot()
            _check(snap)
            detailed_seen.append(len(snap.requests))
            await asyncio.sleep(0)

    reader = threading.Thread(target=hammer)
    reader.start()
    try:
        runs = asyncio.gather(*(run(i) for i in range(8)))
        await asyncio.gather(runs, watch(runs))
        counts = runs.result()
    finally:
        stop.set()
        reader.join(timeout=30)
        await engine.shutdown()
    assert not errors, errors[0]
    assert len(steps_seen) > 10, "the reader barely ran"
    assert steps_seen == sorted(steps_seen), "the step counter went backwards"
    assert generated_seen == sorted(generated_seen)
    assert len(set(steps_seen)) > 1, "the reader never saw the engine move"
    assert any(detailed_seen), "no detailed snapshot saw a request"
    final = engine.snapshot()
    _check(final)
    assert final.num_generation_tokens == sum(counts)
    assert (final.num_running, final.num_waiting, final.requests) == (0, 0, ())
    assert final.num_free_blocks == final.num_total_blocks
    assert final.num_unfinished_requests == 0


async def test_detailed_snapshot_names_the_holders_of_every_used_block(
    tiny_llama_dir: Path,
) -> None:
    engine = AsyncLLMEngine(_core(tiny_llama_dir))
    await engine.start()
    try:
        params = SamplingParams(n=2, max_tokens=40, ignore_eos=True, output_kind="delta")
        gen = engine.generate("a", list(range(10, 30)), params)
        started: set[int] = set()
        while started != {0, 1}:  # the second sample starts once the first has prefilled
            started |= {c.index for c in (await anext(gen)).outputs if c.token_ids}
        snap = await engine.detailed_snapshot()
        published = engine.snapshot()  # the plain one: the detailed build stays its caller's
        await gen.aclose()
    finally:
        await engine.shutdown()
    assert [r.request_id for r in snap.requests] == ["a"]
    assert (published.requests, published.detail) == ((), None)
    # the same build, published plain, unless a step published a newer one in between (the engine
    # keeps generating)
    assert published.time >= snap.time
    if published.time == snap.time:
        assert published.num_requests_running == 1
    detail = snap.detail
    assert detail is not None
    assert len(detail.blocks) == snap.num_total_blocks - snap.num_free_blocks > 0
    for block in detail.blocks:
        assert block.ref_count == len(block.seq_ids) >= 1
        assert all(seq_id.startswith("a/") for seq_id in block.seq_ids)
    # Both samples share the prompt's full blocks through the prefix cache.
    assert any(len(block.seq_ids) == 2 for block in detail.blocks)


def test_fault_hooks_are_chosen_at_construction(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    assert type(_core(tiny_llama_dir).runner) is ModelRunner

    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    core = _core(tiny_llama_dir)
    assert type(core.runner) is FaultInjectingRunner
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    ids = list(range(20, 30))
    core.add_request("faulty", ids, params, prompt=NAN_LOGITS + " hello")
    core.add_request("fine", ids, params, prompt="hello")
    finals = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["fine"].error is None and len(finals["fine"].outputs[0].token_ids) == 8
    faulty = finals["faulty"]
    assert faulty.error is not None and "non-finite" in faulty.error
    assert not faulty.outputs or len(faulty.outputs[0].token_ids) <= NAN_AFTER_TOKENS


def test_an_aborted_request_is_in_the_next_steps_finished_stats(tiny_llama_dir):
    """An abort between steps reaches the metrics: its record (finish_reason "abort", its tokens so
    far) rides on the next step's stats.finished, once, and counts in the engine's totals."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8], params)
    engine.add_request("b", [9, 10, 11], params)
    for _ in range(3):
        engine.step()
    before = engine.totals.num_finished
    engine.abort_request("a")
    engine.step()
    finished = [(f.request_id, f.finish_reason) for f in engine.last_step.finished]
    assert finished == [("a", "abort")]
    assert engine.last_step.finished[0].num_generation_tokens >= 2
    assert engine.totals.num_finished == before + 1
    engine.step()
    assert engine.last_step.finished == []
