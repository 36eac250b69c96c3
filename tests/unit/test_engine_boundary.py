"""The engine's typed boundary over a scripted core (no model): admission of a burst costs O(N), the
pending queue holds typed records, snapshots are immutable and published by the step, and the engine
and the server fakes implement the EngineClient protocol."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
import time
from types import FrameType
from typing import Any

import pytest

import engine.async_engine as async_engine_module
from engine import EngineSnapshot, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.core.pending import AbortRequest, AddRequest, PendingWork
from tests.unit.server_fakes import FakeEmbeddingClient, FakeEngine
from tests.unit.test_reliability_engine import _drain, _engine


def _lines_run_in(path: str, work: Any) -> int:
    """Python lines executed in the file `path` while `work()` runs (an operation count, not a time)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if frame.f_code.co_filename != path:
            return None  # do not trace other files' lines
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def _burst_cost(num_requests: int) -> int:
    """Lines the async front runs to admit `num_requests` requests that arrive in one burst (all
    submitted before the engine loop gets to apply any), then serve them."""

    async def burst() -> None:
        engine = _engine({"max_running": num_requests}, max_queued_requests=10 * num_requests)
        await engine.start()
        try:
            results = await asyncio.gather(
                *(_drain(engine, f"r{i}", [1, 2]) for i in range(num_requests))
            )
        finally:
            await engine.shutdown()
        assert all(outs[-1].finished for outs in results)

    return _lines_run_in(async_engine_module.__file__, lambda: asyncio.run(burst()))


def test_admitting_a_burst_costs_linear_work() -> None:
    small, large = _burst_cost(100), _burst_cost(400)
    # Linear work grows 4x; the old admission check re-counted the pending adds for every new request
    # (quadratic), which grows about 12x here.
    assert large < 6 * small, (small, large)


