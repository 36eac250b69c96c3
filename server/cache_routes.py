"""POST /reset_prefix_cache, vLLM's development route: drop every cached prefix block (KV events:
AllBlocksCleared). Served behind the API key when the server has one, or without one in dev mode
(--server-dev-mode, vLLM's VLLM_SERVER_DEV_MODE); otherwise it answers 404, as vLLM's is absent
while its switch is off."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from server.errors import APIError, invalid_request
from server.protocol import ErrorResponse
from server.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter()
RESET_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"description": "The prefix cache is empty (vLLM's empty 200)."},
    **{code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 503)},
}


@router.post("/reset_prefix_cache", responses=RESET_RESPONSES)
async def reset_prefix_cache(
    request: Request,
    reset_running_requests: bool = Query(default=False),
    reset_external: bool = Query(default=False),
) -> Response:
    """Forget every cached prefix block, so the next requests compute their prompts again. Refused
    (409) while running requests hold blocks, instead of vLLM's silent 200 that reset nothing."""
    state: ServerState = request.app.state.server
    if not state.config.dev_routes:
        raise APIError(
            "POST /reset_prefix_cache is off: start the server with --api-key (the route is then "
            "behind it) or --server-dev-mode (vLLM's VLLM_SERVER_DEV_MODE=1).",
            status=404,
            code="not_found",
        )
    for name, value in (
        ("reset_running_requests", reset_running_requests),
        ("reset_external", reset_external),
    ):
        if value:
            what = "running requests" if name == "reset_running_requests" else "the KV tiers"
            raise invalid_request(
                f"{name}=true is not supported: this server does not reset {what}", name
            )
    engine = state.require_engine()
    if not await engine.reset_prefix_cache():
        raise APIError(
            "The prefix cache cannot be reset while requests hold KV blocks; retry when they "
            "have finished.",
            status=409,
            code="requests_running",
        )
    logger.info("prefix cache reset")
    return Response(status_code=200)
