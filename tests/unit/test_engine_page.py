"""The /engine page routes on a fake engine: the payload's block states and holders, the rate limit,
the key by header, query or cookie (page routes only), the off switch, and the large-pool payload."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from engine import BlockHolders, EngineSnapshot, RequestProgress, SnapshotDetail, StepRecord
from server.app import build_app
from server.engine_page import MAX_UPDATES_PER_SECOND, _events, page_payload
from server.state import ServerConfig
from tests.unit.server_fakes import FakeEngine


def _snapshot(num_blocks: int = 8, steps: int = 3) -> EngineSnapshot:
    detail = SnapshotDetail(
        blocks=(
            BlockHolders(0, 2, ("a/0", "b/0")),
            BlockHolders(1, 1, ("a/0",)),
            BlockHolders(5, 1, ("b/0",)),
        ),
        num_cached_free_blocks=2,
        cached_free_block_ids=(2, 3),
        steps=tuple(StepRecord(i, float(i), 0.01, 30, 2, i % 2, 2, 0) for i in range(1, steps + 1)),
        block_size=16,
        token_budget=64,
        max_num_seqs=4,
    )
    rows = (
        RequestProgress("a", "running", 1, 20, 20, 16, 3, 0.0),
        RequestProgress("b", "running", 1, 40, 32, 16, 0, 0.0),
    )
    return EngineSnapshot(
        task="generate", num_steps=steps, time=time.monotonic(), num_running=2,
        num_requests_running=2, num_free_blocks=num_blocks - 3, num_total_blocks=num_blocks,
        requests=rows, detail=detail,
    )  # fmt: skip


def test_payload_marks_each_block_and_names_holders() -> None:
    payload = page_payload(_snapshot(), {"max_queued_requests": 8, "max_queued_tokens": None})
    assert payload["kv"]["states"] == "shcc.h.."
    assert payload["kv"]["tables"] == {"a/0": [0, 1], "b/0": [0, 5]}
    assert [s[0] for s in payload["steps"]] == [1, 2, 3]
    later = page_payload(_snapshot(), {}, after_step=2)  # the stream sends each step once
    assert [s[0] for s in later["steps"]] == [3]
    assert payload["config"] == {
        "block_size": 16, "token_budget": 64, "max_num_seqs": 4,
        "max_queued_requests": 8, "max_queued_tokens": None,
    }  # fmt: skip
    assert payload["requests"][1][:7] == ["b", "running", 1, 40, 32, 16, 0]


def test_payload_stays_small_for_a_large_pool() -> None:
    """64 sequences over 40,000 blocks: one character per block, block lists only for held ones."""
    holders = tuple(BlockHolders(b, 1, (f"r{(b // 4) % 64}/0",)) for b in range(0, 40_000, 4))
    detail = SnapshotDetail(holders, 0, tuple(range(1, 40_000, 4)))
    snap = EngineSnapshot("generate", 1, time.monotonic(), num_total_blocks=40_000, detail=detail)
    text = json.dumps(page_payload(snap, {}))
    assert len(json.loads(text)["kv"]["tables"]) == 64
    payload = json.loads(text)
    assert payload["kv"]["states"].count("h") == 10_000
    assert payload["kv"]["states"].count("c") == 10_000
    assert len(text) < 200_000  # ~2 MB/s at 10 updates a second, not tens


class _Watcher:
    def __init__(self, events: int) -> None:
        self.left = events

    async def is_disconnected(self) -> bool:
        self.left -= 1
        return self.left < 0


async def test_stream_is_rate_limited_and_skips_unchanged_snapshots() -> None:
    engine = FakeEngine()
    calls = 0

    async def detailed() -> EngineSnapshot:
        nonlocal calls
        calls += 1
        snap = _snapshot()
        engine.published = (
            snap  # as the real engine: the detailed snapshot becomes the published one
        )
        return snap

    engine.detailed_snapshot = detailed  # type: ignore[method-assign]
    start = time.monotonic()
    frames = [f async for f in _events(engine, _Watcher(5), {}, lambda: False)]  # type: ignore[arg-type]
    elapsed = time.monotonic() - start
    data = [f for f in frames if f.startswith("data: ")]
    assert len(data) == 1 and calls == 1  # nothing changed after the first: idle comments only
    assert sum(f.startswith(": idle") for f in frames) == 4
    assert elapsed >= 4 / MAX_UPDATES_PER_SECOND * 0.9


def _client(**config: object) -> httpx.AsyncClient:
    app = build_app(ServerConfig(**config), FakeEngine())  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_page_and_assets_are_served() -> None:
    async with _client() as client:
        r = await client.get("/engine")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/engine/static/engine.js" in r.text
        r = await client.get("/engine/static/engine.js")
        assert r.status_code == 200 and "EventSource" in r.text
        r = await client.get("/engine/static/../state.py")
        assert r.status_code == 404
        r = await client.get("/engine/static/nothing.js")
        assert r.status_code == 404 and "error" in r.json()


async def test_page_can_be_turned_off() -> None:
    async with _client(engine_page=False) as client:
        for path in ("/engine", "/engine/stream", "/engine/static/engine.js"):
            r = await client.get(path)
            assert r.status_code == 404
            assert "--no-engine-page" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/engine", {}, 401),
        ("/engine?api_key=k", {}, 200),
        ("/engine?api_key=bad", {}, 401),
        ("/engine", {"Authorization": "Bearer k"}, 200),
        ("/engine/static/engine.css", {"Cookie": "kvserve_engine_key=k"}, 200),
        ("/engine/static/engine.css", {"Cookie": "kvserve_engine_key=bad"}, 401),
        ("/v1/models?api_key=k", {}, 401),  # the query key is for the page's routes only
        ("/v1/models", {"Cookie": "kvserve_engine_key=k"}, 401),
    ],
)
async def test_key_by_header_query_or_cookie(
    path: str, headers: dict[str, str], status: int
) -> None:
    async with _client(api_key="k") as client:
        r = await client.get(path, headers=headers)
        assert r.status_code == status, r.text


async def test_page_load_with_key_sets_the_stream_cookie() -> None:
    async with _client(api_key="k") as client:
        r = await client.get("/engine?api_key=k")
        cookie = r.headers["set-cookie"]
        assert "kvserve_engine_key=k" in cookie and "HttpOnly" in cookie
        assert "Path=/engine" in cookie and "SameSite=strict" in cookie


def test_payload_shows_the_kv_offload_tiers_fill() -> None:
    from engine.core.kv_offload import KVOffloadStats

    assert page_payload(_snapshot(), {})["kv_offload"] is None  # no tiers: the card stays hidden
    tiers = KVOffloadStats(
        memory_hits=3, memory_bytes=2048, memory_capacity=4096, memory_entries=2, misses=5
    )
    tiers.disk_bytes, tiers.disk_capacity, tiers.disk_entries = 100, 1000, 1  # disk_enabled False
    snap = EngineSnapshot("generate", 1, time.monotonic(), kv_offload=tiers)
    payload = page_payload(snap, {})["kv_offload"]
    assert payload == {"memory": [2048, 4096, 2, 3], "disk": [100, 0, 1, 0], "misses": 5}
