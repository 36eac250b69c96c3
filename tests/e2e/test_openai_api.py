"""The official `openai` SDK and raw httpx against a real server on the tiny random model."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.e2e.conftest import ServerProcess

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count to five."},
]


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model_with_its_length(
    client: openai.OpenAI, tiny_server: ServerProcess
) -> None:
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve(models[0].id).id == models[0].id
    # Loading may beat the first poll on a fast machine, but /health never answers anything but 503
    # (loading) or 200 (ready); tests/unit/test_server_api.py checks the 503 deterministically.
    assert tiny_server.startup_statuses and tiny_server.startup_statuses[-1] == 200
    assert set(tiny_server.startup_statuses) <= {200, 503}, tiny_server.startup_statuses


def test_completion_shapes_and_usage(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(
        model=model, prompt="Hello there", max_tokens=5, temperature=0
    )
    Completion.model_validate(completion.model_dump())
    choice = completion.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage is not None and completion.usage.completion_tokens <= 5
    assert (
        completion.usage.total_tokens
        == completion.usage.prompt_tokens + completion.usage.completion_tokens
    )


def test_many_prompts_and_n(client: openai.OpenAI, model: str) -> None:
    prompts = ["one two", "three four five"]
    completion = client.completions.create(model=model, prompt=prompts, n=2, max_tokens=3, seed=1)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=model, prompt=prompts[1], max_tokens=3, temperature=0)
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0)
    assert batch.choices[1].text == alone.choices[0].text


def test_greedy_and_seeded_sampling_are_reproducible(client: openai.OpenAI, model: str) -> None:
    def run(**kw: object) -> list[str]:
        out = client.completions.create(model=model, prompt="The", max_tokens=6, n=2, **kw)  # type: ignore[arg-type]
        return [c.text for c in out.choices]

    assert run(temperature=0) == run(temperature=0)
    assert run(temperature=1.0, seed=1234) == run(temperature=1.0, seed=1234)


def test_logprobs_and_echo(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt="a b c", max_tokens=3, logprobs=2, temperature=0
    )
    lp = out.choices[0].logprobs
    assert (
        lp is not None and lp.tokens is not None and len(lp.tokens) == out.usage.completion_tokens
    )  # type: ignore[union-attr]
    assert all(len(top) >= 2 for top in lp.top_logprobs or [])
    assert "".join(lp.tokens) == out.choices[0].text
    echo = client.completions.create(
        model=model, prompt="a b c", max_tokens=0, echo=True, logprobs=1
    )
    choice = echo.choices[0]
    assert choice.text == "a b c"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == echo.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(x is not None and x <= 0 for x in choice.logprobs.token_logprobs[1:])


def test_stop_string_is_cut(client: openai.OpenAI, model: str) -> None:
    no_eos = {"ignore_eos": True}  # the random model must not end before the stop string
    free = (
        client.completions.create(
            model=model, prompt="x y", max_tokens=12, temperature=0, extra_body=no_eos
        )
        .choices[0]
        .text
    )
    assert len(free) >= 4, f"12 tokens decoded to {free!r}"
    stop = free[2:4]
    out = client.completions.create(
        model=model, prompt="x y", max_tokens=12, temperature=0, stop=[stop], extra_body=no_eos
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == free[: free.index(stop)]
    streamed = client.completions.create(
        model=model,
        prompt="x y",
        max_tokens=12,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body=no_eos,
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_chat_with_logprobs(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        n=2,  # type: ignore[arg-type]
    )
    ChatCompletion.model_validate(chat.model_dump())
    assert [c.index for c in chat.choices] == [0, 1]
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 and t.bytes is not None for t in content)


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0].message.content  # type: ignore[call-overload]
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )  # type: ignore[call-overload]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason is not None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full


async def test_async_client_streams_n_choices(tiny_server: ServerProcess, model: str) -> None:
    client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(
        model=model, prompt="hi", max_tokens=4, n=3, stream=True, temperature=0
    )
    texts = {0: "", 1: "", 2: ""}
    async for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1] == texts[2]  # greedy: all samples agree
    await client.close()


def test_raw_sse_framing(tiny_server: ServerProcess, model: str) -> None:
    body = {
        "model": model,
        "prompt": "abc",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    frames = r.text[:-2].split("\n\n")
    assert all(f.startswith("data: ") for f in frames)
    payloads = [json.loads(f[6:]) for f in frames[:-1]]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] >= 1
    assert all(p["usage"] is None for p in payloads[:-1])


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, None, "temperature"),
        (
            "/v1/completions",
            {"prompt": "a", "max_tokens": 300},
            400,
            "context_length_exceeded",
            "prompt",
        ),
        ("/v1/completions", {"prompt": "a", "model": "nope"}, 404, "model_not_found", "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": []},
            400,
            None,
            "tools",
        ),
        ("/v1/chat/completions", {"messages": "hello"}, 400, None, "messages"),
        ("/v1/embeddingz", {}, 404, None, None),
    ],
)
def test_error_envelopes(
    tiny_server: ServerProcess,
    path: str,
    body: dict,
    status: int,
    code: str | None,
    param: str | None,
) -> None:
    r = httpx.post(tiny_server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param) if code else error["param"] == param


def test_malformed_json_is_400_not_422(tiny_server: ServerProcess) -> None:
    r = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        content=b"{nope",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_sdk_raises_typed_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt="a", max_tokens=1000)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)  # type: ignore[arg-type]


def test_tokenize_roundtrip(tiny_server: ServerProcess) -> None:
    tokens = httpx.post(tiny_server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = httpx.post(tiny_server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat = httpx.post(tiny_server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokens["count"]
    assert httpx.get(tiny_server.url + "/version").json()["version"]


def test_concurrent_greedy_streams_equal_alone(tiny_server: ServerProcess, model: str) -> None:
    prompts = [f"Story number {i} begins with" for i in range(16)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(
            base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0
        )
        alone = [await one(client, p) for p in prompts]
        together = await asyncio.gather(*(one(client, p) for p in prompts))
        await client.close()
        return alone, list(together)

    alone, together = asyncio.run(run_all())
    assert together == alone
    assert all(alone)


def test_text_offsets_of_non_ascii_text(tiny_server: ServerProcess, model: str) -> None:
    """Each offset is where the token's text starts in prompt + completion, counted in characters."""
    url, prompt = tiny_server.url, "日本の首都は"
    ids = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]

    def complete_chars(n: int) -> int:  # characters fully spelled by the first n prompt tokens
        text = httpx.post(url + "/detokenize", json={"tokens": ids[:n]}).json()["prompt"]
        return len(text.rstrip("\ufffd"))

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "ignore_eos": True,
    }
    choice = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert text.startswith(prompt) and len(tokens) == len(ids) + 12
    assert any(t.startswith("bytes:") for t in tokens[: len(ids)]), "no character split in tokens"
    assert offsets[: len(ids)] == [complete_chars(n) for n in range(len(ids))]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i, (offset, token) in enumerate(zip(offsets, tokens, strict=True)):
        whole = not token.startswith("bytes:") and not tokens[i - 1].startswith("bytes:")
        if i > len(ids) and whole and not token.startswith("<|"):
            assert text.startswith(token, offset), (offset, token, text)
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line[6:].startswith("{")]
    streamed = [
        o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])
    ]
    assert streamed == offsets


def test_head_health(tiny_server: ServerProcess) -> None:
    r = httpx.head(tiny_server.url + "/health")
    assert r.status_code == 200 and r.content == b""
