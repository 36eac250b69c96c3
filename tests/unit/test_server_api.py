"""The HTTP layer over a fake engine: response shapes, n/multi-prompt indexing, SSE framing, errors."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from server.app import build_app
from server.state import ServerConfig
from tests.unit.server_fakes import FakeEngine, app_client


def _frames(body: str) -> list[str]:
    assert body.endswith("\n\n")
    frames = body[:-2].split("\n\n")
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[len("data: ") :] for f in frames]


def _assert_error(
    r: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


async def test_completion_text_usage_and_shape(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 3}
    )
    assert r.status_code == 200
    completion = Completion.model_validate(r.json())
    assert completion.choices[0].text == "def"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 3)
    assert completion.id.startswith("cmpl-")


async def test_many_prompts_and_n_index_choices_prompt_major(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": ["abc", "klm"], "n": 2, "max_tokens": 2}
    )
    choices = Completion.model_validate(r.json()).choices
    assert [(c.index, c.text) for c in choices] == [(0, "de"), (1, "ef"), (2, "no"), (3, "op")]


async def test_token_id_prompts(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": [[97, 98], [120]], "max_tokens": 1})
    assert [c["text"] for c in r.json()["choices"]] == ["c", "y"]


async def test_echo_with_prompt_logprobs_and_zero_max_tokens(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}
    )
    # The first prompt token has no logprob: null, as OpenAI sends it (the SDK types say float).
    choice = r.json()["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert choice["logprobs"]["top_logprobs"][0] is None


async def test_legacy_logprobs_list_sampled_token_and_offsets(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logprobs": 2, "echo": True}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][3:] == ["d", "e"]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert lp["top_logprobs"][3] == {"d": -0.5, "e": -1.5}


async def test_completion_stream_framing_and_usage(client: httpx.AsyncClient) -> None:
    body = {
        "prompt": "abc",
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await client.post("/v1/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = _frames(r.text)
    assert frames[-1] == "[DONE]"
    # Completion chunks carry finish_reason null until the end (the SDK's type says non-null).
    chunks = [json.loads(f) for f in frames[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    text = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1 and chunk["usage"] is None
        choice = chunk["choices"][0]
        assert choice["index"] not in finishes, "nothing may follow a choice's finish_reason"
        text[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert text == {0: "def", 1: "efg"}
    assert finishes == {0: "length", 1: "length"}


async def test_chat_and_chat_stream(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    r = await client.post(
        "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2}
    )
    chat = ChatCompletion.model_validate(r.json())
    assert chat.choices[0].message.role == "assistant"
    assert engine.requests[-1][2].max_tokens == 2
    assert chat.usage is not None and chat.usage.prompt_tokens == len(
        "<system>s<user>hi<assistant>"
    )

    body = {
        "messages": messages,
        "max_tokens": 2,
        "stream": True,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    r = await client.post("/v1/chat/completions", json=body)
    frames = _frames(r.text)
    assert frames[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(json.loads(f)) for f in frames[:-1]]
    first_by_index: dict[int, ChatCompletionChunk] = {}
    for chunk in chunks:
        first_by_index.setdefault(chunk.choices[0].index, chunk)
    assert set(first_by_index) == {0, 1}
    assert all(c.choices[0].delta.role == "assistant" for c in first_by_index.values())
    last = [c for c in chunks if c.choices[0].finish_reason]
    assert len(last) == 2
    lps = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert len(lps) == 4 and all(t.bytes and len(t.top_logprobs) == 1 for t in lps)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "temperature": 3}, "temperature"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "a", "suffix": "x"}, "suffix"),
        ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"999": 1}}, "logit_bias"),
        ({"prompt": "a", "stop_token_ids": [300]}, "stop_token_ids"),
        ({"prompt": [300]}, "prompt"),
        ({"prompt": "a", "best_of": 1, "n": 2}, "best_of"),
        ({"prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({}, "prompt"),
    ],
)
async def test_completion_validation_is_400_naming_the_field(
    client: httpx.AsyncClient, body: dict, param: str
) -> None:
    err = _assert_error(await client.post("/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].function.name",
        ),
        ({"tools": []}, "tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a", "grammar": "start: x"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        (  # Python's named group: not an ECMA-262 pattern, as JSON Schema's patterns are
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "y",
                        "schema": {"type": "string", "pattern": "(?P<y>a)"},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "string", "pattern": "^\\A\\d"},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            None,
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
    ],
)
async def test_chat_validation_is_400_naming_the_field(
    client: httpx.AsyncClient, body: dict, param: str | None
) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], **body}
    err = _assert_error(await client.post("/v1/chat/completions", json=payload), 400, param)
    assert err["param"]


async def test_chat_accepts_null_unsupported_fields_and_text_format(
    client: httpx.AsyncClient,
) -> None:
    payload = {
        "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "hi"}],
        "tools": None,
        "response_format": {"type": "text"},
        "max_tokens": 1,
    }
    assert (await client.post("/v1/chat/completions", json=payload)).status_code == 200


async def test_chat_takes_openai_bookkeeping_fields_and_refuses_what_it_cannot_do(
    client: httpx.AsyncClient,
) -> None:
    """metadata, service_tier auto/default and a predicted output change nothing in the answer
    (OpenAI's SDK sends them as any client may); features this server lacks stay named 400s."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    plain = (await client.post("/v1/chat/completions", json=base)).json()
    for extra in (
        {"metadata": {"team": "search", "run": "7"}},
        {"service_tier": "auto"},
        {"service_tier": "default"},
        {"prediction": {"type": "content", "content": "hello"}},
        {"prediction": {"type": "content", "content": [{"type": "text", "text": "hello"}]}},
    ):
        r = await client.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"] == plain["choices"]
    for extra, param in (
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"prediction": {"type": "other", "content": "x"}}, "prediction"),
        ({"store": True}, "store"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
    ):
        r = await client.post("/v1/chat/completions", json={**base, **extra})
        err = _assert_error(r, 400)
        assert (err["param"] or "").startswith(param), (extra, err)


