"""Structured outputs and tool calling on the real bundled model (SmolLM2-135M) through a server
process, driven with the openai SDK the way LangChain, instructor and the SDK's parse() call it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.conftest import ServerProcess

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, ADD_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(smol_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas say
    # Bounds keep a 135M model from looping on digits or words until max_tokens (the constraint
    # allows any valid value; the model picks them).
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=50_000_000)


def _check_calls(message, allowed: set[str]) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "Describe the city of Lyon."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


def test_json_object_parses(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"},
        max_tokens=400,
        temperature=0.7,
        seed=3,
    )
    # A finished object parses; a length cut-off is the only other ending allowed.
    if chat.choices[0].finish_reason == "length":
        assert (chat.choices[0].message.content or "").startswith("{")
    else:
        assert chat.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)


def test_choice_and_regex(client: openai.OpenAI) -> None:
    colors = ["red", "green", "blue"]
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Pick a color."}],
        extra_body={"structured_outputs": {"choice": colors}},
        max_tokens=10,
        n=3,
        temperature=1.0,
    )
    assert all(c.message.content in colors for c in chat.choices)
    assert all(c.finish_reason == "stop" for c in chat.choices)
    pattern = r"[A-Z]{3}-[0-9]{4}"
    completion = client.completions.create(
        model="smol",
        prompt="A license plate:",
        extra_body={"structured_outputs": {"regex": pattern}},
        max_tokens=20,
    )
    assert re.fullmatch(pattern, completion.choices[0].text)


def test_streamed_schema_output_equals_non_streamed(client: openai.OpenAI) -> None:
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Describe Rome."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": City.model_json_schema()},
        },
        "max_tokens": 80,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**body)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**body, stream=True)
        if c.choices
    )
    assert text == whole.choices[0].message.content
    City.model_validate_json(text)


def test_tool_choice_required_calls_a_tool_with_valid_arguments(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smol", messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _check_calls(choice.message, {"get_weather", "add"})


def test_named_tool_choice_and_parallel_false(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is 2 plus 40?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0.9,
        seed=11,
    )
    message = chat.choices[0].message
    assert len(message.tool_calls or []) == 1
    _check_calls(message, {"add"})


def test_auto_answers_in_text_or_a_valid_call(client: openai.OpenAI) -> None:
    for question in ("Say hello to me.", "What is the weather in Oslo?"):
        chat = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,
            max_tokens=60,
            temperature=0,
        )
        message = chat.choices[0].message
        if message.tool_calls:
            _check_calls(message, {"get_weather", "add"})
            assert chat.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content


def test_streamed_tool_call_deltas_join_to_the_non_streamed_call(client: openai.OpenAI) -> None:
    body = dict(
        model="smol",
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    whole = client.chat.completions.create(**body)  # type: ignore[call-overload]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):  # type: ignore[call-overload]
        assert isinstance(chunk, ChatCompletionChunk)
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not (delta.content and delta.tool_calls)
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call has its id, type and name
                assert tc.id and tc.type == "function" and tc.function and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None
            calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.choices[0].message.tool_calls or []
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert finish == "tool_calls"


def test_multi_turn_with_a_tool_message(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="smol",
        messages=WEATHER_QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_tokens=120,
    )
    message = first.choices[0].message
    call = (message.tool_calls or [])[0]
    history = [
        *WEATHER_QUESTION,
        message.model_dump(exclude_none=True),  # the assistant turn as LangChain sends it back
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model="smol", messages=history, tools=[WEATHER_TOOL], max_tokens=40, temperature=0
    )
    assert isinstance(second, ChatCompletion)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 5}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"grammar": "start: undefined_rule"}},
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": TOOLS,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}},
                },
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "call_x", "content": "1"},
                ]
            },
            "messages[1].tool_call_id",
        ),
        ({"messages": [{"role": "tool", "content": "1"}]}, "messages[0]"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    smol_server: ServerProcess, extra: dict, param: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = httpx.post(smol_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert smol_server.stats()["num_unfinished_requests"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_regex_past_the_decoders_limits_is_a_400_or_an_error_event(
    smol_server: ServerProcess, path: str
) -> None:
    # It compiles, then llguidance's lexer gives up a few tokens in ("too many expressions"):
    # a 400 naming the field, an error event once streaming, never a 500 or an empty "stop".
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^a{99999999}$"}},
        "required": ["a"],
    }
    if path == "/v1/messages":
        body: dict = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        }
    else:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20,
            "structured_outputs": {"regex": "a{99999999}"},
        }
    r = httpx.post(smol_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "constrained decoder" in error["message"]
    with httpx.stream(
        "POST", smol_server.url + path, json=body | {"stream": True}, timeout=60
    ) as s:
        text = "".join(s.iter_text())
    assert s.status_code in (200, 400) and "constrained decoder" in text, text
    assert smol_server.stats()["num_unfinished_requests"] == 0
