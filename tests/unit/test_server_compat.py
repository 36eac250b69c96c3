"""OpenAI-compatibility details over the fake engine: text offsets of non-ASCII text, max_tokens defaults,
stream_options, one clear message per invalid field, HEAD /health, and no empty stream chunks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from engine import TokenLogprob
from server.logprobs import CompletionLogprobsBuilder
from tests.unit.server_fakes import FakeEngine, FakeTokenizer, app_client


def _chunks(body: str) -> list[dict[str, Any]]:
    frames = [f.removeprefix("data: ") for f in body.strip().split("\n\n")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return str(err["message"])


# ------------------------------------------------------------------------------------- text_offset

# "、" and "ア" are 3 UTF-8 bytes each; the fake engine emits one token per byte.
SCRIPT = "a、ア b"
# A token's offset is where its text starts: a token that continues an incomplete character starts
# where that character starts, since the character is only complete once its last byte is there.
SCRIPT_OFFSETS = [0, 1, 1, 1, 2, 2, 2, 3, 4]


async def test_text_offset_counts_characters_of_non_ascii_text(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.script = SCRIPT
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == SCRIPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(SCRIPT.encode())
    assert lp["text_offset"] == SCRIPT_OFFSETS
    assert all(offset <= len(choice["text"]) for offset in lp["text_offset"])


async def test_text_offset_with_echo_counts_prompt_characters(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.script = SCRIPT
    body = {"prompt": "é!", "max_tokens": 20, "logprobs": 1, "echo": True}
    choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["text"] == "é!" + SCRIPT
    assert choice["logprobs"]["text_offset"] == [0, 0, 1] + [2 + o for o in SCRIPT_OFFSETS]


@pytest.mark.parametrize("echo", [False, True])
async def test_streamed_text_offsets_continue_across_chunks(
    client: httpx.AsyncClient, engine: FakeEngine, echo: bool
) -> None:
    engine.script = SCRIPT
    body = {"prompt": "é!", "max_tokens": 20, "logprobs": 1, "echo": echo}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    r = await client.post("/v1/completions", json={**body, "stream": True})
    offsets: list[int] = []
    text = ""
    for chunk in _chunks(r.text):
        choice = chunk["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert offsets == whole["logprobs"]["text_offset"]


class _SpecialTokenizer(FakeTokenizer):
    """Token 1 is a special token "<s>": decoding skips it unless asked not to."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (i == 1 and skip_special_tokens)]
        return "".join("<s>" if i == 1 else bytes([i]).decode(errors="replace") for i in kept)

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        return [list(b"<s>") if i == 1 else [i] for i in ids]

    def token_strings(self, ids: list[int]) -> list[str]:
        return ["<s>" if i == 1 else bytes([i]).decode("latin-1") for i in ids]


def test_text_offset_of_skipped_special_tokens() -> None:
    tokenizer = _SpecialTokenizer()
    entries = [TokenLogprob(t, -1.0, 1, [(t, -1.0)]) for t in (97, 1, 98)]
    shown = CompletionLogprobsBuilder(tokenizer, 1, skip_special_tokens=False)
    assert shown.build([97, 1, 98], entries)["text_offset"] == [0, 1, 4]  # text "a<s>b"
    skipped = CompletionLogprobsBuilder(tokenizer, 1, skip_special_tokens=True)
    assert skipped.build([97, 1, 98], entries)["text_offset"] == [0, 1, 1]  # text "ab"
    # An echoed text prompt: a special token the tokenizer added (not in the text) takes no room,
    # one written in the text does.
    echo = CompletionLogprobsBuilder(tokenizer, 1)
    assert echo.build_prompt([1, 97, 1], [None, *entries[:2]], "a<s>")["text_offset"] == [0, 0, 1]
    assert echo.build([98], entries[2:])["text_offset"] == [4]


# --------------------------------------------------------------------------------------- max_tokens


