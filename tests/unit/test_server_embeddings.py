"""POST /v1/embeddings over a fake embedding engine: OpenAI shapes, base64, dimensions, truncation,
input forms and their errors, concurrency, disconnects, and routes refused by the wrong kind of model."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import Request
from openai.types import CreateEmbeddingResponse

from engine import EmbeddingOutput, EmbeddingPrompts, QueueFullError
from server.app import build_app
from server.protocol import EmbeddingRequest
from server.serving_embeddings import create_embedding
from server.state import ServerConfig
from tests.unit.server_fakes import FakeEmbeddingClient, FakeEngine, FakeTokenizer

CLS, SEP = 1, 2
DIM = 8


class SpecialTokenizer(FakeTokenizer):
    """Byte tokens framed by CLS ... SEP, like a BERT tokenizer."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = super().encode(text)
        return [CLS, *ids, SEP] if add_special_tokens else ids


def fake_vector(ids: list[int]) -> list[float]:
    """A deterministic unit vector that differs between inputs."""
    raw = [
        sum((t + 1) * (k + 1) ** (p % 3) for p, t in enumerate(ids)) % 97 + 1.0 for k in range(DIM)
    ]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


class FakeEmbeddingEngine(FakeEmbeddingClient):
    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = SpecialTokenizer()
        self.requests: list[tuple[str, list[int]]] = []
        self.max_active = 0
        self.aborted: list[str] = []
        self.delay = 0.01
        self.refuse_token: int | None = None  # inputs holding this token id get QueueFullError

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], lora: str | None = None
    ) -> EmbeddingOutput:
        self.validate(prompt_token_ids, None)
        if self.refuse_token in prompt_token_ids:
            raise QueueFullError("queue is full", retry_after=2.0)
        self.requests.append((request_id, list(prompt_token_ids)))
        self.active.add(request_id)
        self.max_active = max(self.max_active, len(self.active))
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        finally:
            self.active.discard(request_id)
        return EmbeddingOutput(request_id, fake_vector(prompt_token_ids), len(prompt_token_ids))


@pytest.fixture
def engine() -> FakeEmbeddingEngine:
    return FakeEmbeddingEngine()


