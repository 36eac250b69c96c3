"""Server-sent events framing: OpenAI's chat/completions `data: {json}\\n\\n` frames ending in `data: [DONE]`,
and the typed `event: NAME` + `data:` frames of the Responses and Messages APIs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE_FRAME = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def to_json(value: Any) -> str:
    """Compact JSON, non-ASCII kept as is: what every SSE frame's data is written in."""
    return _encode(value)


def sse_frame(payload: dict[str, Any]) -> str:
    return "data: " + _encode(payload) + "\n\n"


def sse_event(event: str, payload: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {_encode(payload)}\n\n"


def sse_response(frames: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
