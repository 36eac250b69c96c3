"""Tool round trips through the Responses API (`openai` SDK) and the Messages API (`anthropic` SDK) on the
real bundled model: calls forced by tool_choice, arguments valid for their schema, streamed calls equal
to whole ones and to chat completions' calls, and the tool's result sent back for the next turn."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from anthropic.types import Message, ToolUseBlock
from openai.types.responses import Response, ResponseFunctionToolCall
from pydantic import BaseModel, ConfigDict, Field

from tests.e2e.conftest import ServerProcess

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
DESCRIPTION = "Get the current weather in a city"
QUESTION = "What is the weather in Paris right now?"
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": DESCRIPTION,
        "parameters": WEATHER_SCHEMA,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": DESCRIPTION,
            "parameters": WEATHER_SCHEMA,
        },
    }
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER_SCHEMA}
]
TOOL_RESULT = '{"temperature": 21, "sky": "clear"}'


@pytest.fixture(scope="module")
def client(smol_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(smol_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol_server.url, api_key="unused", max_retries=0)


def _calls(response: Response) -> list[ResponseFunctionToolCall]:
    calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    return calls


def test_responses_function_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="smol",
        input=QUESTION,
        tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_output_tokens=120,
        temperature=0,
    )
    Response.model_validate(first.model_dump())
    calls = _calls(first)
    assert len(calls) >= 1 and first.status == "completed"
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    chat_calls = chat.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in chat_calls] == [  # type: ignore[union-attr]
        (c.name, c.arguments) for c in calls
    ]
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": TOOL_RESULT} for c in calls
    ]
    # Stateful: continue the stored response with the tool's result.
    second = client.responses.create(
        model="smol",
        previous_response_id=first.id,
        input=outputs,  # type: ignore[arg-type]
        tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        max_output_tokens=40,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete")
    assert second.output_text or _calls(second)
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    # Stateless: the same history sent as items gives the same turn.
    history: list[Any] = [
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],
        *outputs,
    ]
    stateless = client.responses.create(
        model="smol",
        input=history,
        tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
        max_output_tokens=40,
        temperature=0,
        store=False,
    )
    assert stateless.output_text == second.output_text


def test_streamed_function_call_equals_the_whole_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "smol",
        "input": QUESTION,
        "tools": RESPONSES_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 120,
        "temperature": 0,
    }
    whole = _calls(client.responses.create(**kwargs))
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] * len(whole)
    arguments: dict[str, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments[e.item_id] = arguments.get(e.item_id, "") + e.delta
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [arguments[e.item_id] for e in done] == [e.arguments for e in done]
    final = _calls(events[-1].response)  # type: ignore[union-attr]
    assert [(c.name, c.arguments) for c in final] == [(c.name, c.arguments) for c in whole]


def _tool_uses(message: Message) -> list[ToolUseBlock]:
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    for use in uses:
        assert use.name == "get_weather" and use.id
        jsonschema.validate(use.input, WEATHER_SCHEMA)
    return uses


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": "smol",
        "max_tokens": 120,
        "tools": ANTHROPIC_TOOLS,
        "extra_body": {"temperature": 0},
    }
    question = [{"role": "user", "content": QUESTION}]
    first = claude.messages.create(messages=question, tool_choice={"type": "any"}, **kwargs)
    Message.model_validate(first.model_dump())
    uses = _tool_uses(first)
    assert uses and first.stop_reason == "tool_use"
    results = [
        {"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT} for use in uses
    ]
    history = [
        *question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": results},
    ]
    second = claude.messages.create(messages=history, **kwargs | {"max_tokens": 40})
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.content
    assert (second.usage.cache_read_input_tokens or 0) > 0  # the first turn's prompt is cached


def test_anthropic_streamed_tool_use_equals_the_whole(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": "smol",
        "max_tokens": 120,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": QUESTION}],
        "extra_body": {"temperature": 0},
    }
    whole = _tool_uses(claude.messages.create(**kwargs))
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    streamed = _tool_uses(final)
    assert [(u.name, u.input) for u in streamed] == [(u.name, u.input) for u in whole]
    assert final.stop_reason == "tool_use"
    with_tools = claude.messages.count_tokens(
        model="smol",
        tools=ANTHROPIC_TOOLS,
        messages=kwargs["messages"],  # type: ignore[arg-type]
    )
    without = claude.messages.count_tokens(model="smol", messages=kwargs["messages"])
    assert with_tools.input_tokens > without.input_tokens


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas say
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=50_000_000)


def test_responses_parse_with_a_pydantic_text_format(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model="smol",
        input="Describe Paris as a city record.",
        text_format=City,
        max_output_tokens=120,
    )
    assert isinstance(parsed.output_parsed, City)
    assert City.model_validate_json(parsed.output_text) == parsed.output_parsed
    obj = client.responses.create(
        model="smol",
        input="Describe Paris in JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
    )
    assert isinstance(json.loads(obj.output_text), dict)


def test_anthropic_output_config_json_schema(claude: anthropic.Anthropic) -> None:
    schema = City.model_json_schema()
    message = claude.messages.create(
        model="smol",
        max_tokens=120,
        messages=[{"role": "user", "content": "Describe Paris as a city record."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    text = "".join(b.text for b in message.content if b.type == "text")  # type: ignore[union-attr]
    City.model_validate_json(text)
