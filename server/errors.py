"""The error envelopes: one exception type, the mapping from engine errors (by exception type, never by
message text), and FastAPI handlers that answer in OpenAI's envelope, or in Anthropic's on the Messages
API paths (`/v1/messages...`)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import (
    ConstraintError,
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    LoRANotFoundError,
    PromptError,
    QueueFullError,
    RequestError,
    ShuttingDownError,
    WrongTaskError,
)
from server.field_map import COMPLETION_FIELDS, FieldMap

logger = logging.getLogger(__name__)

ANTHROPIC_PATH_PREFIX = "/v1/messages"
# Anthropic's error types by HTTP status (any other 4xx is invalid_request_error, any other 5xx api_error).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# OpenAI request fields that kvserve does not implement: a non-empty value is a 400 naming the field.
UNSUPPORTED_MESSAGE = "{field!r} is not supported by this server"


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's envelope: {"type": "error", "error": {"type", "message"}}; the message names the field."""
        kind = ANTHROPIC_ERROR_TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "api_error"
        )
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, path: str | None = None) -> JSONResponse:
        """The error in the envelope of the API that `path` belongs to (OpenAI's unless Anthropic's)."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def is_anthropic_path(path: str | None) -> bool:
    return path is not None and (
        path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")
    )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)


def context_length_exceeded(message: str, param: str) -> APIError:
    return APIError(message, status=400, param=param, code="context_length_exceeded")


def context_length_message(exc: ContextLengthError) -> str:
    """The engine's words, with what a client of this server can do about a request over the pool."""
    if exc.kv_pool:
        return f"{exc}; shorten it or start the server with a larger KV cache."
    return str(exc)


def wrong_task(served: str) -> APIError:
    """A 400 when the route needs a different kind of model than the one served."""
    if served == "embed":
        message = (
            "This server runs an embedding model: use POST /v1/embeddings. Text generation and "
            "scoring (/v1/completions, /v1/chat/completions, /v1/score) need a server started with "
            "a generative model."
        )
    else:
        message = (
            "This server runs a text generation model: /v1/embeddings needs a server started with "
            "an embedding model (kvserve serve --task embed [MODEL])."
        )
    return APIError(message, status=400, code="unsupported_task")


def model_not_found(model: str, served: Sequence[str] = ()) -> APIError:
    """A 404 for a `model` this server does not serve, naming those it does."""
    listed = f"this server serves {', '.join(map(repr, served))}" if served else "none is served"
    return APIError(
        f"The model {model!r} does not exist; {listed} (GET /v1/models lists them).",
        status=404,
        param="model",
        code="model_not_found",
    )


def lora_not_found(exc: LoRANotFoundError) -> APIError:
    """An adapter unloaded between a request's check and its start (or an unload of one not served)."""
    served = ", ".join(map(repr, exc.served)) if exc.served else "none"
    return APIError(
        f"The model {exc.name!r} does not exist: no LoRA adapter of that name is loaded "
        f"(loaded adapters: {served}; GET /v1/models lists every model).",
        status=404,
        param="model",
        code="model_not_found",
    )


def service_unavailable(message: str) -> APIError:
    return APIError(message, status=503, type="server_error", code="service_unavailable")


def to_api_error(exc: BaseException, fields: FieldMap = COMPLETION_FIELDS) -> APIError:
    """Map an exception raised while serving a request to the error the client sees. Only the engine's
    InvalidRequestError family blames the request (400, its field named through `fields`, this API's
    names; a PromptError names the API's prompt field); any other exception, a plain ValueError too,
    is a bug: a logged 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        retry_after = max(1, math.ceil(exc.retry_after))
        return APIError(
            str(exc) or "The server is overloaded; retry later.",
            status=429,
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry_after)},
        )
    if isinstance(exc, EngineDeadError):
        return service_unavailable(f"The engine is not running: {exc}")
    if isinstance(exc, ShuttingDownError):
        return service_unavailable(f"The server is shutting down: {exc}; retry the request.")
    if isinstance(exc, ContextLengthError):
        return context_length_exceeded(context_length_message(exc), fields.prompt)
    if isinstance(exc, PromptError):
        return invalid_request(str(exc), param=fields.prompt)
    if isinstance(exc, ConstraintError):
        name = fields.name(exc.param)
        return invalid_request(f"the constrained decoder cannot follow {name}: {exc.reason}", name)
    if isinstance(exc, WrongTaskError):
        return wrong_task(exc.served)
    if isinstance(exc, LoRANotFoundError):
        return lora_not_found(exc)
    if isinstance(exc, InvalidRequestError):
        return invalid_request(str(exc), param=fields.name(exc.param) if exc.param else None)
    if isinstance(exc, RequestError):
        return APIError(str(exc), status=500, type="server_error", code="internal_error")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(
        "The server had an error while processing your request.",
        status=500,
        type="server_error",
        code="internal_error",
    )


def _is_member_tag(item: Any) -> bool:
    """pydantic's names for union members and wrappers in an error's loc, e.g. "list[int]", "str"."""
    if not isinstance(item, str):
        return False
    return (
        "[" in item
        or "function-" in item
        or item.startswith(("literal[", "constrained-"))
        or item in ("str", "int", "float", "bool", "dict", "list", "none")
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"; pydantic union tags are dropped."""
    parts: list[str] = []
    for item in loc:
        if item in ("body", "query", "path", "header") or _is_member_tag(item):
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def _split_union(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], str, tuple[Any, ...]] | None:
    """(field path, union member tag, path inside the member), or None outside a union."""
    for k, item in enumerate(loc):
        if _is_member_tag(item):
            return loc[:k], item, loc[k + 1 :]
    return None


