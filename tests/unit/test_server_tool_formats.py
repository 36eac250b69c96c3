"""A response format together with tools, over a fake engine, on chat completions, Responses and
Messages: the engine gets one grammar of calls or the schema answer (only calls for required/named, only
the schema for none), a scripted call comes back as calls, a scripted answer as text (whole and
streamed), and bad combinations are 400s in each API's envelope."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from engine import SamplingParamsError, StructuredOutputs
from tests.unit.server_fakes import FakeEngine

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "temperature": {"type": "integer"}},
    "required": ["city", "temperature"],
    "additionalProperties": False,
}
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ANSWER = '{"city": "Paris", "temperature": 21}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CHAT = {
    "messages": MESSAGES,
    "max_tokens": 200,
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
}
RESPONSES = {
    "input": MESSAGES,
    "max_output_tokens": 200,
    "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
    "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}},
}
ANTHROPIC = {
    "max_tokens": 200,
    "messages": MESSAGES,
    "tools": [{"name": "get_weather", "input_schema": PARAMETERS}],
    "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
}
SURFACES = {
    "chat": ("/v1/chat/completions", CHAT),
    "responses": ("/v1/responses", RESPONSES),
    "messages": ("/v1/messages", ANTHROPIC),
}


@pytest.fixture
def engine() -> FakeEngine:
    engine = FakeEngine()
    engine.max_model_len = 4096  # the tools' description is a long byte-level prompt
    return engine


def _constraint(engine: FakeEngine) -> StructuredOutputs | None:
    return engine.requests[-1][2].structured_outputs


def _turn(surface: str, body: dict[str, Any]) -> tuple[str, list[tuple[str, Any]], str]:
    """(text, [(function name, arguments)], why it ended) of a non-streamed reply."""
    if surface == "chat":
        choice = ChatCompletion.model_validate(body).choices[0]
        calls = [
            (c.function.name, json.loads(c.function.arguments))  # type: ignore[union-attr]
            for c in choice.message.tool_calls or []
        ]
        return choice.message.content or "", calls, choice.finish_reason
    if surface == "responses":
        response = Response.model_validate(body)
        calls = [
            (i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"
        ]
        return response.output_text, calls, "tool_calls" if calls else response.status
    message = Message.model_validate(body)
    text = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    return text, calls, str(message.stop_reason)


@pytest.mark.parametrize("surface", list(SURFACES))
async def test_auto_with_a_format_answers_in_schema_json_or_calls_a_tool(
    client: httpx.AsyncClient, engine: FakeEngine, surface: str
) -> None:
    path, body = SURFACES[surface]
    engine.script, engine.script_stop = ANSWER, 0
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    constraint = _constraint(engine)
    assert constraint is not None and constraint.grammar is not None
    assert constraint.answer is not None and json.loads(constraint.answer.json or "") == SCHEMA
    text, calls, end = _turn(surface, r.json())
    assert (text, calls) == (ANSWER, [])
    assert end in ("stop", "completed", "end_turn")
    engine.script = CALL
    r = await client.post(path, json=body)
    text, calls, end = _turn(surface, r.json())
    assert (text, calls) == ("", [("get_weather", {"city": "Paris"})])
    assert end in ("tool_calls", "tool_use")


async def test_required_named_and_none_with_a_format(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": choice})
        assert r.status_code == 200, r.text
        constraint = _constraint(engine)
        assert constraint is not None and constraint.grammar is not None
        assert constraint.answer is None and "get_weather" in constraint.grammar
    engine.script, engine.script_stop = ANSWER, 0
    r = await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": "none"})
    constraint = _constraint(engine)
    assert constraint is not None and json.loads(constraint.json or "") == SCHEMA
    assert _turn("chat", r.json()) == (ANSWER, [], "stop")


@pytest.mark.parametrize(("script", "calls"), [(ANSWER, 0), (CALL, 1)])
async def test_streamed_chat_with_a_format_and_tools(
    client: httpx.AsyncClient, engine: FakeEngine, script: str, calls: int
) -> None:
    engine.script, engine.script_stop = script, 0
    async with client.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
    chunks = [ChatCompletionChunk.model_validate_json(line[len("data: ") :]) for line in lines]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    names = [
        tc.function.name
        for c in chunks
        if c.choices
        for tc in c.choices[0].delta.tool_calls or []
        if tc.function is not None and tc.function.name
    ]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    if calls:
        assert (content, names, finish) == ("", ["get_weather"], ["tool_calls"])
    else:
        assert (content, names, finish) == (ANSWER, [], ["stop"])
        assert json.loads(content) == {"city": "Paris", "temperature": 21}


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 5}}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "a"}}, "structured_outputs"),  # two formats at once
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [], "tool_choice": "auto"}, "tools"),
    ],
)
async def test_bad_chat_combinations_are_400s(
    client: httpx.AsyncClient, extra: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/chat/completions", json=CHAT | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param


async def test_bad_responses_and_messages_combinations_are_400s(client: httpx.AsyncClient) -> None:
    bad_format = {"format": {"type": "json_schema", "name": "w", "schema": {"type": 5}}}
    r = await client.post("/v1/responses", json=RESPONSES | {"text": bad_format})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("text.format")
    r = await client.post(
        "/v1/responses", json=RESPONSES | {"tool_choice": {"type": "function", "name": "nope"}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    bad_config = {"format": {"type": "json_schema", "schema": {"type": 5}}}
    r = await client.post("/v1/messages", json=ANTHROPIC | {"output_config": bad_config})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in r.json()["error"]["message"]


async def test_an_engine_error_on_the_format_names_each_apis_own_field(
    client: httpx.AsyncClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine compiles the grammar when the request starts; its error names the chat field,
    which Responses and Messages report under their own names."""

    async def refuse(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise SamplingParamsError("cannot be compiled", "response_format.json_schema.schema")
        yield  # an async generator, like the engine's

    monkeypatch.setattr(engine, "generate", refuse)
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"
    )
    r = await client.post("/v1/responses", json=RESPONSES)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    r = await client.post("/v1/messages", json=ANTHROPIC)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in r.json()["error"]["message"]
