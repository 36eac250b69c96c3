"""The Responses API with the official `openai` SDK and the Messages API with the official `anthropic` SDK,
against a real server on the tiny model: SDK-typed shapes, streams, continuation over the prefix cache,
the response store, greedy parity with chat completions, errors, disconnects and metrics."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response

from tests.e2e.conftest import ServerProcess

SYSTEM = "You answer in one short sentence."
QUESTION = "What is the capital of France, and why is it famous?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(tiny_server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat_text(client: openai.OpenAI, model: str, messages: list[dict[str, str]]) -> str:
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    return chat.choices[0].message.content or ""


# ----------------------------------------------------------------------------------------- responses


def test_response_equals_greedy_chat_and_validates(
    client: openai.OpenAI, model: str, tiny_server: ServerProcess
) -> None:
    response = client.responses.create(
        model=model,
        instructions=SYSTEM,
        input=QUESTION,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    chat = _chat_text(
        client,
        model,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert response.output_text == chat and chat
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    usage = response.usage
    assert usage is not None and 0 < usage.output_tokens <= MAX_TOKENS
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == MAX_TOKENS
    raw = httpx.post(
        tiny_server.url + "/v1/responses",
        json={"input": QUESTION, "instructions": SYSTEM, "max_output_tokens": 4, "store": False},
        timeout=60,
    )
    parsed = Response.model_validate(raw.json())
    assert parsed.status == "incomplete" and parsed.usage is not None
    assert parsed.usage.output_tokens == 4 and parsed.store is False


def test_streamed_response_events_join_to_the_greedy_text(
    client: openai.OpenAI, model: str
) -> None:
    kwargs = {"model": model, "input": QUESTION, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.responses.create(**kwargs)  # type: ignore[call-overload]
    events = list(client.responses.create(stream=True, **kwargs))  # type: ignore[call-overload]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert text == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:  # type: ignore[arg-type]
        helper_events = list(stream)
        # The SDK's helper keeps a final response only for response.completed (as OpenAI's own API,
        # a response cut by max_output_tokens ends with response.incomplete instead).
        if whole.status == "completed":
            assert stream.get_final_response().output_text == whole.output_text
    assert helper_events[-1].type == f"response.{whole.status}"
    assert helper_events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]


def test_previous_response_id_continues_over_the_prefix_cache(
    client: openai.OpenAI, model: str
) -> None:
    first = client.responses.create(
        model=model, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0
    )
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input="Say it again, shorter.",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    chat = _chat_text(
        client,
        model,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Say it again, shorter."},
        ],
    )
    assert second.output_text == chat


def test_retrieve_then_delete(
    client: openai.OpenAI, model: str, tiny_server: ServerProcess
) -> None:
    created = client.responses.create(model=model, input="Hi", max_output_tokens=4)
    retrieved = client.responses.retrieve(created.id)
    assert retrieved.id == created.id and retrieved.output_text == created.output_text
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    r = httpx.get(f"{tiny_server.url}/v1/responses/{created.id}", timeout=10)
    assert r.status_code == 404 and created.id in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="x", previous_response_id=created.id)
    assert info.value.code == "previous_response_not_found"


def test_bad_response_requests_are_400s_naming_the_field(
    client: openai.OpenAI, model: str, tiny_server: ServerProcess
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input="Hi", max_output_tokens=0)
    assert info.value.param == "max_output_tokens"
    r = httpx.post(
        tiny_server.url + "/v1/responses",
        json={"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]"
    assert "input_image" in r.json()["error"]["message"]
    r = httpx.post(tiny_server.url + "/v1/responses", json={"input": "word " * 300}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# ------------------------------------------------------------------------------------------ messages


def test_message_equals_greedy_chat_and_validates(
    claude: anthropic.Anthropic, client: openai.OpenAI, model: str, tiny_server: ServerProcess
) -> None:
    message = claude.messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"temperature": 0},  # this SDK no longer lists sampling parameters
    )
    chat = _chat_text(
        client,
        model,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )
    assert message.type == "message" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat  # type: ignore[union-attr]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= MAX_TOKENS
    raw = httpx.post(
        tiny_server.url + "/v1/messages",
        headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"},
        json={"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=60,
    )
    parsed = Message.model_validate(raw.json())
    assert parsed.stop_reason == "max_tokens" and parsed.usage.output_tokens == 3


def test_message_stream_text_equals_the_whole_message(
    claude: anthropic.Anthropic, model: str
) -> None:
    kwargs = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": QUESTION}],
    }
    whole = claude.messages.create(**kwargs)  # type: ignore[call-overload]
    with claude.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    raw_events = [e.type for e in claude.messages.create(stream=True, **kwargs)]  # type: ignore[call-overload]
    assert raw_events[0] == "message_start" and raw_events[-2:] == ["message_delta", "message_stop"]
    assert raw_events[1] == "content_block_start" and raw_events[-3] == "content_block_stop"


def test_stop_sequences_end_the_message(claude: anthropic.Anthropic, model: str) -> None:
    kwargs = {
        "model": model,
        "max_tokens": 24,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": QUESTION}],
    }
    text = claude.messages.create(**kwargs).content[0].text  # type: ignore[call-overload,union-attr]
    assert len(text) >= 10
    stop = text[6:9]
    stopped = claude.messages.create(stop_sequences=[stop], **kwargs)  # type: ignore[call-overload]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    joined = "".join(block.text for block in stopped.content)  # type: ignore[union-attr]
    assert joined == text[: text.index(stop)]


def test_count_tokens_matches_the_prompt(claude: anthropic.Anthropic, model: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    count = claude.messages.count_tokens(model=model, system=SYSTEM, messages=messages)  # type: ignore[arg-type]
    message = claude.messages.create(
        model=model,
        max_tokens=2,
        system=SYSTEM,
        messages=messages,  # type: ignore[arg-type]
    )
    usage = message.usage
    assert count.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0) > 0


def test_bad_message_requests_are_anthropic_errors(
    claude: anthropic.Anthropic, model: str, tiny_server: ServerProcess
) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=model,
            max_tokens=4,
            messages=[{"role": "user", "content": "a"}],
            extra_body={"temperature": 1.5},
        )
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "temperature" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "a"}]
        )
    r = httpx.post(
        tiny_server.url + "/v1/messages",
        json={"messages": [{"role": "user", "content": "a"}]},
        timeout=10,
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# -------------------------------------------------------------------------------------------- shared


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "Tell me a long story.", "stream": True}),
        (
            "/v1/messages",
            {
                "max_tokens": 200,
                "stream": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}],
            },
        ),
    ],
)
def test_a_disconnect_mid_stream_frees_the_request(
    tiny_server: ServerProcess, path: str, body: dict
) -> None:
    tiny_server.wait_idle()
    body = body | {"temperature": 1.0, "top_k": 50}  # long, varied output; no EOS soon
    if path == "/v1/responses":
        body["max_output_tokens"] = 200
    with httpx.stream("POST", tiny_server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = 0
        for _ in r.iter_lines():
            lines += 1
            if lines >= 12:
                break
    time.sleep(0.2)
    stats = tiny_server.wait_idle(timeout=30)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_metrics_count_both_routes(tiny_server: ServerProcess) -> None:
    text = httpx.get(tiny_server.url + "/metrics", timeout=10).text
    for route in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
        assert f'route="{route}",status="200"' in text, route
    assert 'route="/v1/responses/{response_id}",status="404"' in text
