"""The async engine front under overload and faults, over a scripted core (no model, no torch work):
bounded admission, per-request failures, and a dead loop failing every waiter instead of hanging."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine import (
    CompletionOutput,
    EngineConfig,
    EngineDeadError,
    EngineSnapshot,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from engine.async_engine import AsyncLLMEngine
from engine.core.config import QUEUED_TOKENS_PER_BATCH, SchedulerConfig
from engine.faults import ENGINE_DEATH, FAULT_INJECTION_ENV, NAN_LOGITS, wants_fault


@dataclass
class _Group:
    prompt_token_ids: list[int]
    steps_left: int


@dataclass
class FakeCore:
    """Runs `max_running` requests at a time; each finishes after `steps` steps with one token per step."""

    config: EngineConfig
    steps: int = 3
    max_running: int = 1
    fail_add: set[str] = field(default_factory=set)  # request ids whose add raises RuntimeError
    die_on_step: bool = False
    gate: asyncio.Event | None = None  # when set, step() waits for it (in its worker thread)

    def __post_init__(self) -> None:
        self.tokenizer = None
        self.model_name = "fake"
        self.max_model_len = 1024
        self.task = "generate"
        self.last_step = None
        self.groups: dict[str, _Group] = {}
        self.order: list[str] = []
        self.aborted: list[str] = []
        self.vocab_size = 1000
        self.num_steps = 0
        self.publish()

    def validate(self, prompt_token_ids: list[int], params: Any) -> None:
        if not prompt_token_ids:
            raise ValueError("empty prompt")

    def add_request(
        self,
        request_id: str,
        ids: list[int],
        params: Any,
        prompt: Any,
        arrival_time: Any = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self.fail_add:
            raise RuntimeError("boom while adding")
        self.groups[request_id] = _Group(list(ids), self.steps)
        self.order.append(request_id)

    def abort_request(self, request_id: str) -> None:
        if self.groups.pop(request_id, None) is not None:
            self.order.remove(request_id)
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def _waiting(self) -> list[str]:
        return self.order[self.max_running :]

    def publish(self, detail: bool = False) -> EngineSnapshot:
        self.snapshot = self.build_snapshot(detail)
        return self.snapshot

    def build_snapshot(self, detail: bool = False) -> EngineSnapshot:
        running = min(len(self.order), self.max_running)
        return EngineSnapshot(
            task=self.task,
            num_steps=self.num_steps,
            time=0.0,
            num_running=running,
            num_waiting=len(self._waiting),
            num_requests_running=running,
            num_requests_waiting=len(self._waiting),
            num_waiting_tokens=sum(len(self.groups[r].prompt_token_ids) for r in self._waiting),
        )

    def step(self) -> list[RequestOutput]:
        if self.die_on_step:
            raise RuntimeError("the step crashed")
        outputs = []
        for request_id in list(self.order[: self.max_running]):
            group = self.groups[request_id]
            group.steps_left -= 1
            done = group.steps_left == 0
            out = CompletionOutput(0, "x", [7], finish_reason="length" if done else None)
            outputs.append(
                RequestOutput(request_id, None, group.prompt_token_ids, [out], finished=done)
            )
            if done:
                del self.groups[request_id]
                self.order.remove(request_id)
        self.num_steps += 1
        self.publish()
        return outputs


def _engine(core_kw: dict[str, Any] | None = None, **scheduler: Any) -> AsyncLLMEngine:
    config = EngineConfig(scheduler=SchedulerConfig(**scheduler))
    return AsyncLLMEngine(FakeCore(config, **(core_kw or {})))  # type: ignore[arg-type]


async def _drain(engine: AsyncLLMEngine, request_id: str, ids: list[int]) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, ids, SamplingParams(max_tokens=3))]


def test_max_queued_tokens_is_bounded_by_default() -> None:
    sc = SchedulerConfig(max_num_batched_tokens=100)
    assert sc.max_queued_tokens == QUEUED_TOKENS_PER_BATCH * 100
    assert SchedulerConfig(max_queued_tokens=5).max_queued_tokens == 5
    with pytest.raises(ValueError, match="max_queued_tokens"):
        SchedulerConfig(max_queued_tokens=0)


async def test_burst_beyond_the_queue_is_refused_and_every_admitted_request_finishes() -> None:
    engine = _engine(max_queued_requests=3, max_num_seqs=1)
    await engine.start()
    try:
        results = await asyncio.gather(
            *(_drain(engine, f"r{i}", [1, 2]) for i in range(20)), return_exceptions=True
        )
    finally:
        await engine.shutdown()
    # All 20 arrive before the loop's first step: the first fills the one running slot, the next
    # max_queued_requests (3) wait, and every later one is refused at once, in arrival order.
    admitted = [isinstance(r, list) for r in results]
    assert admitted == [True] * 4 + [False] * 16
    refused = results[4:]
    assert all(isinstance(r, QueueFullError) and r.retry_after >= 1 for r in refused), refused
    assert all(outs[-1].finished and len(outs) == 3 for outs in results[:4])


async def test_queued_prompt_tokens_are_capped_but_an_empty_queue_takes_any_prompt() -> None:
    engine = _engine(max_queued_tokens=10, max_queued_requests=100)
    await engine.start()
    try:
        # Alone, a prompt longer than the cap is admitted (else it could never run).
        assert (await _drain(engine, "long", list(range(50))))[-1].finished
        first = asyncio.ensure_future(_drain(engine, "a", list(range(8))))
        while "a" not in engine._queues:  # "a" is queued, waiting for the next step
            await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="prompt tokens"):
            await _drain(engine, "b", list(range(8)))
        assert (await first)[-1].finished
    finally:
        await engine.shutdown()


async def test_a_request_that_fails_to_start_fails_alone() -> None:
    engine = _engine({"fail_add": {"bad"}})
    await engine.start()
    try:
        good, bad = await asyncio.gather(
            _drain(engine, "good", [1]), _drain(engine, "bad", [1]), return_exceptions=True
        )
        assert isinstance(bad, RequestError) and "could not be started" in str(bad)
        assert isinstance(good, list) and good[-1].finished
        assert engine.health().state != "dead"
        assert (await _drain(engine, "after", [1]))[-1].finished
    finally:
        await engine.shutdown()


async def test_a_dead_loop_fails_every_waiter_and_refuses_new_requests() -> None:
    engine = _engine({"die_on_step": True})
    await engine.start()
    try:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(_drain(engine, f"r{i}", [1]) for i in range(3)), return_exceptions=True
            ),
            timeout=10,
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.health().state == "dead" and not engine.health().ready
        with pytest.raises(EngineDeadError):
            await _drain(engine, "late", [1])
    finally:
        await engine.shutdown()


async def test_fault_injection_is_inert_unless_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    engine = _engine()
    await engine.start()
    try:
        outs = [
            o
            async for o in engine.generate(
                "x", [1], SamplingParams(max_tokens=3), prompt=ENGINE_DEATH + " hi"
            )
        ]
        assert outs[-1].finished and engine.health().state != "dead"
    finally:
        await engine.shutdown()

    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    engine = _engine()
    await engine.start()
    try:
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(
                "y", [1], SamplingParams(max_tokens=3), prompt=ENGINE_DEATH
            ):
                pass
        assert engine.health().state == "dead"
    finally:
        await engine.shutdown()
    assert wants_fault(NAN_LOGITS + " text", NAN_LOGITS)
    assert not wants_fault(None, NAN_LOGITS) and not wants_fault("text " + NAN_LOGITS, NAN_LOGITS)
