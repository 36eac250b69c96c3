"""vLLM's request extras over the fake engine (no model): each maps onto the engine's params and
fields, or is a 400 naming the field; POST /reset_prefix_cache's switch; an adapter named like the
base model refused before any model loads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine import LoRAConfig
from server.cli import main
from server.settings import build_configs, check_lora_modules, resolve
from tests.unit.server_fakes import FakeEngine, FakeTokenizer, app_client, replica_sender

BOS = 1


class SaltRecordingEngine(FakeEngine):
    """Records the cache salt each engine request was given."""

    def __init__(self) -> None:
        super().__init__()
        self.salts: list[str | None] = []

    def generate(self, *args: Any, cache_salt: str | None = None, **kwargs: Any):  # type: ignore[override]
        self.salts.append(cache_salt)
        return super().generate(*args, **kwargs)


async def test_cache_salt_reaches_the_engine_from_completions_and_chat() -> None:
    engine = SaltRecordingEngine()
    async with app_client(engine) as c:
        body: dict[str, Any] = {"prompt": "abc", "max_tokens": 2, "cache_salt": "t1"}
        assert (await c.post("/v1/completions", json=body)).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "t2"}
        assert (await c.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (await c.post("/v1/completions", json={"prompt": "abc"})).status_code == 200
        bad = await c.post("/v1/completions", json={"prompt": "abc", "cache_salt": ""})
    assert engine.salts == ["t1", "t2", None]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


async def test_cache_salt_reaches_the_engine_from_responses_and_messages() -> None:
    engine = SaltRecordingEngine()
    async with app_client(engine) as c:
        responses = {"input": "hi", "max_output_tokens": 2, "cache_salt": "r1"}
        assert (await c.post("/v1/responses", json=responses)).status_code == 200
        messages = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "cache_salt": "m1",
        }
        assert (await c.post("/v1/messages", json=messages)).status_code == 200
        unsalted = {**messages, "cache_salt": None}
        assert (await c.post("/v1/messages", json=unsalted)).status_code == 200
        bad_responses = await c.post("/v1/responses", json={**responses, "cache_salt": ""})
        bad_messages = await c.post("/v1/messages", json={**messages, "cache_salt": ""})
    assert engine.salts == ["r1", "m1", None]
    assert bad_responses.status_code == 400
    assert bad_responses.json()["error"]["param"] == "cache_salt"
    assert bad_messages.status_code == 400  # Anthropic's envelope names the field in its message
    error = bad_messages.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("cache_salt")


async def test_guided_fields_become_the_constraint() -> None:
    engine = FakeEngine()
    async with app_client(engine) as c:
        for body, kind in (
            ({"guided_choice": ["a", "b"]}, "choice"),
            ({"guided_regex": "[0-9]+"}, "regex"),
            ({"guided_json": {"type": "object"}}, "json"),
            ({"guided_json": '{"type": "object"}', "guided_whitespace_pattern": " ?"}, "json"),
            ({"guided_grammar": 'root ::= "x"'}, "grammar"),
        ):
            r = await c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            constraint = engine.requests[-1][2].structured_outputs
            assert constraint is not None and constraint.kind == kind
            assert constraint.source == "guided_" + kind
        two = await c.post(
            "/v1/completions", json={"prompt": "abc", "guided_regex": "a", "guided_choice": ["b"]}
        )
        schema = await c.post("/v1/completions", json={"prompt": "abc", "guided_json": "{oops"})
        lone = await c.post(
            "/v1/completions", json={"prompt": "a", "guided_whitespace_pattern": " "}
        )
    assert two.status_code == 400 and two.json()["error"]["param"] == "guided_json"
    assert schema.status_code == 400 and schema.json()["error"]["param"] == "guided_json"
    assert lone.status_code == 400


async def test_prompt_logprobs_truncation_and_special_tokens_reach_the_params() -> None:
    engine = FakeEngine()
    async with app_client(engine) as c:
        r = await c.post(
            "/v1/completions",
            json={
                "prompt": "abcdef",
                "max_tokens": 1,
                "prompt_logprobs": 3,
                "truncate_prompt_tokens": 4,
            },
        )
        assert r.status_code == 200, r.text
        _, ids, params = engine.requests[-1]
        assert ids == list(b"cdef") and params.prompt_logprobs == 3
        assert r.json()["usage"]["prompt_tokens"] == 4
        assert "prompt_logprobs" in r.json()["choices"][0]
        streamed = await c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
                "prompt_logprobs": 1,
            },
        )
        too_long = await c.post(
            "/v1/completions",
            json={"prompt": "abc", "truncate_prompt_tokens": engine.max_model_len + 1},
        )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "truncate_prompt_tokens"


class BosTokenizer(FakeTokenizer):
    """Adds a BOS when asked for special tokens, as Llama's tokenizer does."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BOS, *text.encode()] if add_special_tokens else list(text.encode())


