"""response_format (chat) and text.format (Responses) together with tools, on the real bundled model through
the `openai` SDK: under tool_choice "auto" the model either calls a tool (valid arguments, finish_reason
"tool_calls") or answers in JSON that validates against the schema; the tool's result sent back gets a
schema answer; bad combinations are 400s in the OpenAI envelope."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseFunctionToolCall

from tests.e2e.conftest import ServerProcess
from tests.e2e.test_agent_tools import CHAT_TOOLS, RESPONSES_TOOLS, TOOL_RESULT, WEATHER_SCHEMA

# Bounds keep a 135M model from looping on digits or words until max_tokens.
REPORT = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "temperature": {"type": "integer", "minimum": -60, "maximum": 60},
        "sky": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "temperature", "sky"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "weather_report", "schema": REPORT, "strict": True},
}
TEXT_FORMAT: Any = {
    "format": {"type": "json_schema", "name": "weather_report", "schema": REPORT, "strict": True}
}
# At temperature 0 the model calls the tool for the first and answers the second itself.
CALLING = [{"role": "user", "content": "What is the weather in Oslo?"}]
ANSWERING = [{"role": "user", "content": "Convert to JSON: city Paris, temperature 21, sky clear."}]


@pytest.fixture(scope="module")
def client(smol_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, messages: list[Any], **extra: Any) -> ChatCompletion:
    return client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=CHAT_TOOLS,
        response_format=RESPONSE_FORMAT,
        max_tokens=120,
        temperature=0,
        **extra,
    )


def _valid_reply(chat: ChatCompletion) -> dict[str, Any] | None:
    """The schema answer of a reply (None when it called tools, whose arguments must validate)."""
    choice = chat.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)  # type: ignore[union-attr]
        return None
    assert choice.finish_reason == "stop", choice
    answer = json.loads(choice.message.content or "")
    jsonschema.validate(answer, REPORT)
    return answer


def test_auto_calls_the_tool_and_the_tool_result_gets_a_schema_answer(
    client: openai.OpenAI,
) -> None:
    first = _chat(client, CALLING)
    assert _valid_reply(first) is None  # a call
    message = first.choices[0].message
    call = (message.tool_calls or [])[0]
    history = [
        *CALLING,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    _valid_reply(_chat(client, history))  # auto: another call or the answer, either one valid
    final = _chat(client, history, tool_choice="none")
    answer = _valid_reply(final)
    assert answer is not None and final.choices[0].message.tool_calls is None


def test_auto_answers_in_schema_json_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = _chat(client, ANSWERING)
    answer = _valid_reply(whole)
    assert answer is not None and answer["city"] == "Paris"
    chunks = list(
        client.chat.completions.create(
            model="smol",
            messages=ANSWERING,  # type: ignore[arg-type]
            tools=CHAT_TOOLS,
            response_format=RESPONSE_FORMAT,
            max_tokens=120,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert all(not d.tool_calls for d in deltas)
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_required_with_a_format_only_calls(client: openai.OpenAI) -> None:
    chat = _chat(client, ANSWERING, tool_choice="required")
    assert _valid_reply(chat) is None


def test_responses_text_format_with_tools_both_branches(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "smol",
        "tools": RESPONSES_TOOLS,
        "text": TEXT_FORMAT,
        "max_output_tokens": 120,
        "temperature": 0,
    }
    first = client.responses.create(input=CALLING, **kwargs)
    Response.model_validate(first.model_dump(by_alias=True))  # the SDK's type, strictly
    calls = [i for i in first.output if isinstance(i, ResponseFunctionToolCall)]
    assert calls and first.output_text == ""
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": TOOL_RESULT} for c in calls
    ]
    second = client.responses.create(
        previous_response_id=first.id, input=outputs, tool_choice="none", **kwargs
    )
    assert second.status == "completed"
    jsonschema.validate(json.loads(second.output_text), REPORT)
    assert second.text.format.type == "json_schema"  # type: ignore[union-attr]
    answered = client.responses.create(input=ANSWERING, **kwargs)
    assert answered.status == "completed"
    assert not [i for i in answered.output if isinstance(i, ResponseFunctionToolCall)]
    jsonschema.validate(json.loads(answered.output_text), REPORT)


LOOKAHEAD = {"type": "string", "pattern": "(?=a)"}  # valid JSON schema, not a regular language


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": LOOKAHEAD},
                },
                "tools": CHAT_TOOLS,
            },
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": RESPONSE_FORMAT,
                "structured_outputs": {"regex": "a+"},
                "tools": CHAT_TOOLS,
            },
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": RESPONSE_FORMAT,
                "tools": CHAT_TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        (
            "/v1/responses",
            {
                "text": {"format": {"type": "json_schema", "name": "x", "schema": LOOKAHEAD}},
                "tools": RESPONSES_TOOLS,
            },
            "text.format",
        ),
    ],
)
def test_bad_combinations_are_400s(
    smol_server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    key = "input" if path == "/v1/responses" else "messages"
    payload = {key: [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    if key == "input":
        payload["max_output_tokens"] = payload.pop("max_tokens")
    r = httpx.post(smol_server.url + path, json=payload, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error
    assert smol_server.stats()["num_unfinished_requests"] == 0
