"""No client input yields a 500: hostile bodies, unencodable text, engine errors of every kind; plus the
API key on every route but /health and CORS only when origins are configured (fake engine, no model)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine import ContextLengthError, InvalidRequestError, PromptError, RequestError
from tests.unit.server_fakes import FakeEngine, app_client

JSON = {"content-type": "application/json"}


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"prompt": "a", "top_p": Infinity}', "top_p"),
        ("/v1/completions", b'{"prompt": "a", "presence_penalty": -Infinity}', "presence_penalty"),
        ("/v1/completions", b'{"prompt": "a", "logit_bias": {"5": NaN}}', "logit_bias.5"),
        ("/v1/completions", b'{"prompt": "a", "temperature": 1e400}', "temperature"),
        ("/v1/completions", b'{"prompt": "a\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"]}', "stop"),
        ("/v1/completions", b'{"prompt": "a", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
        ("/v1/completions", b'{"prompt": "a", "logit_bias": {"-3": 1}}', "logit_bias"),
        ("/v1/completions", b'{"prompt": "a", "logit_bias": {" 5": 1}}', "logit_bias"),
        ("/v1/completions", '{"prompt": "a", "logit_bias": {"\u0665": 1}}'.encode(), "logit_bias"),
        (
            "/v1/completions",
            b'{"prompt": "a", "logit_bias": {"' + b"9" * 5000 + b'": 1}}',
            "logit_bias",
        ),
        ("/v1/completions", b'{"prompt": "a", "n": 2, "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", b'{"prompt": [-1]}', "prompt"),
        ("/v1/completions", b'{"prompt": [[]]}', "prompt"),
        ("/v1/completions", b'{"prompt": ""}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": -1}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 10000000000000000000000}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "n": 100000}', "n"),
        ("/v1/completions", b'{"prompt": "a", "best_of": 100000}', "best_of"),
        ("/v1/completions", b'{"prompt": "a", "logprobs": 6}', "logprobs"),
        ("/v1/completions", b'{"prompt": "a", "frequency_penalty": 2.5}', "frequency_penalty"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', None),
        ("/tokenize", b'{"prompt": "\\udc00"}', "prompt"),
        ("/detokenize", b'{"tokens": [100000000000000000000000000000]}', "tokens"),
    ],
)
async def test_bad_values_are_400_naming_the_field(
    client: httpx.AsyncClient, path: str, body: bytes, param: str | None
) -> None:
    err = _error(await client.post(path, content=body, headers=JSON), 400, param)
    assert err["type"] == "invalid_request_error"
    if param is None:
        assert err["param"] and err["param"].startswith("messages[0]")


def _nested_schema(levels: int) -> bytes:
    """A JSON schema of `levels` nested objects, 2 JSON levels each (as text: too deep for json)."""
    return b'{"type":"object","properties":{"a":' * levels + b'{"type":"integer"}' + b"}}" * levels


@pytest.mark.parametrize("levels", [99, 150, 400])
@pytest.mark.parametrize(
    ("path", "head", "tail", "param"),
    [
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "response_format": '
            b'{"type": "json_schema", "json_schema": {"name": "n", "schema": ',
            b"}}}",
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
            b'"function": {"name": "t", "parameters": ',
            b"}}]}",
            "tools",
        ),
        (
            "/v1/responses",
            b'{"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": ',
            b"}}}",
            "text.format",
        ),
    ],
)
async def test_schemas_nested_past_any_use_are_400(
    client: httpx.AsyncClient, path: str, head: bytes, tail: bytes, param: str, levels: int
) -> None:
    """Deeper than a grammar can take, the request is refused naming its field (was a 500: the
    request checks and jsonschema recursed past Python's limit)."""
    r = await client.post(path, content=head + _nested_schema(levels) + tail, headers=JSON)
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err
    assert "nest" in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"null",
        b"[]",
        b'"text"',
        b'{"prompt": ',
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "a", "n": ' + b"9" * 5000 + b"}",
    ],
)
async def test_malformed_bodies_are_400(client: httpx.AsyncClient, body: bytes) -> None:
    _error(await client.post("/v1/completions", content=body, headers=JSON), 400)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
async def test_non_json_content_types_are_400(client: httpx.AsyncClient, content_type: str) -> None:
    r = await client.post(
        "/v1/completions", content=b"prompt=a", headers={"content-type": content_type}
    )
    _error(r, 400)


