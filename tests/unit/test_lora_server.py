"""LoRA adapters on the HTTP side over a fake engine that serves them: /v1/models, the selection of an
adapter by `model` on every surface, unknown names as 404s in each API's envelope, the runtime load
and unload routes with their switch and auth, the settings, and the Ray-free broadcast to replicas."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from engine import (
    EmbeddingOutput,
    LoRAError,
    LoRAInfo,
    LoRANotFoundError,
    RequestOutput,
    SamplingParams,
)
from server.distributed.asgi_call import ForwardRequest
from server.distributed.lora_broadcast import broadcast_lora_update
from server.distributed.replica_broadcast import ReplicaAnswer
from server.settings import build_configs, check_lora_modules, resolve
from tests.unit.server_fakes import FakeEmbeddingClient, FakeEngine, app_client, replica_sender

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def info(name: str, path: str = "") -> LoRAInfo:
    return LoRAInfo(name, path or f"/adapters/{name}", 8, 16.0, ("q_proj",), "h-" + name, 1700)


class LoRAFakeEngine(FakeEngine):
    """FakeEngine serving adapters; it records the adapter each request ran on. A path containing
    "bad" is refused as a broken folder."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.adapters = {n: info(n) for n in names}
        self.ran_on: list[str | None] = []

    def loras(self) -> tuple[LoRAInfo, ...]:
        return tuple(self.adapters.values())

    def _check(self, lora: str | None) -> None:
        if lora is not None and lora not in self.adapters:
            raise LoRANotFoundError(lora, tuple(self.adapters))
        self.ran_on.append(lora)

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        if name in self.adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        if "bad" in path:
            raise LoRAError(f"LoRA adapter at {path!r}: rank 512 is above the maximum", "lora_path")
        self.adapters[name] = info(name, path)
        return self.adapters[name]

    async def unload_lora(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRANotFoundError(name, tuple(self.adapters))
        del self.adapters[name]

    async def generate(  # type: ignore[override]
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self._check(lora)
        async for out in super().generate(request_id, prompt_token_ids, params, prompt):
            yield out

    async def score(self, *args: Any, lora: str | None = None, **kwargs: Any) -> RequestOutput:
        self._check(lora)
        return await super().score(*args, **kwargs)


class LoRAFakeEmbedder(FakeEmbeddingClient):
    def __init__(self) -> None:
        super().__init__()
        self.ran_on: list[str | None] = []

    def loras(self) -> tuple[LoRAInfo, ...]:
        return (info("emb"),)

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], lora: str | None = None
    ) -> EmbeddingOutput:
        self.ran_on.append(lora)
        return await super().embed(request_id, prompt_token_ids)


async def test_models_lists_the_base_model_and_each_adapter() -> None:
    async with app_client(LoRAFakeEngine("sql", "poem")) as c:
        data = (await c.get("/v1/models")).json()["data"]
        assert [m["id"] for m in data] == ["fake-model", "sql", "poem"]
        assert data[0]["parent"] is None and data[0]["root"] == "fake-model"
        assert data[1]["parent"] == "fake-model" and data[1]["root"] == "/adapters/sql"
        assert data[1]["created"] == 1700
        one = (await c.get("/v1/models/poem")).json()
        assert one["id"] == "poem" and one["parent"] == "fake-model"
        assert (await c.get("/v1/models/fake-model:poem")).json()["id"] == "poem"
        missing = await c.get("/v1/models/prose")
        assert missing.status_code == 404
        err = missing.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "'fake-model', 'sql', 'poem'" in err["message"]


