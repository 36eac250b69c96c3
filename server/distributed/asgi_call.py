"""Run one HTTP request through an in-process ASGI app and stream its response: the start message
(status and headers) first, then body chunks. A cancelled caller reads as a client disconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

Headers = list[tuple[bytes, bytes]]


@dataclass
class ForwardRequest:
    """One HTTP request as the ingress read it, plus what the request router matches: the prompt's
    token ids (against the replicas' KV events) or, without them, its text; both under the
    request's cache salt (vLLM's `cache_salt`), whose blocks only requests of that salt share."""

    method: str
    path: str
    query_string: bytes
    headers: Headers
    body: bytes
    client: tuple[str, int] | None = None
    routing_text: str = ""
    routing_tokens: list[int] | None = None
    cache_salt: str | None = None
    model: str | None = None  # the body's `model`: an adapter's KV blocks hash under its content


@dataclass
class ResponseStart:
    status: int
    headers: Headers = field(default_factory=list)


async def call_asgi(app: Any, request: ForwardRequest) -> AsyncIterator[ResponseStart | bytes]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=5)