async def test_add_special_tokens_on_chat_is_off_by_default_as_in_vllm() -> None:
    engine = FakeEngine()
    engine.tokenizer = BosTokenizer()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    prompt = list(b"<user>hi<assistant>")
    async with app_client(engine) as c:
        for extra, want in (
            ({}, prompt),  # the template wrote the prompt: nothing on top of it
            ({"add_special_tokens": False}, prompt),
            ({"add_special_tokens": True}, [BOS, *prompt]),
        ):
            r = await c.post("/v1/chat/completions", json={**chat, **extra})
            assert r.status_code == 200, r.text
            assert engine.requests[-1][1] == want, extra
        completion = {"prompt": "hi", "max_tokens": 1}
        assert (await c.post("/v1/completions", json=completion)).status_code == 200
        assert engine.requests[-1][1] == [BOS, *b"hi"], "completions keep vLLM's default: on"
        bad = await c.post("/v1/chat/completions", json={**chat, "add_special_tokens": "yes"})
        counted = {}
        for extra in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
            r = await c.post("/tokenize", json={"messages": chat["messages"], **extra})
            assert r.status_code == 200, r.text
            counted[str(extra)] = r.json()["tokens"]
        text = {}
        for extra in ({}, {"add_special_tokens": False}):
            r = await c.post("/tokenize", json={"prompt": "hi", **extra})
            text[str(extra)] = r.json()["tokens"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
    # /tokenize counts what chat would run: messages as the template wrote them unless asked
    assert list(counted.values()) == [prompt, prompt, [BOS, *prompt]]
    assert list(text.values()) == [[BOS, *b"hi"], list(b"hi")]  # a prompt: on unless turned off


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", [1]),
        ("bad_words", ["x"]),
        ("priority", 1),
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("spaces_between_special_tokens", False),
        ("guided_decoding_backend", "outlines"),
        ("logits_processors", ["x"]),
        ("prompt_logprobs", 21),
    ],
)
async def test_fields_kvserve_cannot_honour_are_400s_naming_them(field: str, value: Any) -> None:
    async with app_client(FakeEngine()) as c:
        for path, body in (
            ("/v1/completions", {"prompt": "abc"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            r = await c.post(path, json={**body, field: value})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == field


async def test_reset_prefix_cache_needs_a_key_or_dev_mode() -> None:
    engine = FakeEngine()
    async with app_client(engine) as c:
        off = await c.post("/reset_prefix_cache")
    assert off.status_code == 404 and "--server-dev-mode" in off.json()["error"]["message"]
    async with app_client(engine, server_dev_mode=True) as c:
        assert (await c.post("/reset_prefix_cache")).status_code == 200
        engine.active.add("busy")
        busy = await c.post("/reset_prefix_cache")
        engine.active.clear()
        bad = await c.post("/reset_prefix_cache?reset_running_requests=true")
        junk = await c.post("/reset_prefix_cache?reset_external=maybe")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "requests_running"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_running_requests"
    assert junk.status_code == 400
    async with app_client(engine, api_key="k") as c:
        assert (await c.post("/reset_prefix_cache")).status_code == 401
        ok = await c.post("/reset_prefix_cache", headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200 and engine.num_resets == 3


async def test_a_reset_on_ray_serve_reaches_every_replica() -> None:
    from server.app import build_app
    from server.distributed.asgi_call import ForwardRequest
    from server.distributed.cache_reset import broadcast_cache_reset
    from server.state import ServerConfig

    engines = {r: FakeEngine() for r in ("r1", "r2", "r3")}
    apps = {r: build_app(ServerConfig(api_key="k"), e) for r, e in engines.items()}
    send = replica_sender(apps)
    key = [(b"authorization", b"Bearer k")]

    def reset(query: bytes = b"", headers: list[tuple[bytes, bytes]] = key) -> ForwardRequest:
        return ForwardRequest("POST", "/reset_prefix_cache", query, headers, b"")

    answer = await broadcast_cache_reset(reset(), list(apps), send)
    assert answer.status == 200 and answer.body == b""
    assert [e.num_resets for e in engines.values()] == [1, 1, 1]
    # Refused alike everywhere: that refusal, as one server gives it.
    unauthorized = await broadcast_cache_reset(reset(headers=[]), list(apps), send)
    assert unauthorized.status == 401
    external = await broadcast_cache_reset(reset(b"reset_external=true"), list(apps), send)
    assert (
        external.status == 400 and json.loads(external.body)["error"]["param"] == "reset_external"
    )
    # A busy replica: the others reset, and the 409 names who did what.
    engines["r2"].active.add("running")
    busy = await broadcast_cache_reset(reset(), list(apps), send)
    error = json.loads(busy.body)["error"]
    assert busy.status == 409 and error["code"] == "requests_running"
    assert "replica r2 refused" in error["message"] and "reset on r1, r3" in error["message"]
    assert [e.num_resets for e in engines.values()] == [2, 2, 2]
    assert (await broadcast_cache_reset(reset(), [], send)).status == 503


def test_dev_mode_reads_vllms_variable() -> None:
    assert resolve({}, environ={"VLLM_SERVER_DEV_MODE": "1"})["server_dev_mode"] is True
    assert resolve({}, environ={})["server_dev_mode"] is False
    values = resolve({}, environ={"VLLM_SERVER_DEV_MODE": "1", "KVSERVE_SERVER_DEV_MODE": "0"})
    assert build_configs(values)[1].server_dev_mode is False


def test_an_adapter_named_like_the_base_model_fails_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    with pytest.raises(ValueError, match="the base model's id"):
        check_lora_modules(LoRAConfig(modules=(("smol", str(tmp_path)),)), "smol")
    model = tmp_path / "mymodel"  # an empty folder, never read: the names are checked first
    model.mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(model), "--lora-modules", f"mymodel={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "base model's id" in err[0]
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(model), "--served-model-name", "m", "--lora-modules", f"m={tmp_path}"])
    assert exit_.value.code == 2 and "base model's id" in capsys.readouterr().err
