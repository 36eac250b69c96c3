"""The FastAPI application: routes, middleware and error handlers over one ServerState."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from engine import EngineClient
from server.cache_routes import router as cache_router
from server.engine_page import router as engine_page_router
from server.errors import APIError, install_error_handlers, invalid_request, service_unavailable
from server.lora_routes import router as lora_router
from server.metrics import MetricsMiddleware, ServerMetrics
from server.metrics import router as metrics_router
from server.middleware import GuardMiddleware, RequestIdMiddleware, UnhandledErrorMiddleware
from server.models_registry import model_card, model_cards
from server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.protocol_messages import (
    AnthropicErrorResponse,
    CountTokensRequest,
    MessageObject,
    MessagesRequest,
    MessageTokensCount,
)
from server.protocol_responses import ResponseDeleted, ResponseObject, ResponsesRequest
from server.serving_chat import apply_template, create_chat_completion
from server.serving_completions import create_completion
from server.serving_embeddings import create_embedding, require_task
from server.serving_messages import count_tokens, create_message
from server.serving_responses import create_response, delete_response, retrieve_response
from server.serving_score import create_score
from server.state import ServerConfig, ServerState
from server.turn_request import turn_messages

logger = logging.getLogger(__name__)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
}
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    # Before OpenAPI 3.2 an event stream's schema describes one event: JSON chunks, then "[DONE]".
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": {"type": "string"}},
                }
            }
        }
    }
}


def kvserve_version() -> str:
    try:
        return importlib.metadata.version("kvserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _generating(request: Request) -> ServerState:
    """The server state, once its engine is known to generate text (else a 400 saying which to use)."""
    state = _state(request)
    require_task(state.require_engine(), "generate")
    return state


router = APIRouter()


@router.head("/health", include_in_schema=False)  # load balancers probe with HEAD
@router.get("/health", responses={503: {"model": ErrorResponse}})
async def health(request: Request) -> Response:
    """200 once the model is loaded and the engine runs; 503 while loading, draining or dead."""
    state = _state(request)
    if state.ready:
        return JSONResponse({"status": "ok"})
    try:
        state.require_engine()
        err = service_unavailable("The engine is not ready.")
    except APIError as e:
        err = e
    return err.response()


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": kvserve_version()}


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    """The base model, then each LoRA adapter served (`parent`: the base model)."""
    state = _state(request)
    return ModelList(data=model_cards(state.require_engine(), state.model_name, state.created))


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    state = _state(request)
    return model_card(state.require_engine(), state.model_name, state.created, model)


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses=ERROR_RESPONSES | STREAM_RESPONSE,
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(body, request, _generating(request))


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses=ERROR_RESPONSES | STREAM_RESPONSE,
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(body, request, _generating(request))


@router.post("/v1/score", response_model=ScoreResponse, responses=ERROR_RESPONSES)
async def score(body: ScoreRequest, request: Request) -> Response:
    """Each choice's probability as the continuation of the prompt (or the chat's next reply)."""
    return await create_score(body, request, _generating(request))


@router.post(
    "/v1/responses", response_model=ResponseObject, responses=ERROR_RESPONSES | STREAM_RESPONSE
)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API over the chat path; `store` keeps the response for continuation."""
    return await create_response(body, request, _generating(request))


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=ERROR_RESPONSES)
async def get_response(response_id: str, request: Request) -> Response:
    return retrieve_response(response_id, _state(request))


@router.delete(
    "/v1/responses/{response_id}", response_model=ResponseDeleted, responses=ERROR_RESPONSES
)
async def remove_response(response_id: str, request: Request) -> Response:
    return delete_response(response_id, _state(request))


@router.post(
    "/v1/messages",
    response_model=MessageObject,
    responses=ANTHROPIC_ERROR_RESPONSES | STREAM_RESPONSE,
)
async def messages(body: MessagesRequest, request: Request) -> Response:
    """Anthropic's Messages API over the chat path (errors in Anthropic's envelope)."""
    return await create_message(body, request, _generating(request))


@router.post(
    "/v1/messages/count_tokens",
    response_model=MessageTokensCount,
    responses=ANTHROPIC_ERROR_RESPONSES,
)
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> MessageTokensCount:
    return MessageTokensCount(**count_tokens(body, _generating(request)))


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await create_embedding(body, request, _state(request))


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = _state(request)
    engine = state.require_engine()
    state.check_model(body.model)
    tokenizer = engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("Give exactly one of prompt or messages.", "prompt")
    if body.messages is not None:
        kwargs = dict(state.config.chat_template_kwargs or {})
        add_generation_prompt = body.add_generation_prompt is not False
        messages = turn_messages(body.messages)
        special = body.add_special_tokens is True
        tokens, _ = apply_template(
            tokenizer, messages, add_generation_prompt, None, kwargs, add_special_tokens=special
        )
    else:
        assert body.prompt is not None  # exactly one of the two is given
        tokens = list(
            tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        )
    strings = list(tokenizer.token_strings(tokens)) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strings
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = _state(request)
    engine = state.require_engine()
    state.check_model(body.model)
    vocab_size = engine.tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
        raise invalid_request(
            f"token id {bad} is outside the vocabulary (size {vocab_size})", "tokens"
        )
    return DetokenizeResponse(
        prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
    )


@router.get("/v1/internal/stats", include_in_schema=False)
async def engine_stats(request: Request, detail: bool = False) -> dict[str, Any]:
    """The engine's latest EngineSnapshot as JSON (counts and KV blocks; `?detail=true` adds one
    progress row per request and who holds each KV block) and the HTTP requests in flight, for tests
    and debugging."""
    state = _state(request)
    engine = state.require_engine()
    snapshot = await engine.detailed_snapshot() if detail else engine.snapshot()
    return {**dataclasses.asdict(snapshot), "in_flight_http_requests": state.in_flight}


def build_app(config: ServerConfig, engine: EngineClient | None = None) -> FastAPI:
    """The app for `config`; `engine` may be attached later (`app.state.server.engine = ...`)."""
    app = FastAPI(
        title="kvserve", version=kvserve_version(), description="OpenAI-compatible LLM server"
    )
    app.state.server = ServerState(config, engine)
    app.state.metrics = ServerMetrics(app.state.server)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(lora_router)
    app.include_router(cache_router)
    app.include_router(metrics_router)
    app.include_router(engine_page_router)
    # Added innermost first: requests pass Metrics -> RequestId -> CORS -> Guard -> UnhandledError -> routes.
    app.add_middleware(UnhandledErrorMiddleware)
    app.add_middleware(GuardMiddleware, state=app.state.server)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.add_middleware(RequestIdMiddleware)
    routes = [
        *router.routes,
        *lora_router.routes,
        *metrics_router.routes,
        *engine_page_router.routes,
        *app.router.routes,
    ]
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics, routes=routes)
    return app