async def test_malformed_json_unknown_route_model_and_context(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    _assert_error(r, 400)
    _assert_error(await client.get("/v1/nope"), 404)
    _assert_error(
        await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "a"}),
        404,
        "model",
        "model_not_found",
    )
    r = await client.post("/v1/completions", json={"prompt": "a" * 60, "max_tokens": 10})
    _assert_error(r, 400, "prompt", "context_length_exceeded")
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 70}]}
    )
    _assert_error(r, 400, "messages", "context_length_exceeded")


async def test_queue_full_is_429_with_retry_after(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.queue_full = True
    r = await client.post("/v1/completions", json={"prompt": "abc", "stream": True})
    _assert_error(r, 429)
    assert r.headers["retry-after"] == "3"


async def test_error_after_stream_start_is_a_final_event(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail_after = 2
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    assert r.status_code == 200
    frames = _frames(r.text)
    assert "[DONE]" not in frames
    assert json.loads(frames[-1])["error"]["message"] == "injected failure"
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": False})
    _assert_error(r, 500)


async def test_api_key_body_cap_and_request_id(engine: FakeEngine) -> None:
    async with app_client(engine, api_key="sekret", max_request_body_bytes=4096) as c:
        assert (await c.get("/health")).status_code == 200
        _assert_error(await c.get("/v1/models"), 401, code="invalid_api_key")
        _assert_error(await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        auth = {"Authorization": "Bearer sekret", "X-Request-Id": "abc-123"}
        r = await c.get("/v1/models", headers=auth)
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        assert r.json()["data"][0] == {
            **r.json()["data"][0],
            "id": "fake-model",
            "max_model_len": 64,
        }
        _assert_error(
            await c.post("/v1/completions", headers=auth, json={"prompt": "a" * 5000}), 413
        )


async def test_health_tokenize_detokenize_and_served_name() -> None:
    app = build_app(ServerConfig(served_model_name="mine"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 503
        _assert_error(await c.post("/v1/completions", json={"prompt": "a"}), 503)
        app.state.server.engine = FakeEngine()
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "mine"
        assert (await c.get("/v1/models/mine")).status_code == 200
        _assert_error(await c.get("/v1/models/other"), 404)
        r = await c.post("/tokenize", json={"prompt": "hi"})
        assert r.json() == {
            "count": 2,
            "max_model_len": 64,
            "tokens": [104, 105],
            "token_strs": None,
        }
        r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.json()["count"] == len("<user>x<assistant>")
        assert (await c.post("/detokenize", json={"tokens": [104, 105]})).json() == {"prompt": "hi"}
        assert (await c.get("/version")).json()["version"]
        app.state.server.draining = True
        assert (await c.get("/health")).status_code == 503
        _assert_error(await c.post("/tokenize", json={"prompt": "hi"}), 503)