async def test_model_selects_the_adapter_on_completions_and_chat() -> None:
    engine = LoRAFakeEngine("sql")
    async with app_client(engine, served_model_name="base") as c:
        for model in ("sql", "base:sql", "base", None):
            body: dict[str, Any] = {"prompt": "abc", "max_tokens": 2}
            if model is not None:
                body["model"] = model
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (model or "base")
        assert engine.ran_on == ["sql", "sql", None, None]
        messages = [{"role": "user", "content": "hi"}]
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "sql", "messages": messages, "max_tokens": 2, "stream": True},
        )
        assert r.status_code == 200 and '"model":"sql"' in r.text.replace(" ", "")
        assert engine.ran_on[-1] == "sql"
        # An adapter named with the wrong base, or a base that is not this one, is unknown.
        for model in ("other:sql", "sql:base", "SQL"):
            r = await c.post("/v1/completions", json={"model": model, "prompt": "a"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_every_surface_passes_the_adapter() -> None:
    engine = LoRAFakeEngine("sql")
    messages = [{"role": "user", "content": "hi"}]
    async with app_client(engine) as c:
        r = await c.post(
            "/v1/responses", json={"model": "sql", "input": "hi", "max_output_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        r = await c.post(
            "/v1/messages", json={"model": "sql", "messages": messages, "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        r = await c.post("/v1/score", json={"model": "sql", "prompt": "a", "choices": ["b", "c"]})
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
        assert engine.ran_on == ["sql", "sql", "sql"]
        r = await c.post("/tokenize", json={"model": "sql", "prompt": "abc"})
        assert r.status_code == 200
    embedder = LoRAFakeEmbedder()
    async with app_client(embedder) as c:
        r = await c.post("/v1/embeddings", json={"model": "emb", "input": "abc"})
        assert r.status_code == 200 and r.json()["model"] == "emb"
        r = await c.post("/v1/embeddings", json={"input": "abc"})
        assert r.status_code == 200
    assert embedder.ran_on == ["emb", None]


async def test_unknown_models_are_404_in_each_apis_envelope() -> None:
    engine = LoRAFakeEngine("sql")
    async with app_client(engine) as c:
        r = await c.post(
            "/v1/messages",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        )
        assert r.status_code == 404
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        assert "'nope'" in body["error"]["message"] and "'sql'" in body["error"]["message"]
        r = await c.post("/v1/responses", json={"model": "nope", "input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await c.post("/v1/score", json={"model": "nope", "prompt": "a", "choices": ["b"]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert engine.ran_on == []


async def test_an_adapter_unloaded_before_its_request_starts_is_a_404() -> None:
    """The name resolved, then the engine no longer served it (an unload in between)."""

    class Racing(LoRAFakeEngine):
        def loras(self) -> tuple[LoRAInfo, ...]:
            return (info("gone"),)

    racing = Racing("sql")
    async with app_client(racing) as c:
        r = await c.post("/v1/completions", json={"model": "gone", "prompt": "a"})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "'gone'" in err["message"]
        r = await c.post("/v1/score", json={"model": "gone", "prompt": "a", "choices": ["b"]})
        assert r.status_code == 404
    assert racing.ran_on == []


async def test_load_and_unload_routes() -> None:
    engine = LoRAFakeEngine()
    async with app_client(engine, api_key=KEY) as c:
        load = {"lora_name": "sql", "lora_path": "/a/sql"}
        assert (await c.post("/v1/load_lora_adapter", json=load)).status_code == 401
        r = await c.post("/v1/load_lora_adapter", json=load, headers=AUTH)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
        models = (await c.get("/v1/models", headers=AUTH)).json()["data"]
        assert [m["id"] for m in models] == ["fake-model", "sql"]
        assert models[1]["root"] == "/a/sql"
        r = await c.post("/v1/load_lora_adapter", json=load, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
        bad = {"lora_name": "x", "lora_path": "/a/bad"}
        r = await c.post("/v1/load_lora_adapter", json=bad, headers=AUTH)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "rank 512" in err["message"]
        base = {"lora_name": "fake-model", "lora_path": "/a/b"}
        r = await c.post("/v1/load_lora_adapter", json=base, headers=AUTH)
        assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x"}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        for empty in ({"lora_name": "", "lora_path": "/a"}, {"lora_name": "x", "lora_path": ""}):
            r = await c.post("/v1/load_lora_adapter", json=empty, headers=AUTH)
            missing = "lora_name" if not empty["lora_name"] else "lora_path"
            assert r.status_code == 400 and r.json()["error"]["param"] == missing
        inplace = {**load, "load_inplace": True}
        r = await c.post("/v1/load_lora_adapter", json=inplace, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
        assert list(engine.adapters) == ["sql"]  # the failures changed nothing
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=AUTH)
        assert r.status_code == 200 and r.text.endswith("'sql' removed successfully.")
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        r = await c.post("/v1/completions", json={"model": "sql", "prompt": "a"}, headers=AUTH)
        assert r.status_code == 404


@pytest.mark.parametrize(
    ("config", "allowed"),
    [
        ({}, False),
        ({"api_key": KEY}, True),
        ({"allow_runtime_lora_updating": True}, True),
        ({"api_key": KEY, "allow_runtime_lora_updating": False}, False),
    ],
)
async def test_runtime_loading_is_on_with_an_api_key_or_the_flag(
    config: dict[str, Any], allowed: bool
) -> None:
    engine = LoRAFakeEngine()
    async with app_client(engine, **config) as c:
        load = {"lora_name": "sql", "lora_path": "/a/sql"}
        r = await c.post("/v1/load_lora_adapter", json=load, headers=AUTH)
        assert r.status_code == (200 if allowed else 404), r.text
        unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=AUTH)
        assert unload.status_code == (200 if allowed else 404)
        if not allowed:
            message = r.json()["error"]["message"]
            if config.get("allow_runtime_lora_updating") is False:  # the operator turned it off
                assert "--no-allow-runtime-lora-updating" in message and "--api-key" not in message
            else:
                assert "--allow-runtime-lora-updating" in message
    assert engine.adapters == {}


def test_lora_settings_from_cli_env_and_file(tmp_path: Any) -> None:
    cli = {"lora_modules": ["a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}']}
    engine, server = build_configs(resolve({**cli, "max_loras": 2, "max_lora_rank": 16}, {}))
    assert engine.lora.modules == (("a", "/x/a"), ("b", "/x/b"))
    assert (engine.lora.max_loras, engine.lora.max_lora_rank) == (2, 16)
    assert not server.runtime_lora_updating
    env = {"KVSERVE_LORA_MODULES": "a=/x/a  b=/x/b", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    engine, server = build_configs(resolve({}, env))
    assert engine.lora.modules == (("a", "/x/a"), ("b", "/x/b"))
    assert server.runtime_lora_updating
    env = {"KVSERVE_LORA_MODULES": '[{"name": "c", "path": "/c"}]'}
    assert build_configs(resolve({}, env))[0].lora.modules == (("c", "/c"),)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "KVSERVE_ALLOW_RUNTIME_LORA_UPDATING": "no"}
    assert not build_configs(resolve({}, env))[1].runtime_lora_updating
    config = tmp_path / "c.yaml"
    config.write_text("lora-modules:\n  - a=/x/a\n  - {name: b, path: /x/b}\nmax-loras: 3\n")
    engine, _ = build_configs(resolve({"config": str(config)}, {}))
    assert engine.lora.modules == (("a", "/x/a"), ("b", "/x/b")) and engine.lora.max_loras == 3
    for bad in (["a=/x", "a=/y"], ["noequals"], ["a b=/x"], ["base:a=/x"]):
        with pytest.raises(ValueError):
            build_configs(resolve({"lora_modules": bad}, {}))
    with pytest.raises(ValueError, match="--lora-modules a: .*no such folder"):
        check_lora_modules(build_configs(resolve({"lora_modules": ["a=/no/such"]}, {}))[0].lora)


# ----------------------------------------------------------------------- the broadcast to replicas


def _post(path: str, body: dict[str, Any]) -> ForwardRequest:
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())]
    return ForwardRequest("POST", path, b"", headers, json.dumps(body).encode())


async def test_a_load_reaches_every_replica_or_none() -> None:
    from server.app import build_app
    from server.state import ServerConfig

    engines = {"r1": LoRAFakeEngine(), "r2": LoRAFakeEngine(), "r3": LoRAFakeEngine()}
    apps = {r: build_app(ServerConfig(api_key=KEY), e) for r, e in engines.items()}
    send = replica_sender(apps)
    load = _post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
    answer = await broadcast_lora_update(load, list(apps), send)
    assert answer.status == 200 and b"added successfully" in answer.body
    assert all(list(e.adapters) == ["sql"] for e in engines.values())

    # r2 already has "poem": the others load it, then unload it again; the answer names r2.
    engines["r2"].adapters["poem"] = info("poem")
    load = _post("/v1/load_lora_adapter", {"lora_name": "poem", "lora_path": "/a/poem"})
    answer = await broadcast_lora_update(load, list(apps), send)
    assert answer.status == 400
    message = json.loads(answer.body)["error"]["message"]
    assert "replica r2 refused" in message and "unloaded again from r1, r3" in message
    assert [list(e.adapters) for e in engines.values()] == [["sql"], ["sql", "poem"], ["sql"]]

    # Every replica refuses a bad folder: their own 400, nothing changed.
    bad = _post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/a/bad"})
    answer = await broadcast_lora_update(bad, list(apps), send)
    assert answer.status == 400 and json.loads(answer.body)["error"]["param"] == "lora_path"

    # An unload is done once no replica serves the name (r2 alone had "poem").
    unload = _post("/v1/unload_lora_adapter", {"lora_name": "poem"})
    answer = await broadcast_lora_update(unload, list(apps), send)
    assert answer.status == 200 and "poem" not in engines["r2"].adapters
    answer = await broadcast_lora_update(unload, list(apps), send)
    assert answer.status == 404

    # An unreachable replica fails the load, which is then undone on the others.
    async def flaky(replica_id: str, request: ForwardRequest) -> ReplicaAnswer:
        if replica_id == "r3":
            raise httpx.ConnectError("refused")
        return await send(replica_id, request)

    load = _post("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": "/a/new"})
    answer = await broadcast_lora_update(load, list(apps), flaky)
    assert answer.status == 503 and "r3" in json.loads(answer.body)["error"]["message"]
    assert all("new" not in e.adapters for e in engines.values())
    answer = await broadcast_lora_update(load, [], send)
    assert answer.status == 503


# ------------------------------------------------------------- metrics, cost sheet and engine page


async def test_lora_metrics_cost_sheet_and_engine_page() -> None:
    from engine import EngineSnapshot, FinishedRequestStats, RequestProgress, StepStats
    from server.cost_sheet import cost_sheet
    from server.engine_page import page_payload

    engine = LoRAFakeEngine("a", "b", "c")
    engine.published = EngineSnapshot(
        task="generate",
        num_steps=3,
        time=10.0,
        running_loras=("a", "b"),
        waiting_loras=("c",),
        max_loras=4,
        requests=(
            RequestProgress("r1", "running", 1, 5, 5, 0, 1, 9.0, lora="a"),
            RequestProgress("r2", "waiting", 1, 5, 0, 0, 0, 9.5),
        ),
    )

    def finished(request_id: str, lora: str | None) -> FinishedRequestStats:
        return FinishedRequestStats(request_id, "stop", 5, 2, 0, 1.0, 1.1, 1.2, 1.5, lora=lora)

    async with app_client(engine) as c:
        await c.get("/health")  # attaches the step listener
        for listener in engine.step_listeners:
            listener(
                StepStats(
                    kind="decode",
                    finished=[finished("r1", "a"), finished("r2", "a"), finished("r3", None)],
                )
            )
        text = (await c.get("/metrics")).text
    lines = text.splitlines()
    assert 'kvserve_lora_requests_total{adapter="a"} 2.0' in lines
    assert not any(line.startswith('kvserve_lora_requests_total{adapter="None"') for line in lines)
    (info,) = [line for line in lines if line.startswith("kvserve_lora_requests_info{")]
    assert 'running_lora_adapters="a,b"' in info and 'waiting_lora_adapters="c"' in info
    assert 'max_lora="4"' in info and float(info.split()[-1]) > 1.7e9  # the scrape's unix time

    rows = page_payload(engine.published, {})["requests"]
    assert [row[8] for row in rows] == ["a", None]
    out = RequestOutput("r1", None, [1, 2], [], True, lora="a")
    assert cost_sheet([out])["lora"] == "a"
    assert cost_sheet([RequestOutput("r2", None, [1], [], True)])["lora"] is None