async def test_completion_max_tokens_null_means_the_default_16(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    for extra in ({}, {"max_tokens": None}):
        r = await client.post("/v1/completions", json={"prompt": "abc", **extra})
        assert r.status_code == 200, r.text
        assert engine.requests[-1][2].max_tokens == 16
        assert r.json()["usage"]["completion_tokens"] == 16


async def test_chat_max_tokens_null_means_until_the_model_length(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert engine.requests[-1][2].max_tokens is None


async def test_a_reply_dumped_by_the_openai_sdk_goes_back_as_history(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    from openai.types.chat import ChatCompletion

    first = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = ChatCompletion.model_validate(
        (await client.post("/v1/chat/completions", json=first)).json()
    )
    dumped = reply.choices[0].message.model_dump()  # annotations, audio, function_call: None
    assert {"annotations", "audio", "function_call", "refusal"} <= dumped.keys()
    more = {**first, "messages": [*first["messages"], dumped, {"role": "user", "content": "more"}]}
    r = await client.post("/v1/chat/completions", json=more)
    assert r.status_code == 200, r.text
    dumped["annotations"] = []  # as a reply with no citations has it
    r = await client.post("/v1/chat/completions", json=more)
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------------- stream_options

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "abc", "max_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
async def test_stream_options_require_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    options = {"stream_options": {"include_usage": True}}
    for stream in ({}, {"stream": False}, {"stream": None}):
        message = _error(
            await client.post(path, json={**body, **options, **stream}), "stream_options"
        )
        assert "stream" in message
    assert (await client.post(path, json={**body, "stream_options": None})).status_code == 200
    r = await client.post(path, json={**body, **options, "stream": True})
    assert r.status_code == 200 and _chunks(r.text)[-1]["usage"]


# ------------------------------------------------------------------------------ validation messages


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": [-1]}, "prompt", "prompt[0]: Input should be greater than or equal to 0"),
        ({"prompt": []}, "prompt", "prompt: List should have at least 1 item"),
        ({"prompt": [[]]}, "prompt", "prompt[0]: List should have at least 1 item"),
        ({"prompt": ["a", 1]}, "prompt", "prompt[1]: Input should be a valid string"),
        ({"prompt": [1, True]}, "prompt", "prompt[1]: Input should be a valid integer"),
        ({"prompt": [[1], [-1]]}, "prompt", "prompt[1][0]: Input should be greater than or equal"),
        ({"prompt": 5}, "prompt", "prompt: Input should be a string or a list"),
        ({"prompt": "a", "stop": ["x"] * 17}, "stop", "stop: List should have at most 16 items"),
        ({"prompt": "a", "stop": 5}, "stop", "stop: Input should be a string or a list"),
    ],
)
async def test_union_fields_get_the_relevant_message(
    client: httpx.AsyncClient, body: dict[str, Any], param: str, message: str
) -> None:
    got = _error(await client.post("/v1/completions", json=body), param)
    assert got.startswith(message), got


async def test_non_text_content_part_says_only_text_is_supported(
    client: httpx.AsyncClient,
) -> None:
    part = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]}
    message = _error(await client.post("/v1/chat/completions", json=body), "messages[0].content[1]")
    assert "only text" in message and "image_url" in message, message


@pytest.mark.parametrize(
    ("content", "content_type"),
    [(b'{"prompt": "a"}', "text/plain"), (b'["a"]', "application/json"), (b'"a"', None)],
)
async def test_a_body_that_is_not_a_json_object_says_so(
    client: httpx.AsyncClient, content: bytes, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = await client.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "must be a JSON object" in err["message"], err


# ------------------------------------------------------------------------------------- HEAD /health


async def test_head_health_without_api_key(engine: FakeEngine) -> None:
    async with app_client(engine, api_key="sekret") as c:
        r = await c.head("/health")
        assert r.status_code == 200 and r.content == b""
        assert (await c.get("/health")).json() == {"status": "ok"}
        assert (await c.head("/v1/models")).status_code == 401
    async with app_client(None) as c:  # type: ignore[arg-type]
        assert (await c.head("/health")).status_code == 503


# --------------------------------------------------------------------------- no empty stream chunks


@pytest.mark.parametrize("logprobs", [None, 1])
async def test_completion_stream_sends_no_empty_chunks(
    client: httpx.AsyncClient, engine: FakeEngine, logprobs: int | None
) -> None:
    engine.script = SCRIPT
    body = {"prompt": "x", "max_tokens": 20, "stream": True, "logprobs": logprobs}
    chunks = _chunks((await client.post("/v1/completions", json=body)).text)
    for chunk in chunks:
        choice = chunk["choices"][0]
        assert (
            choice["text"] or choice["finish_reason"] or (choice["logprobs"] or {}).get("tokens")
        ), chunk
    assert "".join(c["choices"][0]["text"] for c in chunks) == SCRIPT


async def test_chat_stream_sends_no_empty_chunks_after_the_role(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.script = SCRIPT
    body = {**CHAT, "max_tokens": 20, "stream": True, "n": 2}
    chunks = _chunks((await client.post("/v1/chat/completions", json=body)).text)
    roles = [c for c in chunks if c["choices"][0]["delta"].get("role")]
    assert len(roles) == 2
    for chunk in chunks:
        if chunk in roles:
            continue
        choice = chunk["choices"][0]
        assert choice["delta"].get("content") or choice["finish_reason"], chunk
    texts = [
        "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c["choices"][0]["index"] == i
        )
        for i in (0, 1)
    ]
    assert texts == [SCRIPT, SCRIPT]
