"""The live engine page: GET /engine (static HTML, CSS and JavaScript shipped in server/static/engine),
and GET /engine/stream, a server-sent-event stream of the engine's detailed snapshots (steps, KV blocks
and their holders, requests, queue limits), at most MAX_UPDATES_PER_SECOND, only while someone watches.

A browser cannot put a header on a page load or an EventSource, so with --api-key the page routes also
take the key as `?api_key=` (the page then keeps it in a same-site cookie for its stream)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from engine import EngineClient, EngineSnapshot
from server.errors import APIError
from server.state import ServerState

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static" / "engine"
ASSETS = {"engine.js": "text/javascript", "engine.css": "text/css"}
MAX_UPDATES_PER_SECOND = 10
KEY_COOKIE = "kvserve_engine_key"
PAGE_PREFIX = "/engine"

router = APIRouter(include_in_schema=False)


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if not state.config.engine_page:
        raise APIError("The engine page is turned off (--no-engine-page).", status=404)
    return state


@router.get("/engine")
async def engine_page(request: Request) -> Response:
    state = _state(request)
    response = FileResponse(STATIC_DIR / "index.html", media_type="text/html")
    key = request.query_params.get("api_key")
    if key is not None and state.config.api_key is not None:
        # The guard already checked it; the stream then authenticates by cookie.
        response.set_cookie(KEY_COOKIE, key, path=PAGE_PREFIX, httponly=True, samesite="strict")
    response.headers["Cache-Control"] = "no-store"
    return response


@router.get("/engine/static/{name}")
async def engine_asset(name: str, request: Request) -> Response:
    _state(request)
    if name not in ASSETS:
        raise APIError(f"No asset named {name!r}.", status=404)
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name])


@router.get("/engine/stream")
async def engine_stream(request: Request) -> Response:
    state = _state(request)
    engine = state.require_engine()
    limits = {
        "max_queued_requests": engine.max_queued_requests,
        "max_queued_tokens": engine.max_queued_tokens,
    }
    return StreamingResponse(
        _events(engine, request, limits, lambda: state.draining),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def _events(
    engine: EngineClient,
    request: Request,
    limits: dict[str, Any],
    draining: Callable[[], bool],
) -> AsyncIterator[str]:
    """The page's feed until the client leaves or the server starts shutting down (a watched page
    must not hold the drain)."""
    interval = 1.0 / MAX_UPDATES_PER_SECOND
    loop = asyncio.get_running_loop()
    last_time: float | None = None
    last_step = 0
    yield "retry: 1000\n\n"
    while not draining() and not await request.is_disconnected():
        started = loop.time()
        snapshot = engine.snapshot()
        if snapshot.time != last_time:
            # Only a changed engine (a step, an add or an abort since the last event) pays for the
            # detailed snapshot; the published one then carries its time, so an idle engine stays put.
            try:
                snapshot = await engine.detailed_snapshot()
            except Exception as e:  # noqa: BLE001 - the engine died: say so and end the stream
                yield f"event: error\ndata: {json.dumps({'message': str(e)})}\n\n"
                return
            last_time = snapshot.time
            payload = page_payload(snapshot, limits, last_step)
            last_step = snapshot.num_steps
            yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
        else:
            yield ": idle\n\n"  # keeps proxies from timing the stream out, costs the engine nothing
        await asyncio.sleep(max(0.0, interval - (loop.time() - started)))


def _tiers(snap: EngineSnapshot) -> dict[str, Any] | None:
    """The KV offload tiers' fill and hits (None: no tiers)."""
    t = snap.kv_offload
    if t is None:
        return None
    return {
        "memory": [t.memory_bytes, t.memory_capacity, t.memory_entries, t.memory_hits],
        "disk": [
            t.disk_bytes,
            t.disk_capacity if t.disk_enabled else 0,
            t.disk_entries,
            t.disk_hits,
        ],
        "misses": t.misses,
    }


def _kv_events(snap: EngineSnapshot) -> dict[str, Any] | None:
    ev = snap.kv_events
    if ev is None:
        return None
    return {
        "endpoint": ev.endpoint,
        "replay_endpoint": ev.replay_endpoint,
        "topic": ev.topic,
        "num_batches": ev.num_batches,
        "num_events": ev.num_events,
        "num_dropped": ev.num_dropped,
        "alive": ev.alive,
    }


# Block states as the page draws them, one character per block.
FREE, CACHED_FREE, HELD, SHARED = ".", "c", "h", "s"


def page_payload(
    snap: EngineSnapshot, limits: dict[str, Any], after_step: int = 0
) -> dict[str, Any]:
    """What the page draws, compact enough for tens of thousands of blocks at 10 updates a second:
    one state character per block, per sequence the blocks it holds (hover and highlight), and the
    steps after `after_step` (the page keeps the timeline; each event adds only what is new)."""
    detail = snap.detail
    states = bytearray(FREE.encode()) * snap.num_total_blocks
    tables: dict[str, list[int]] = {}
    steps: list[list[float]] = []
    config: dict[str, Any] = {}
    if detail is not None:
        for block_id in detail.cached_free_block_ids:
            states[block_id] = ord(CACHED_FREE)
        for b in detail.blocks:
            states[b.block_id] = ord(SHARED if b.ref_count > 1 else HELD)
            for seq_id in b.seq_ids:
                tables.setdefault(seq_id, []).append(b.block_id)
        steps = [
            [
                s.step,
                round(s.duration, 6),
                s.num_prefill_tokens,
                s.num_decode_tokens,
                s.num_preemptions,
                s.num_running,
                s.num_waiting,
                s.num_draft_tokens,
                s.num_accepted_tokens,
            ]
            for s in detail.steps
            if s.step > after_step
        ]
        config = {
            "block_size": detail.block_size,
            "token_budget": detail.token_budget,
            "max_num_seqs": detail.max_num_seqs,
        }
    return {
        "time": snap.time,
        "num_steps": snap.num_steps,
        "config": config | limits,
        "totals": {
            "num_prompt_tokens": snap.num_prompt_tokens,
            "num_generation_tokens": snap.num_generation_tokens,
            "prefix_cache_queries": snap.prefix_cache_queries,
            "prefix_cache_hits": snap.prefix_cache_hits,
            "num_preemptions": snap.num_preemptions,
            "num_finished": snap.num_finished,
        },
        "queue": {
            "num_requests_running": snap.num_requests_running,
            "num_requests_waiting": snap.num_requests_waiting,
            "num_running": snap.num_running,
            "num_waiting": snap.num_waiting,
            "num_waiting_tokens": snap.num_waiting_tokens,
        },
        "kv": {
            "num_blocks": snap.num_total_blocks,
            "num_free_blocks": snap.num_free_blocks,
            "usage": snap.kv_cache_usage,
            "states": states.decode(),
            "tables": tables,
        },
        "kv_offload": _tiers(snap),
        # The KV events publisher (--kv-events-config), or null.
        "kv_events": _kv_events(snap),
        # [step, duration s, prefill tokens, decode tokens, preemptions, running, waiting,
        #  draft tokens verified (among the prefill tokens), drafts accepted]
        "steps": steps,
        "requests": [
            [
                r.request_id,
                r.state,
                r.num_samples,
                r.num_prompt_tokens,
                r.num_computed_tokens,
                r.num_cached_tokens,
                r.num_output_tokens,
                round(snap.time - r.arrival_time, 3),
                r.lora,  # the LoRA adapter (None: the base model)
            ]
            for r in snap.requests
        ],
    }