def _is_type_error(error: dict[str, Any]) -> bool:
    kind = str(error.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind == "is_instance_of"


_MEMBER_NOUNS = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "none": "null",
    "dict": "an object",
    "list": "a list",
}


def _member_noun(tag: str) -> str:
    if tag.startswith("list["):
        return "a list"
    if tag.startswith("dict["):
        return "an object"
    if tag.startswith("constrained-"):
        tag = tag[len("constrained-") :]
    if tag.startswith("literal[") and tag.endswith("]"):
        return tag[len("literal[") : -1]
    return _MEMBER_NOUNS.get(tag, tag)


def _union_error(errors: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None] | None:
    """For a union field, the one error worth showing: from the member that got furthest into the
    value (a later list index, then a deeper path), preferring a broken constraint to a wrong type.
    Returns (error, message override when no member took the value's type), or None if no union."""
    split = _split_union(tuple(errors[0].get("loc", ())))
    if split is None:
        return None
    field = split[0]

    def progress(entry: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[Any, ...]:
        inner, error = entry
        indexes = tuple(i for i in inner if isinstance(i, int))
        return (indexes, len(inner), not _is_type_error(error))

    # A member's progress is where its first error is; within that element, its deepest error is the
    # one to show (a nested union, a string or a list of parts, says which part is wrong).
    first_per_member: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    for error in errors:
        parts = _split_union(tuple(error.get("loc", ())))
        if parts is None or parts[0] != field:
            continue
        entry = (parts[2], error)
        known = first_per_member.get(parts[1])
        if known is None:
            first_per_member[parts[1]] = entry
            continue
        known_indexes = progress(known)[0]
        if progress(entry)[0][: len(known_indexes)] == known_indexes and progress(entry) > progress(
            known
        ):
            first_per_member[parts[1]] = entry

    inner, best = max(first_per_member.values(), key=progress)
    if inner or not _is_type_error(best):
        return best, None
    nouns = list(dict.fromkeys(_member_noun(tag) for tag in first_per_member))
    wanted = nouns[0] if len(nouns) == 1 else ", ".join(nouns[:-1]) + " or " + nouns[-1]
    return best, f"Input should be {wanted}"


def validation_error(errors: list[dict[str, Any]], content_type: str | None = None) -> APIError:
    """Turn pydantic errors into one 400 naming the first offending field."""
    if not errors:
        return invalid_request("Invalid request.")
    first = errors[0]
    kind = first.get("type", "")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if kind in ("json_invalid", "json_type"):
        return invalid_request(
            "The request body is not valid JSON: " + str(first.get("msg", "")).strip(),
            code="invalid_json",
        )
    if param is None and (kind == "missing" or _is_type_error(first)):
        message = "The request body must be a JSON object."
        if content_type is not None and "json" not in content_type.lower():
            message += (
                f" It was sent as {content_type!r}; send JSON with Content-Type: application/json."
            )
        return invalid_request(message)
    if kind == "none_required" and param:
        return invalid_request(
            UNSUPPORTED_MESSAGE.format(field=param), param=param, code="unsupported_parameter"
        )
    if kind == "extra_forbidden" and param:
        return invalid_request(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    message = str(first.get("msg", "invalid value"))
    union = _union_error(errors)
    best = first
    if union is not None:
        best, override = union
        loc = tuple(best["loc"])
        if not any(isinstance(i, str) and (i.startswith("type[") or "union[" in i) for i in loc):
            # A union of plain values (prompt: text, token ids or lists of them) is one field;
            # the message says where in it.
            field, _, _ = _split_union(loc) or ((), "", ())
            param = _loc_to_param(field)
        else:  # the objects of a union of models: the full path, as for any object field
            param = _loc_to_param(loc)
        where = _loc_to_param(loc)
        message = override or str(best.get("msg", "invalid value"))
    else:
        where = param
    index = getattr(best.get("ctx", {}).get("error"), "index", None)
    if param is not None and where is not None and isinstance(index, int):
        param, where = f"{param}[{index}]", f"{where}[{index}]"  # a PartError: the part
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    message = message.replace(" after validation", "")
    return invalid_request(f"{where}: {message}" if where else message, param=param)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    err = validation_error(list(exc.errors()), request.headers.get("content-type"))
    return err.response(request.url.path)


async def _http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        err = APIError(
            f"Invalid URL ({request.method} {request.url.path})", status=404, code="not_found"
        )
    elif exc.status_code == 405:
        err = APIError(
            f"Method {request.method} is not allowed for {request.url.path}",
            status=405,
            code="method_not_allowed",
        )
    else:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(detail, status=exc.status_code, type=kind)
    response = err.response(request.url.path)
    response.headers.update(dict(exc.headers or {}))
    return response


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    return to_api_error(exc).response(request.url.path)


def _document_errors_as_sent(app: FastAPI) -> None:
    """FastAPI documents a 422 HTTPValidationError on every route with a body or parameters; this
    server answers validation failures with the 400 envelope instead, so the schema must not promise it."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    _document_errors_as_sent(app)
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    engine_errors = (
        QueueFullError,
        EngineDeadError,
        ShuttingDownError,
        RequestError,
        InvalidRequestError,
    )
    for engine_error in engine_errors:
        app.add_exception_handler(engine_error, _unexpected_handler)
    # Anything else is a bug: answered as a 500 envelope (Starlette then re-raises it for the log).
    app.add_exception_handler(Exception, _unexpected_handler)
