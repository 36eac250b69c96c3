"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's bodies and answers: LoRA
adapters loaded and unloaded while serving. On when the server has an API key (and then behind it),
or with --allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); otherwise both
answer 404, as vLLM does while its switch is off."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from engine import LoRAError, LoRANotFoundError
from server.errors import APIError, invalid_request
from server.protocol import ErrorResponse, StrictModel
from server.state import ServerState

logger = logging.getLogger(__name__)

router = APIRouter()
# 200 is vLLM's plain-text sentence; errors are the usual JSON envelope.
LORA_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
    **{code: {"model": ErrorResponse} for code in (400, 401, 404, 503)},
}


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's in-place reload: not offered (unload, then load)


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's integer id: accepted, the name decides


def _updating(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if not state.config.runtime_lora_updating:
        if state.config.allow_runtime_lora_updating is False:  # turned off by the operator
            how = "this server was started with it turned off (--no-allow-runtime-lora-updating)"
        else:
            how = (
                "start the server with --api-key (the routes are then behind it) or "
                "--allow-runtime-lora-updating"
            )
        raise APIError(
            f"Loading LoRA adapters at run time is off: {how}.", status=404, code="not_found"
        )
    return state


@router.post("/v1/load_lora_adapter", responses=LORA_RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    """Load a PEFT LoRA folder under `lora_name`; requests then select it by `model`. A bad folder,
    rank or file is a 400 naming the field, and nothing served changes."""
    state = _updating(request)
    engine = state.require_engine()
    if body.load_inplace:
        raise invalid_request(
            "load_inplace is not supported: unload the adapter, then load it again",
            "load_inplace",
        )
    if not body.lora_name or not body.lora_path:
        missing = "lora_name" if not body.lora_name else "lora_path"
        raise invalid_request(f"{missing} must not be empty", missing)
    if body.lora_name == state.model_name:
        raise invalid_request(
            f"lora_name {body.lora_name!r} is the base model's id; give the adapter its own name",
            "lora_name",
        )
    try:
        info = await engine.load_lora(body.lora_name, body.lora_path)
    except LoRAError as e:
        raise invalid_request(str(e), e.param) from None
    logger.info(
        "loaded LoRA adapter %r from %s (rank %d, %d target modules)",
        info.name,
        info.path,
        info.rank,
        len(info.target_modules),
    )
    return PlainTextResponse(f"Success: LoRA adapter '{info.name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses=LORA_RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    """Stop serving `lora_name`: new requests for it get 404 at once, running ones finish on it."""
    state = _updating(request)
    engine = state.require_engine()
    try:
        await engine.unload_lora(body.lora_name)
    except LoRANotFoundError as e:
        served = ", ".join(map(repr, e.served)) if e.served else "none"
        raise APIError(
            f"The LoRA adapter {body.lora_name!r} cannot be found (loaded adapters: {served}).",
            status=404,
            param="lora_name",
            code="not_found",
        ) from None
    logger.info("unloaded LoRA adapter %r", body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
