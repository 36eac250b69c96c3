"""Pure-ASGI middleware (no BaseHTTPMiddleware, so disconnects and streaming pass through untouched):
request ids, the drain gate with in-flight counting, the API key (bearer or x-api-key) and the body-size cap."""

from __future__ import annotations

import hmac
import uuid
from typing import Any

from starlette.datastructures import Headers, MutableHeaders, QueryParams
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.engine_page import KEY_COOKIE, PAGE_PREFIX
from server.errors import APIError, service_unavailable, to_api_error
from server.state import ServerState

OPEN_PATHS = ("/health",)  # answered without an API key and while draining


class RequestIdMiddleware:
    """Every response carries X-Request-Id (the client's, if it sent one); routes read scope["state"]."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id")
        request_id = (
            given if given and len(given) <= 128 and given.isprintable() else uuid.uuid4().hex
        )
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class UnhandledErrorMiddleware:
    """Innermost: an exception no handler took (a bug) is answered with the 500 envelope and logged.

    Starlette's own catch-all re-raises after answering, and the server then drops the keep-alive
    connection, so the client's next request on it fails too; here the connection stays usable.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise  # half a response is out: only the server can end the connection
            await _send_error(send, to_api_error(exc), None, scope["path"])


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body exceeds the limit of {limit} bytes.")


class GuardMiddleware:
    """Draining -> 503; API key -> 401; body over the cap -> 413; counts in-flight requests."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        config = self.state.config
        headers = Headers(scope=scope)
        if path not in OPEN_PATHS:
            if self.state.draining:
                err = service_unavailable("The server is shutting down.")
                await _send_error(send, err, {"Connection": "close"}, path)
                return
            if config.api_key is not None and not key_ok(
                headers, config.api_key, path, scope.get("query_string", b"")
            ):
                err = APIError(
                    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>' "
                    "or 'x-api-key: <key>'.",
                    status=401,
                    code="invalid_api_key",
                )
                await _send_error(send, err, {"WWW-Authenticate": "Bearer"}, path)
                return
        limit = config.max_request_body_bytes
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            err = APIError(f"The request body exceeds the limit of {limit} bytes.", status=413)
            await _send_error(send, err, None, path)
            return
        received = 0

        async def capped_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        counted = path not in OPEN_PATHS
        self.state.in_flight += counted
        try:
            await self.app(scope, capped_receive, send)
        finally:
            self.state.in_flight -= counted


def key_ok(headers: Headers, api_key: str, path: str = "", query_string: bytes = b"") -> bool:
    """The key as a bearer token (OpenAI clients) or in x-api-key (Anthropic clients); on the engine
    page's routes also as `?api_key=` or the page's cookie (a browser cannot send a header with a
    page load or an EventSource)."""
    given = headers.get("x-api-key")
    if given is not None and hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return True
    auth = headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer":
        return hmac.compare_digest(token.strip().encode(), api_key.encode())
    if path == PAGE_PREFIX or path.startswith(PAGE_PREFIX + "/"):
        given = QueryParams(query_string).get("api_key")
        if given is None:
            given = _cookie(headers, KEY_COOKIE)
        return given is not None and hmac.compare_digest(given.encode(), api_key.encode())
    return False


def _cookie(headers: Headers, name: str) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


async def _send_error(
    send: Send, err: APIError, extra_headers: dict[str, str] | None = None, path: str | None = None
) -> None:
    response = err.response(path)
    for key, value in (extra_headers or {}).items():
        response.headers[key] = value
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Any:
    return {"type": "http.disconnect"}