@pytest.fixture
async def client(engine: FakeEmbeddingEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(ServerConfig(), engine)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        yield c


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


async def _embed(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await client.post("/v1/embeddings", json=body)


def _ids(text: str) -> list[int]:
    return [CLS, *text.encode(), SEP]


async def test_single_text_in_openai_shape(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    r = await _embed(client, model="fake-embedder", input="hello", user="u-1")
    assert r.status_code == 200, r.text
    resp = CreateEmbeddingResponse.model_validate(r.json())
    assert resp.object == "list" and resp.model == "fake-embedder"
    assert [d.index for d in resp.data] == [0] and resp.data[0].object == "embedding"
    assert resp.data[0].embedding == pytest.approx(fake_vector(_ids("hello")))
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == len(_ids("hello"))
    assert [ids for _, ids in engine.requests] == [_ids("hello")]


async def test_list_inputs_run_concurrently_in_order(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    texts = ["a", "bb", "ccc", "dddd"]
    r = await _embed(client, input=texts)
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3]
    for text, d in zip(texts, data, strict=True):
        assert d["embedding"] == pytest.approx(fake_vector(_ids(text)))
    assert engine.max_active == len(texts)  # all inputs were in the engine at once
    assert r.json()["usage"]["prompt_tokens"] == sum(len(_ids(t)) for t in texts)


async def test_token_id_inputs(client: httpx.AsyncClient, engine: FakeEmbeddingEngine) -> None:
    r = await _embed(client, input=[5, 6, 7])
    assert r.json()["data"][0]["embedding"] == pytest.approx(fake_vector([5, 6, 7]))
    r = await _embed(client, input=[[5, 6], [7]])
    assert [len(d["embedding"]) for d in r.json()["data"]] == [DIM, DIM]
    assert [ids for _, ids in engine.requests[1:]] == [[5, 6], [7]]
    assert r.json()["usage"]["prompt_tokens"] == 3


async def test_base64_is_little_endian_float32(client: httpx.AsyncClient) -> None:
    floats = (await _embed(client, input="xyz")).json()["data"][0]["embedding"]
    r = await _embed(client, input="xyz", encoding_format="base64")
    encoded = r.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = struct.unpack(f"<{DIM}f", base64.b64decode(encoded))
    assert list(decoded) == pytest.approx(floats, abs=1e-7)


async def test_dimensions_truncate_and_renormalize(client: httpx.AsyncClient) -> None:
    full = fake_vector(_ids("abc"))
    r = await _embed(client, input="abc", dimensions=3)
    short = r.json()["data"][0]["embedding"]
    norm = math.sqrt(sum(x * x for x in full[:3]))
    assert short == pytest.approx([x / norm for x in full[:3]])
    assert sum(x * x for x in short) == pytest.approx(1.0)
    assert (
        len((await _embed(client, input="abc", dimensions=DIM)).json()["data"][0]["embedding"])
        == DIM
    )
    _error(await _embed(client, input="abc", dimensions=DIM + 1), 400, "dimensions")
    _error(await _embed(client, input="abc", dimensions=0), 400, "dimensions")


async def test_too_long_input_and_truncation(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    text = "abcdefghijklmnopqrstuvwxyz0123456789"  # 36 + 2 special tokens > 32
    err = _error(await _embed(client, input=text), 400, "input")
    assert err["code"] == "context_length_exceeded"
    assert not engine.requests

    await _embed(client, input=text, truncate_prompt_tokens=6)
    assert engine.requests[-1][1] == [CLS, *b"6789", SEP]  # the last tokens, still framed
    await _embed(client, input=text, truncate_prompt_tokens=-1)
    assert engine.requests[-1][1] == [CLS, *text.encode()[-30:], SEP]
    await _embed(client, input=list(range(10, 50)), truncate_prompt_tokens=5)
    assert engine.requests[-1][1] == [45, 46, 47, 48, 49]
    await _embed(client, input="short", truncate_prompt_tokens=20)
    assert engine.requests[-1][1] == _ids("short")

    _error(
        await _embed(client, input="abc", truncate_prompt_tokens=33), 400, "truncate_prompt_tokens"
    )
    _error(
        await _embed(client, input="abc", truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"
    )
    _error(
        await _embed(client, input="abc", truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens"
    )
    # Too few to hold the special tokens and one token of text: a 400, never a vector of [SEP].
    for keep in (1, 2):
        err = _error(
            await _embed(client, input=text, truncate_prompt_tokens=keep),
            400,
            "truncate_prompt_tokens",
        )
        assert "2 special tokens" in err["message"]
    await _embed(client, input=text, truncate_prompt_tokens=3)
    assert engine.requests[-1][1] == [CLS, ord("9"), SEP]


@pytest.mark.parametrize("bad", ["", [], [""], ["ok", ""], [[]], [[3], []]])
async def test_empty_inputs_are_400_naming_input(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine, bad: object
) -> None:
    _error(await _embed(client, input=bad), 400, "input")
    assert not engine.requests


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [300]}, "input"),  # outside the vocabulary
        ({"input": [-1]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": "4"}, "dimensions"),
        ({"input": "a", "suffix": "x"}, "suffix"),
    ],
)
async def test_bad_requests_are_400(client: httpx.AsyncClient, body: dict, param: str) -> None:
    _error(await client.post("/v1/embeddings", json=body), 400, param)


async def test_wrong_model_is_404(client: httpx.AsyncClient) -> None:
    err = _error(await _embed(client, model="other", input="a"), 404, "model")
    assert err["code"] == "model_not_found"


async def test_more_inputs_than_the_queue_admits_is_400(client: httpx.AsyncClient) -> None:
    err = _error(await _embed(client, input=["a"] * 17), 400, "input")
    assert "16" in err["message"]


@pytest.mark.parametrize("one", ["a", [1, 2]])
async def test_more_inputs_than_openai_allows_says_so(
    client: httpx.AsyncClient, one: object
) -> None:
    err = _error(await _embed(client, input=[one] * 2049), 400, "input")
    assert "at most 2048 inputs" in err["message"], err["message"]


async def test_a_refused_input_is_429_and_aborts_the_others(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    engine.delay = 30.0
    engine.refuse_token = ord("b")
    r = await asyncio.wait_for(_embed(client, input=["a", "b", "c"]), timeout=10)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert sorted(engine.aborted) == sorted(rid for rid, _ in engine.requests)
    assert len(engine.aborted) == 2 and not engine.active


async def test_generation_routes_refused_on_an_embedding_server(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert "/v1/embeddings" in _error(r, 400)["message"]
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert _error(r, 400)["type"] == "invalid_request_error"
    # The model list and tokenizer still work.
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["fake-embedder"]
    r = await client.post("/tokenize", json={"prompt": "hi"})
    assert r.json()["tokens"] == _ids("hi")


async def test_embeddings_refused_on_a_generation_server() -> None:
    app = build_app(ServerConfig(), FakeEngine())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        r = await c.post("/v1/embeddings", json={"input": "hi"})
    err = _error(r, 400)
    assert "embedding model" in err["message"]


async def test_client_disconnect_aborts_every_input(engine: FakeEmbeddingEngine) -> None:
    engine.delay = 30.0
    app = build_app(ServerConfig(), engine)
    state = app.state.server

    async def receive() -> dict:
        while len(engine.active) < 3:
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}

    raw = Request(
        {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": []}, receive
    )
    req = EmbeddingRequest(input=["a", "b", "c"])
    response = await asyncio.wait_for(create_embedding(req, raw, state), timeout=10)
    assert response.status_code == 499
    assert sorted(engine.aborted) == sorted(rid for rid, _ in engine.requests)
    assert len(engine.aborted) == 3 and not engine.active


# ---------------------------------------------------------------- instruction prompts

PROMPTED = EmbeddingPrompts({"query": "Q: ", "document": ""}, default_name=None)


async def test_prompt_name_prepends_the_named_prompt_to_texts(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    engine.embedding_prompts = PROMPTED
    await _embed(client, input=["cats", "dogs"], prompt_name="query")
    assert [ids for _, ids in engine.requests] == [_ids("Q: cats"), _ids("Q: dogs")]
    await _embed(client, input="cats")  # no default_prompt_name: the text alone
    assert engine.requests[-1][1] == _ids("cats")
    await _embed(client, input="cats", prompt_name="document")
    assert engine.requests[-1][1] == _ids("cats")


async def test_default_prompt_name_applies_unless_a_request_names_another(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    engine.embedding_prompts = EmbeddingPrompts(PROMPTED.prompts, default_name="query")
    await _embed(client, input="cats")
    assert engine.requests[-1][1] == _ids("Q: cats")
    await _embed(client, input="cats", prompt_name="document")
    assert engine.requests[-1][1] == _ids("cats")
    await _embed(client, input=[5, 6, 7])  # token ids are embedded as given
    assert engine.requests[-1][1] == [5, 6, 7]


async def test_truncation_keeps_the_prompt_and_the_texts_last_tokens(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine
) -> None:
    engine.embedding_prompts = PROMPTED
    text = "abcdefghijklmnopqrstuvwxyz0123456789"
    await _embed(client, input=text, prompt_name="query", truncate_prompt_tokens=9)
    assert engine.requests[-1][1] == [CLS, *b"Q: 6789", SEP]
    err = _error(
        await _embed(client, input=text, prompt_name="query", truncate_prompt_tokens=5),
        400,
        "truncate_prompt_tokens",
    )
    assert "prompt" in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"input": "cats", "prompt_name": "passage"},  # not one of the model's prompts
        {"input": [5, 6], "prompt_name": "query"},  # ids cannot take a text prompt
        {"input": "cats", "prompt_name": 3},
    ],
)
async def test_bad_prompt_names_are_400(
    client: httpx.AsyncClient, engine: FakeEmbeddingEngine, body: dict
) -> None:
    engine.embedding_prompts = PROMPTED
    _error(await _embed(client, **body), 400, "prompt_name")
    assert not engine.requests
