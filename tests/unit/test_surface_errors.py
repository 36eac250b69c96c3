"""The same invalid input sent to chat completions, Responses and Messages: each error names the
surface's own field, in `param` and in the message alike (never chat's name for it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine import ConstraintError
from server.field_map import FieldMap
from tests.unit.server_fakes import FakeEngine

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": 7}}}
LONG = "x" * 100  # the fake engine's model holds 64 tokens, one per byte
USER = {"role": "user", "content": "hi"}


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
    assert responses["param"] == "input[1].call_id"
    assert responses["message"] == (
        "input[1] is a function_call_output item whose call_id 'nope' matches no earlier "
        "function_call item"
    )

    # Messages: the text and the tool_result of one user message are two chat messages; the error
    # names the Messages block, messages[0].content[1], in Anthropic's terms.
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
    assert message == (
        "messages[0].content[1].tool_use_id: this tool_result block answers 'nope', but no "
        "earlier tool_use block has that id"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "user", "content": [{"type": "weird"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "weird"}]}, "input[0]"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
        ),
        (
            {
                "input": "hi",
                "text": {
                    "format": {"type": "json_schema", "name": "o", "schema": {}, "strict": "yes"}
                },
            },
            "text.format.strict",
        ),
    ],
)
async def test_responses_params_are_full_paths(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    error = await _openai_error(client, "/v1/responses", {"model": "fake-model", **body})
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")


async def test_an_image_part_is_named_in_chat_too(client: httpx.AsyncClient) -> None:
    image = {"type": "image_url", "image_url": {"url": "u"}}
    parts = [{"type": "text", "text": "hi"}, image]
    error = await _openai_error(
        client, "/v1/chat/completions", _chat([{"role": "user", "content": parts}])
    )
    assert error["param"] == "messages[0].content[1]"
    assert "'image_url'" in error["message"]


async def test_a_json_schema_format_without_its_object(client: httpx.AsyncClient) -> None:
    error = await _openai_error(
        client, "/v1/chat/completions", _chat([USER], response_format={"type": "json_schema"})
    )
    assert error == {
        "message": "response_format.json_schema: Field required",
        "type": "invalid_request_error",
        "param": "response_format.json_schema",
        "code": None,
    }


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [-1, 0])
async def test_chat_max_tokens_below_one(client: httpx.AsyncClient, field: str, value: int) -> None:
    body = {"model": "fake-model", "messages": [USER], field: value}
    error = await _openai_error(client, "/v1/chat/completions", body)
    assert (error["param"], error["message"]) == (
        field,
        f"{field}: must be at least 1 for chat completions",
    )


async def test_completions_keep_max_tokens_zero(client: httpx.AsyncClient) -> None:
    """vLLM's completions take max_tokens 0 (with echo: the prompt's logprobs alone)."""
    r = await client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 0}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "min_p",
        "repetition_penalty",
    ],
)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_float_sampling_fields_must_be_finite(
    client: httpx.AsyncClient, field: str, value: str
) -> None:
    content = '{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], '
    content += f'"{field}": {value}}}'
    r = await client.post(
        "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["message"]) == (
        field,
        f"{field}: Input should be a finite number",
    )


async def test_messages_max_tokens_over_the_model_names_max_tokens(
    client: httpx.AsyncClient,
) -> None:
    message = await _anthropic_message(client, _messages([USER], max_tokens=1_000_000_000))
    assert message.startswith("max_tokens: This model's maximum context length is 64 tokens")
    # A prompt that alone is over the model is still the prompt's fault.
    message = await _anthropic_message(client, _messages([{"role": "user", "content": LONG}]))
    assert message.startswith("messages: This model's maximum context length")


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


def _template_kwargs_of_messages(body: dict[str, Any]) -> dict[str, Any]:
    from server.protocol_messages import MessagesRequest
    from server.serving_messages import chat_messages, field_map, messages_turn

    req = MessagesRequest.model_validate(body)
    messages, sources = chat_messages(req)
    return dict(messages_turn(req, messages, field_map(sources)).template_kwargs)


def test_messages_effort_reaches_the_template_like_chat_and_responses() -> None:
    from server.protocol import ChatCompletionRequest
    from server.protocol_responses import ResponsesRequest
    from server.serving_chat import chat_turn
    from server.serving_responses import input_messages, responses_turn

    chat = chat_turn(ChatCompletionRequest.model_validate(_chat([USER], reasoning_effort="high")))
    responses_req = ResponsesRequest.model_validate(_responses("hi", reasoning={"effort": "high"}))
    turn = responses_turn(responses_req, input_messages("hi")[0], FieldMap("input"))
    messages = _template_kwargs_of_messages(_messages([USER], output_config={"effort": "high"}))
    assert messages == dict(chat.template_kwargs) == dict(turn.template_kwargs)
    assert messages == {"reasoning_effort": "high"}
    assert _template_kwargs_of_messages(_messages([USER])) == {}


async def test_messages_effort_is_accepted_and_checked(client: httpx.AsyncClient) -> None:
    for effort in ("low", "medium", "high", "xhigh", "max"):
        body = _messages([USER], output_config={"effort": effort})
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
    message = await _anthropic_message(client, _messages([USER], output_config={"effort": "huge"}))
    assert message.startswith("output_config.effort: Input should be 'low'")
