"""The Responses and Messages APIs over a fake engine: shapes checked with the official SDKs' types, event
sequences, the response store, the typed turn each request is parsed into, and errors in each API's
envelope."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types as anthropic_types
import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engine import CompletionOutput
from server.field_map import FieldMap
from server.protocol_messages import MessagesRequest
from server.protocol_responses import ResponsesRequest
from server.serving_messages import chat_messages, content_blocks, messages_turn, stop_reason
from server.serving_responses import input_messages, output_items, responses_turn
from server.turn import ToolCall, Turn, TurnEnd, final_turn
from server.turn_request import NamedTool, ToolSpec, TurnMessage
from tests.unit.server_fakes import FakeEngine, app_client

OPENAI_EVENT = TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENT = TypeAdapter(anthropic_types.RawMessageStreamEvent)


def _events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """SSE body -> (event name, data) pairs; every frame must have both lines."""
    assert body.endswith("\n\n")
    out = []
    for frame in body[:-2].split("\n\n"):
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == event[len("event: ") :]
        out.append((payload["type"], payload))
    return out


def _prompt(engine: FakeEngine, index: int = -1) -> str:
    return bytes(engine.requests[index][1]).decode()


def _openai_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    return err


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == kind
    return str(body["error"]["message"])


# ----------------------------------------------------------------------------------------- responses


async def test_response_shape_text_and_usage(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.script, engine.script_stop = "Hello!", 0
    r = await client.post("/v1/responses", json={"input": "abc", "instructions": "Be brief."})
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == "Hello!" and response.incomplete_details is None
    assert [item.type for item in response.output] == ["message"]
    assert response.instructions == "Be brief." and response.store is not False
    assert _prompt(engine) == "<system>Be brief.<user>abc<assistant>"
    usage = response.usage
    assert usage is not None and usage.output_tokens == 6
    assert usage.input_tokens == len(engine.requests[-1][1])
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0


async def test_max_output_tokens_makes_an_incomplete_response(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json={"input": "abc", "max_output_tokens": 3})
    response = Response.model_validate(r.json())
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3


async def test_sampling_fields_reach_the_engine(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"input": "abc", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3}
    r = await client.post("/v1/responses", json=body | {"max_output_tokens": 2})
    assert r.status_code == 200, r.text
    params = engine.requests[-1][2]
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 7, 3)
    assert params.max_tokens == 2


async def test_input_items_become_the_chat_conversation(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Yo", "annotations": []},
                {"type": "output_text", "text": ""},  # an empty part is still a part
                {"type": "refusal", "refusal": "No."},
            ],
        },
        {"role": "user", "content": "Again"},
    ]
    r = await client.post("/v1/responses", json={"input": items, "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    assert _prompt(engine) == "<system>Rules.<user>Hi<assistant>Yo\n\nNo.<user>Again<assistant>"


async def test_previous_response_id_continues_without_old_instructions(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.script, engine.script_stop = "One.", 0
    engine.max_model_len = 256
    first = await client.post("/v1/responses", json={"input": "abc", "instructions": "Old."})
    engine.script = "Two."
    second = await client.post(
        "/v1/responses",
        json={"input": "more", "instructions": "New.", "previous_response_id": first.json()["id"]},
    )
    assert second.status_code == 200, second.text
    assert Response.model_validate(second.json()).previous_response_id == first.json()["id"]
    assert _prompt(engine) == "<system>New.<user>abc<assistant>One.<user>more<assistant>"
    third = await client.post(
        "/v1/responses", json={"input": "end", "previous_response_id": second.json()["id"]}
    )
    assert third.status_code == 200
    assert (
        _prompt(engine) == "<user>abc<assistant>One.<user>more<assistant>Two.<user>end<assistant>"
    )


async def test_retrieve_delete_and_unknown_ids(client: httpx.AsyncClient) -> None:
    created = (await client.post("/v1/responses", json={"input": "abc"})).json()
    got = await client.get(f"/v1/responses/{created['id']}")
    assert got.status_code == 200 and got.json() == created
    deleted = await client.delete(f"/v1/responses/{created['id']}")
    assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
    err = _openai_error(await client.get(f"/v1/responses/{created['id']}"), 404, None)
    assert created["id"] in err["message"]
    _openai_error(await client.delete(f"/v1/responses/{created['id']}"), 404, None)
    r = await client.post(
        "/v1/responses", json={"input": "x", "previous_response_id": created["id"]}
    )
    err = _openai_error(r, 404, "previous_response_id")
    assert err["code"] == "previous_response_not_found"


async def test_store_false_keeps_nothing(client: httpx.AsyncClient) -> None:
    created = (await client.post("/v1/responses", json={"input": "abc", "store": False})).json()
    assert created["store"] is False
    _openai_error(await client.get(f"/v1/responses/{created['id']}"), 404, None)


async def test_the_store_evicts_the_least_recently_used(engine: FakeEngine) -> None:
    async with app_client(engine, responses_store_size=2) as client:
        ids = []
        for text in ("a", "b"):
            ids.append((await client.post("/v1/responses", json={"input": text})).json()["id"])
        assert (await client.get(f"/v1/responses/{ids[0]}")).status_code == 200  # a use
        ids.append((await client.post("/v1/responses", json={"input": "c"})).json()["id"])
        status = [(await client.get(f"/v1/responses/{i}")).status_code for i in ids]
        assert status == [200, 404, 200]
    async with app_client(engine, responses_store_size=0) as client:
        created = (await client.post("/v1/responses", json={"input": "a"})).json()
        assert (await client.get(f"/v1/responses/{created['id']}")).status_code == 404


async def test_streamed_events_in_order_and_typed(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.script, engine.script_stop = "Hey you", 0
    r = await client.post("/v1/responses", json={"input": "abc", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    for _, data in events:
        OPENAI_EVENT.validate_python(data)
    kinds = [kind for kind, _ in events]
    deltas = len(engine.script)
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    final = Response.model_validate(events[-1][1]["response"])
    assert text == final.output_text == "Hey you" == events[-4][1]["text"]
    assert final.status == "completed" and final.usage is not None
    assert events[0][1]["response"]["status"] == "in_progress"
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id for k, d in events if "delta" in k)
    stored = await client.get(f"/v1/responses/{final.id}")
    assert stored.json() == events[-1][1]["response"]


async def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/responses", json={"input": "abc", "stream": True, "max_output_tokens": 2}
    )
    events = _events(r.text)
    assert events[-1][0] == "response.incomplete"
    final = Response.model_validate(events[-1][1]["response"])
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert events[-2][1]["item"]["status"] == "incomplete"


async def test_an_engine_failure_mid_stream_is_an_error_event(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail_after = 2
    r = await client.post("/v1/responses", json={"input": "abc", "stream": True})
    events = _events(r.text)
    assert events[-1][0] == "error" and events[-1][1]["message"]
    OPENAI_EVENT.validate_python(events[-1][1])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "abc", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "file_search_call", "queries": []}]}, "input[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        (  # a nested union (string or parts) names the part that is wrong
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0]"),
        ({"input": "abc", "text": {"format": {"type": {"a": 1}}}}, "text.format"),
        ({"input": "abc", "temperature": 3}, "temperature"),
        ({"input": "abc", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "abc", "reasoning": {"encrypted": True}}, "reasoning.encrypted"),
        ({"input": "abc", "bogus": 1}, "bogus"),
        ({"input": "abc", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "x" * 80}, "input"),  # over the fake model's 64 tokens
        ({"input": "abc", "model": "other"}, "model"),
    ],
)
async def test_bad_responses_requests_name_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/responses", json=body)
    err = _openai_error(r, 404 if param == "model" else 400, param)  # the full path
    assert param in err["message"] or param in ("model", "input")  # input: OpenAI's length wording


async def test_a_full_queue_is_429(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.queue_full = True
    r = await client.post("/v1/responses", json={"input": "abc"})
    assert _openai_error(r, 429, None)["type"] == "rate_limit_error"


def test_function_call_items_translate_to_chat_tool_messages() -> None:
    req = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            ],
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "get"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        }
    )
    messages, sources = input_messages(req.input)
    assert sources == ["input[0]", "input[1]", "input[3]", "input[4]"]
    calls = (ToolCall("c1", "get", "{}"), ToolCall("c2", "get", '{"a":1}'))
    assert messages[1] == TurnMessage("assistant", "", tool_calls=calls)
    assert messages[2:] == [
        TurnMessage("tool", "sunny", tool_call_id="c1"),
        TurnMessage("tool", "rain", tool_call_id="c2"),
    ]
    turn = responses_turn(req, messages, FieldMap("input", {"response_format": "text.format"}))
    assert turn.tools == [ToolSpec("get", None, {"type": "object"})]
    assert turn.tool_choice == NamedTool("get")
    assert turn.parallel_tool_calls is False
    assert turn.constraint is not None and json.loads(turn.constraint.json or "") == {
        "type": "object"
    }


def test_a_turn_with_tool_calls_is_function_call_items() -> None:
    turn = Turn("", [ToolCall("call_1", "get", '{"city":"Paris"}')], TurnEnd.TOOL_CALLS)
    items = output_items(turn)
    assert [(i["type"], i.get("call_id"), i.get("arguments")) for i in items] == [
        ("function_call", "call_1", '{"city":"Paris"}')
    ]
    blocks = content_blocks(turn)
    assert blocks == [
        {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Paris"}}
    ]  # Anthropic's spelling of an id
    assert stop_reason(turn) == "tool_use"


def test_a_tool_call_cut_off_by_max_tokens_keeps_its_partial_arguments() -> None:
    calls = [
        ToolCall("c1", "get", '{"n": 2, "tags": ["a", "b'),
        ToolCall("c2", "get", '{"city": "Par'),
        ToolCall("c3", "put", ""),
    ]
    turn = Turn("", calls, TurnEnd.LENGTH)
    items = output_items(turn)
    assert [i["arguments"] for i in items] == [c.arguments for c in calls]
    # Only the item the cut fell in is incomplete, as in the stream.
    assert [i["status"] for i in items] == ["completed", "completed", "incomplete"]
    blocks = content_blocks(turn)
    # What the anthropic SDK's stream accumulator makes of the same deltas (jiter partial mode).
    from jiter import from_json

    assert [b["input"] for b in blocks] == [{"n": 2, "tags": ["a"]}, {}, {}]
    assert [b["input"] for b in blocks[:2]] == [
        from_json(c.arguments.encode(), partial_mode=True) for c in calls[:2]
    ]
    assert stop_reason(turn) == "max_tokens"


# ------------------------------------------------------------------------------------------ messages


async def test_message_shape_and_usage(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.script, engine.script_stop = "Sure.", 0
    body = {
        "model": "fake-model",
        "max_tokens": 16,
        "system": [{"type": "text", "text": "Be kind."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }
    r = await client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    message = anthropic_types.Message.model_validate(r.json())
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Sure."  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert _prompt(engine) == "<system>Be kind.<user>Hi<assistant>"
    assert message.usage.input_tokens == len(engine.requests[-1][1])
    assert message.usage.output_tokens == 5 and message.usage.cache_read_input_tokens == 0
    count = await client.post("/v1/messages/count_tokens", json=body | {"max_tokens": None})
    assert count.status_code == 400  # count_tokens takes no max_tokens
    del body["max_tokens"]
    count = await client.post("/v1/messages/count_tokens", json=body)
    assert anthropic_types.MessageTokensCount.model_validate(count.json()).input_tokens == (
        message.usage.input_tokens
    )


async def test_response_blocks_dumped_by_the_sdk_replay_as_history(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.script, engine.script_stop = "Done.", 0
    engine.max_model_len = 1024  # one token a byte: tool history renders long
    said = [  # a reply as the anthropic SDK parses it, dumped back into the conversation
        anthropic_types.TextBlock(type="text", text="Checking."),
        anthropic_types.ToolUseBlock(type="tool_use", id="t1", name="get", input={"c": "P"}),
    ]
    body = {
        "max_tokens": 8,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [b.model_dump() for b in said]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
            },
        ],
    }
    assert "caller" in body["messages"][1]["content"][1]  # type: ignore[index]
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    other = {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}  # a server tool's call
    body["messages"][1]["content"][1]["caller"] = other  # type: ignore[index]
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error"


async def test_max_tokens_and_stop_sequences(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    r = await client.post("/v1/messages", json=body | {"stop_sequences": ["END"], "top_k": 5})
    message = anthropic_types.Message.model_validate(r.json())
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    params = engine.requests[-1][2]
    assert params.stop == ["END"] and params.top_k == 5 and params.max_tokens == 3
    engine.script, engine.script_stop = "ab", "END"
    r = await client.post("/v1/messages", json=body | {"max_tokens": 10})
    message = anthropic_types.Message.model_validate(r.json())
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"


async def test_streamed_message_events(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.script, engine.script_stop = "Hi there", 0
    body = {"max_tokens": 32, "messages": [{"role": "user", "content": "Hello"}]}
    r = await client.post("/v1/messages", json=body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * len(engine.script),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for kind, data in events:
        if kind != "ping":
            ANTHROPIC_EVENT.validate_python(data)
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    whole = anthropic_types.Message.model_validate(
        (await client.post("/v1/messages", json=body)).json()
    )
    assert text == "Hi there" == whole.content[0].text  # type: ignore[union-attr]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens


async def test_an_engine_failure_mid_stream_is_an_anthropic_error_event(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail_after = 2
    body = {"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    events = _events((await client.post("/v1/messages", json=body)).text)
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error" and events[-1][1]["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        (  # an unhashable type is a 400, not a crash
            {
                "max_tokens": 5,
                "tool_choice": {"type": {}},
                "messages": [{"role": "user", "content": "H"}],
            },
            "tool_choice",
        ),
        (
            {"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "H"}]},
            "temperature",
        ),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, "messages[0]"),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "messages[0].content",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Well"},
                ],
            },
            "messages[1]",
        ),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 80}]}, "messages"),
        (
            {
                "max_tokens": 5,
                "thinking": {"type": "sometimes"},
                "messages": [{"role": "user", "content": "Hi"}],
            },
            "thinking.type",
        ),
        (
            {
                "max_tokens": 5,
                "tools": [{"name": "f", "input_schema": {"type": "string"}}],
                "messages": [{"role": "user", "content": "Hi"}],
            },
            "tools[0].input_schema",
        ),
    ],
)
async def test_bad_messages_requests_are_anthropic_400s_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    message = _anthropic_error(
        await client.post("/v1/messages", json=body), 400, "invalid_request_error"
    )
    assert field in message


async def test_anthropic_envelope_for_other_statuses(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}
    r = await client.post("/v1/messages", json=body | {"model": "other"})
    assert "other" in _anthropic_error(r, 404, "not_found_error")
    _anthropic_error(await client.post("/v1/messages/nope", json=body), 404, "not_found_error")
    r = await client.post(
        "/v1/messages", content=b"{", headers={"content-type": "application/json"}
    )
    _anthropic_error(r, 400, "invalid_request_error")
    engine.queue_full = True
    _anthropic_error(await client.post("/v1/messages", json=body), 429, "rate_limit_error")


async def test_x_api_key_is_accepted(engine: FakeEngine) -> None:
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with app_client(engine, api_key="sekret") as client:
        ok = await client.post("/v1/messages", json=body, headers={"x-api-key": "sekret"})
        assert ok.status_code == 200, ok.text
        bad = await client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        _anthropic_error(bad, 401, "authentication_error")
        r = await client.post("/v1/responses", json={"input": "a"}, headers={"x-api-key": "no"})
        _openai_error(r, 401, None)
        r = await client.post(
            "/v1/responses", json={"input": "a"}, headers={"Authorization": "Bearer sekret"}
        )
        assert r.status_code == 200


def test_tool_blocks_translate_to_chat_tool_messages() -> None:
    req = MessagesRequest.model_validate(
        {
            "max_tokens": 5,
            "system": "S",
            "tools": [{"name": "get", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "get", "input": {"c": "P"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                        {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ],
        }
    )
    messages, sources = chat_messages(req)
    assert sources == [
        "system",
        "messages[0]",
        "messages[1]",
        "messages[2].content[0]",  # the tool_result block
        "messages[2]",
    ]
    call = ToolCall("t1", "get", '{"c": "P"}')
    assert messages[2] == TurnMessage("assistant", ("Checking.",), tool_calls=(call,))
    assert messages[3:] == [
        TurnMessage("tool", "sunny", tool_call_id="t1"),
        TurnMessage("user", ("Thanks",)),
    ]
    turn = messages_turn(req, messages, FieldMap("messages"))
    assert turn.tools == [ToolSpec("get", "d", {"type": "object"})]
    assert turn.tool_choice == "required" and turn.parallel_tool_calls is False


def test_stop_reasons_from_engine_finishes() -> None:
    def turn(finish: str, stop: str | int | None) -> Turn:
        return final_turn(
            CompletionOutput(0, "x", [1], finish_reason=finish, stop_reason=stop)  # type: ignore[arg-type]
        )

    assert stop_reason(turn("stop", None)) == "end_turn"
    assert stop_reason(turn("stop", 2)) == "end_turn"  # a stop token is the end of the turn
    assert stop_reason(turn("stop", "\n\n")) == "stop_sequence"
    assert stop_reason(turn("length", None)) == "max_tokens"


def test_field_names_follow_each_surface_tool_shape() -> None:
    from server.field_map import FieldMap

    messages = FieldMap("messages", {}, ("messages[0]",), {"parameters": "input_schema"})
    assert messages.name("tools[1].function.parameters") == "tools[1].input_schema"
    assert messages.name("tools[0].function.parameters.properties") == (
        "tools[0].input_schema.properties"
    )
    assert messages.name("tools[0].function.name") == "tools[0].name"
    assert messages.name("tools[0].function") == "tools[0]"
    responses = FieldMap("input", {}, (), {})
    assert responses.name("tools[2].function.parameters") == "tools[2].parameters"
    chat = FieldMap()
    assert chat.name("tools[2].function.parameters") == "tools[2].function.parameters"


async def test_a_bad_tool_schema_names_the_messages_field(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [
            {"name": "get", "input_schema": {"type": "object", "properties": {"a": {"type": 7}}}}
        ],
    }
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "tools[0].input_schema" in r.json()["error"]["message"], r.text
    assert "function" not in r.json()["error"]["message"], r.text