async def test_too_many_prompts_is_400_not_a_permanent_429(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.max_queued_requests = 4  # type: ignore[attr-defined]
    _error(await client.post("/v1/completions", json={"prompt": ["a"] * 5}), 400, "prompt")
    r = await client.post("/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


async def test_a_body_over_the_cap_without_content_length_is_413(engine: FakeEngine) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    async with app_client(engine, max_request_body_bytes=4096) as c:
        r = await c.post("/v1/completions", content=chunks(), headers=JSON)
        assert "content-length" not in r.request.headers
        _error(r, 413)


class _RaisingEngine(FakeEngine):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        raise self.exc
        yield  # an async generator, like the real engine's


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (InvalidRequestError("request id is already in use"), 400, "invalid_request_error"),
        (RequestError("model produced non-finite logits"), 500, "server_error"),
        (RuntimeError("a bug"), 500, "server_error"),
        # A plain ValueError is an internal bug, never blamed on the client (even when its message
        # reads like a user error).
        (ValueError("maximum context length exceeded"), 500, "server_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_errors_become_envelopes(
    exc: BaseException, status: int, kind: str, stream: bool
) -> None:
    async with app_client(_RaisingEngine(exc)) as c:
        r = await c.post("/v1/completions", json={"prompt": "a", "stream": stream})
        assert _error(r, status)["type"] == kind
        r = await c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "stream": stream},
        )
        assert _error(r, status)["type"] == kind


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_errors_map_by_type_not_message(stream: bool) -> None:
    """A ContextLengthError is context_length_exceeded whatever its text; a PromptError names each
    API's own prompt field; neither is recognised by matching words in the message."""
    cases = [
        (ContextLengthError("the KV pool is too small for this"), "context_length_exceeded"),
        (PromptError("token 7 is not allowed here"), None),
    ]
    for exc, code in cases:
        async with app_client(_RaisingEngine(exc)) as c:
            r = await c.post("/v1/completions", json={"prompt": "a", "stream": stream})
            assert _error(r, 400, "prompt")["code"] == code
            r = await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "stream": stream},
            )
            assert _error(r, 400, "messages")["code"] == code


async def test_an_internal_value_error_is_a_logged_500(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="server")
    async with app_client(_RaisingEngine(ValueError("invalid literal for int()"))) as c:
        r = await c.post("/v1/completions", json={"prompt": "a"})
    err = _error(r, 500)
    assert err["code"] == "internal_error" and "invalid literal" not in err["message"]
    logged = [rec for rec in caplog.records if rec.exc_info is not None]
    assert logged and "invalid literal for int()" in str(logged[0].exc_info[1])


async def test_the_engine_validates_prompts_once_for_every_api(engine: FakeEngine) -> None:
    """The server holds no prompt rules of its own: what the engine's check says is what each API
    answers, under its own field name."""
    engine.max_model_len = 8  # type: ignore[misc]
    async with app_client(engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 3})
        assert _error(r, 400, "prompt")["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 8}]}
        )
        assert _error(r, 400, "messages")["code"] == "context_length_exceeded"
    assert all(len(ids) <= 8 for _, ids, _ in engine.requests)


async def test_seeds_span_64_bits_for_every_sample(engine: FakeEngine) -> None:
    """Samples after the first get seeds mixed from (seed, index), so the largest seed is fine with
    n > 1; only a seed outside 64 bits is refused, by the engine's SamplingParams."""
    async with app_client(engine) as c:
        body = {"prompt": "a", "n": 3, "max_tokens": 1, "seed": 2**64 - 1}
        assert (await c.post("/v1/completions", json=body)).status_code == 200
        assert engine.requests[-1][2].seed == 2**64 - 1
        _error(await c.post("/v1/completions", json={**body, "seed": 2**64}), 400, "seed")
        _error(await c.post("/v1/completions", json={**body, "seed": -(2**63) - 1}), 400, "seed")


async def test_chat_template_failure_is_400(engine: FakeEngine) -> None:
    def broken(*args: Any, **kwargs: Any) -> str:
        raise InvalidRequestError(
            "the chat template rejected these messages: roles must alternate", "messages"
        )

    engine.tokenizer.render_chat_template = broken  # type: ignore[method-assign]
    async with app_client(engine) as c:
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "x"}]}
        )
        assert "alternate" in _error(r, 400, "messages")["message"]


ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/fake-model"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("GET", "/v1/internal/stats"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/no/such/route"),
]


async def test_api_key_guards_every_route_but_health(engine: FakeEngine) -> None:
    async with app_client(engine, api_key="k3y") as c:
        assert (await c.get("/health")).status_code == 200
        for method, path in ROUTES:
            for headers in ({}, {"Authorization": "Bearer k3y-wrong"}, {"Authorization": "k3y"}):
                r = await c.request(method, path, headers=headers, json={})
                assert _error(r, 401)["code"] == "invalid_api_key", (method, path)
                assert r.headers["www-authenticate"] == "Bearer"
        ok = await c.get("/openapi.json", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and "/v1/completions" in ok.json()["paths"]


async def test_cors_is_off_unless_origins_are_given(engine: FakeEngine) -> None:
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    async with app_client(engine) as c:
        r = await c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await c.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
    async with app_client(engine, allowed_origins=("https://app.example",)) as c:
        r = await c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = await c.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = await c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        r = await c.options(
            "/v1/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_error_bodies_survive_json_encoding() -> None:
    """Envelopes never carry NaN or lone surrogates, which would make encoding the 400 itself fail."""
    from server.errors import validation_error

    err = validation_error(
        [
            {
                "type": "value_error",
                "loc": ("body", "temperature"),
                "msg": "bad",
                "input": float("nan"),
            }
        ]
    )
    json.dumps(err.body(), allow_nan=False).encode()