def test_pending_work_is_typed_records_with_running_counts() -> None:
    pending = PendingWork()
    params = SamplingParams()
    pending.add(AddRequest("a", [1, 2, 3], params, "text", 1.0))
    pending.abort("a")
    pending.add(AddRequest("b", [4], None, None, 2.0))
    assert (pending.num_adds, pending.num_add_tokens, len(pending)) == (2, 4, 3)
    items = pending.take()
    assert items == [
        AddRequest("a", [1, 2, 3], params, "text", 1.0),
        AbortRequest("a"),
        AddRequest("b", [4], None, None, 2.0),
    ]
    assert not pending and (pending.num_adds, pending.num_add_tokens) == (0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        items[1].request_id = "other"  # type: ignore[misc]


async def test_snapshots_are_immutable_and_published_by_each_step() -> None:
    engine = _engine({"steps": 3, "max_running": 2})
    await engine.start()
    try:
        before = engine.snapshot()
        results = await asyncio.gather(*(_drain(engine, f"r{i}", [1, 2, 3]) for i in range(3)))
        assert all(outs[-1].finished for outs in results)
        after = engine.snapshot()
    finally:
        await engine.shutdown()
    assert before.num_steps == 0 and after.num_steps >= 3  # 3 requests, 2 at a time, 3 steps each
    assert (after.num_running, after.num_requests_waiting, after.num_unfinished_requests) == (
        0,
        0,
        0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.num_running = 5  # type: ignore[misc]


async def test_an_abort_between_steps_is_in_the_next_snapshot() -> None:
    """The core republishes after applying adds and aborts, so an idle engine's snapshot is exact."""
    engine = _engine({"steps": 1000, "max_running": 1})
    await engine.start()
    try:
        gen = engine.generate("long", [1, 2], SamplingParams(max_tokens=1000))
        await anext(gen)
        assert engine.snapshot().num_requests_running == 1
        await gen.aclose()  # aborts
        for _ in range(100):
            await asyncio.sleep(0.01)
            if engine.snapshot().num_requests_running == 0:
                break
        snap = engine.snapshot()
        assert (snap.num_requests_running, snap.num_unfinished_requests) == (0, 0)
        assert engine.core.aborted == ["long"]  # type: ignore[attr-defined]
    finally:
        await engine.shutdown()


async def test_detailed_snapshot_is_built_by_the_loop_on_request() -> None:
    engine = _engine()
    await engine.start()
    try:
        snap = await asyncio.wait_for(engine.detailed_snapshot(), timeout=10)
    finally:
        await engine.shutdown()
    assert isinstance(snap, EngineSnapshot) and snap.task == "generate"


@pytest.mark.parametrize("forward_s", [0.0, 0.001])
async def test_steps_run_back_to_back_off_the_loop_yet_adds_aborts_and_details_get_in(
    forward_s: float,
) -> None:
    """The core steps on one thread of its own; a request added, a detailed snapshot asked for and
    an abort made while another request decodes all take effect between two steps, whether the
    step lets the loop run meanwhile (a model forward) or holds the GIL throughout."""
    engine = _engine({"steps": 400, "max_running": 4})
    core = engine.core
    threads: set[str] = set()
    step = core.step

    def recording_step() -> Any:
        threads.add(threading.current_thread().name)
        if forward_s:
            time.sleep(forward_s)  # native work that lets the event loop run meanwhile
        return step()

    core.step = recording_step  # type: ignore[method-assign]
    await engine.start()
    try:
        long = engine.generate("long", [1], SamplingParams(max_tokens=400))
        await anext(long)
        snap = await asyncio.wait_for(engine.detailed_snapshot(), timeout=10)
        assert snap.num_requests_running == 1 and snap.num_steps < 400  # while "long" runs
        engine.core.steps = 3  # type: ignore[attr-defined]
        short = await asyncio.wait_for(_drain(engine, "short", [2]), timeout=10)
        assert short[-1].finished and len(short) == 3
        seen = 1
        async for _ in long:
            seen += 1
            if seen == 20:
                break
        await long.aclose()  # aborts "long" mid-run
        for _ in range(200):
            if core.aborted:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        assert core.aborted == ["long"]  # type: ignore[attr-defined]
        # Idle once aborted: the loop parks (no step runs while it waits for work).
        await asyncio.wait_for(engine.idle.wait(), timeout=10)
        assert not core.has_unfinished_requests()
        assert core.num_steps < 400  # type: ignore[attr-defined]  # "long" stopped mid-run
    finally:
        await engine.shutdown()
    assert threads and threading.current_thread().name not in threads
    assert len(threads) == 1, threads  # one dedicated step thread


def test_the_engine_and_the_fakes_expose_the_same_client_surface() -> None:
    """The server holds the engine as EngineClient; the fakes it is tested with must have every member
    (mypy checks AsyncLLMEngine against the protocol; this keeps the test fakes honest too)."""
    from engine import EngineClient

    members = {
        name
        for name in vars(EngineClient)
        if not name.startswith("_") and name not in ("register", "mro")
    }
    assert {"generate", "embed", "validate", "snapshot", "health", "tokenizer"} <= members
    for fake in (FakeEngine(), FakeEmbeddingClient()):
        missing = [name for name in members if not hasattr(fake, name)]
        assert not missing, (type(fake).__name__, missing)
    assert all(hasattr(AsyncLLMEngine, name) for name in members)


def test_the_core_and_its_contracts_import_without_torch() -> None:
    """engine.core (protocols, snapshots, pending work, errors included) and the package's eager
    exports import with torch blocked, so the server's types and the core's tests need no torch."""
    import pkgutil
    import subprocess

    import engine.core

    modules = [f"engine.core.{m.name}" for m in pkgutil.iter_modules(engine.core.__path__)]
    assert {"engine.core.engine_client", "engine.core.snapshot", "engine.core.pending"} <= set(
        modules
    )
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import importlib, engine\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


async def test_the_stats_endpoint_serves_the_typed_snapshot() -> None:
    import httpx

    from server.app import build_app
    from server.state import ServerConfig

    fake = FakeEngine()
    fake.published = EngineSnapshot(
        task="generate", num_steps=12, time=1.0, num_running=2, num_requests_running=1
    )
    app = build_app(ServerConfig(), fake)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        body = (await c.get("/v1/internal/stats")).json()
        detailed = (await c.get("/v1/internal/stats", params={"detail": "true"})).json()
    fields = {f.name for f in dataclasses.fields(EngineSnapshot)}
    assert set(body) == fields | {"in_flight_http_requests"}
    assert (body["num_steps"], body["num_running"], body["num_requests_running"]) == (12, 2, 1)
    assert body["requests"] == [] and body["detail"] is None
    assert set(detailed) == set(body)
