"""The same invalid input sent to chat completions, Responses and Messages: each error names the
surface's own field, in `param` and in the message alike (never chat's name for it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine import ConstraintError
from tests.unit.server_fakes import FakeEngine

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": 7}}}
LONG = "x" * 100  # the fake engine's model holds 64 tokens, one per byte


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 4, "messages": messages, **extra}


def _responses(items: list[dict[str, Any]] | str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_output_tokens": 4, "input": items, **extra}


def _messages(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 4, "messages": messages, **extra}


async def _openai_error(client: httpx.AsyncClient, path: str, body: dict) -> dict[str, Any]:
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


async def _anthropic_message(client: httpx.AsyncClient, body: dict) -> str:
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    return error["error"]["message"]


async def test_a_tool_message_answering_no_call(client: httpx.AsyncClient) -> None:
    chat = await _openai_error(
        client,
        "/v1/chat/completions",
        _chat(
            [
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "nope", "content": "x"},
            ]
        ),
    )
    assert chat["param"] == "messages[1].tool_call_id"
    assert chat["message"].startswith("messages[1] is a tool message answering tool_call_id 'nope'")

    responses = await _openai_error(
        client,
        "/v1/responses",
        _responses(
            [
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "nope", "output": "x"},
            ]
        ),
    )
    assert responses["param"] == "input[1]"
    assert responses["message"].startswith("input[1] is a tool message answering tool_call_id")
    assert "messages" not in responses["message"]

    # Messages: the text and the tool_result of one user message are two chat messages (1 and 2
    # after none before): the error names the Messages one, messages[0].
    message = await _anthropic_message(
        client,
        _messages(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {"type": "tool_result", "tool_use_id": "nope", "content": "x"},
                    ],
                }
            ]
        ),
    )
    assert message.startswith("messages[0] is a tool message answering tool_call_id 'nope'")
    assert "messages[1]" not in message


async def test_a_bad_tool_schema(client: httpx.AsyncClient) -> None:
    user = [{"role": "user", "content": "hi"}]
    chat = await _openai_error(
        client,
        "/v1/chat/completions",
        _chat(
            user, tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]
        ),
    )
    assert chat["param"] == "tools[0].function.parameters"
    assert chat["message"].startswith("invalid JSON schema at properties/a/type")

    responses = await _openai_error(
        client,
        "/v1/responses",
        _responses("hi", tools=[{"type": "function", "name": "f", "parameters": BAD_SCHEMA}]),
    )
    assert responses["param"] == "tools[0].parameters"
    assert responses["message"] == chat["message"]  # the schema's fault, worded alike

    message = await _anthropic_message(
        client, _messages(user, tools=[{"name": "f", "input_schema": BAD_SCHEMA}])
    )
    assert message == f"tools[0].input_schema: {chat['message']}"


async def test_a_prompt_over_the_model_length(client: httpx.AsyncClient) -> None:
    chat = await _openai_error(
        client, "/v1/chat/completions", _chat([{"role": "user", "content": LONG}])
    )
    assert (chat["param"], chat["code"]) == ("messages", "context_length_exceeded")
    assert chat["message"].startswith("This model's maximum context length is 64 tokens")

    responses = await _openai_error(client, "/v1/responses", _responses(LONG))
    assert (responses["param"], responses["code"]) == ("input", "context_length_exceeded")
    assert responses["message"].startswith("This model's maximum context length is 64 tokens")

    message = await _anthropic_message(client, _messages([{"role": "user", "content": LONG}]))
    assert message.startswith("messages: This model's maximum context length is 64 tokens")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_constraint_the_decoder_gives_up_on(
    client: httpx.AsyncClient,
    engine: FakeEngine,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """The engine blames the constraint by its source (chat's field); each surface words the error
    with its own name for that field, refused or in-band once streaming."""

    generate = engine.generate

    async def give_up(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        if stream:  # one output first: the 200 is sent, the error comes in-band
            async for output in generate(*args, **kwargs):
                yield output
                break
        raise ConstraintError("too many states", "response_format.json_schema.schema")

    monkeypatch.setattr(engine, "generate", give_up)
    schema = {"type": "object"}
    expected = {
        "/v1/chat/completions": "response_format.json_schema.schema",
        "/v1/responses": "text.format",
        "/v1/messages": "output_config.format",
    }
    bodies = {
        "/v1/chat/completions": _chat(
            [{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}},
        ),
        "/v1/responses": _responses(
            "hi", text={"format": {"type": "json_schema", "name": "o", "schema": schema}}
        ),
        "/v1/messages": _messages(
            [{"role": "user", "content": "hi"}],
            output_config={"format": {"type": "json_schema", "schema": schema}},
        ),
    }
    for path, body in bodies.items():
        r = await client.post(path, json={**body, "stream": stream})
        name = expected[path]
        want = f"the constrained decoder cannot follow {name}: too many states"
        if stream:
            assert r.status_code == 200 and want in r.text, (path, r.text)
            assert "response_format" not in r.text or path == "/v1/chat/completions"
        else:
            assert r.status_code == 400, (path, r.text)
            body_json = r.json()
            if path == "/v1/messages":
                assert body_json["error"]["message"] == want
            else:
                assert (body_json["error"]["param"], body_json["error"]["message"]) == (name, want)
