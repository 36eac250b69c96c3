"""The engine-stream fan-in: outputs in arrival order, a disconnect or an error ends every stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from server.generation import ClientDisconnected, merge_outputs


class _Request:
    """Just what merge_outputs reads of a starlette Request: receive() and scope."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {"state": {"request_id": "t"}}
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _output(i: int) -> Any:
    from engine import RequestOutput

    return RequestOutput(f"r{i}", None, [1], [], False)


async def _stream(name: str, count: int, closed: list[str], delay: float = 0.0) -> AsyncIterator:
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            yield _output(i)
    finally:
        closed.append(name)


def test_outputs_of_all_streams_arrive_then_the_merge_ends() -> None:
    async def run() -> list[tuple[int, str]]:
        closed: list[str] = []
        streams = [_stream("a", 3, closed), _stream("b", 2, closed)]
        got = [(i, out.request_id) async for i, out in merge_outputs(streams, _Request())]
        assert sorted(closed) == ["a", "b"]
        return got

    got = asyncio.run(run())
    assert sorted(got) == [(0, "r0"), (0, "r1"), (0, "r2"), (1, "r0"), (1, "r1")]
    assert [r for i, r in got if i == 0] == ["r0", "r1", "r2"]  # each stream in order


def test_a_disconnect_mid_stream_raises_and_closes_every_engine_stream() -> None:
    async def run() -> tuple[int, list[str]]:
        closed: list[str] = []
        request = _Request()
        streams = [_stream("a", 1000, closed, 0.001), _stream("b", 1000, closed, 0.001)]
        seen = 0
        with pytest.raises(ClientDisconnected):
            async for _ in merge_outputs(streams, request):
                seen += 1
                if seen == 5:
                    request.gone.set()
        await asyncio.sleep(0)
        return seen, closed

    seen, closed = asyncio.run(run())
    assert 5 <= seen < 100
    assert sorted(closed) == ["a", "b"]  # the engine aborts a request when its stream closes


def test_an_error_in_one_stream_is_raised_and_ends_the_others() -> None:
    async def failing(closed: list[str]) -> AsyncIterator:
        yield _output(0)
        raise ValueError("boom")

    async def run() -> list[str]:
        closed: list[str] = []
        with pytest.raises(ValueError, match="boom"):
            async for _ in merge_outputs(
                [failing(closed), _stream("b", 10**6, closed, 0.001)], None
            ):
                pass
        return closed

    assert asyncio.run(run()) == ["b"]
