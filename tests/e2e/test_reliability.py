"""Reliability against real server processes: overload gets 429 + Retry-After while admitted requests
finish intact; an injected fault fails only its request; a dead engine fails waiters and /health;
vanished clients and preemption leak no KV block; the API key, CORS, body cap and quiet logs hold."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.faults import ENGINE_DEATH, FAULT_INJECTION_ENV, NAN_LOGITS
from tests.e2e.conftest import TINY_ARGS, ServerProcess

KEY = "rel-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
QUEUE = 4  # --max-queued-requests
GUARDED_ARGS = [
    *TINY_ARGS, "--max-queued-requests", str(QUEUE), "--max-num-seqs", "2", "--api-key", KEY,
    "--allowed-origins", ORIGIN, "--max-request-body-bytes", "64KiB", "--log-level", "info",
]  # fmt: skip


def _greedy(prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


@pytest.fixture(scope="module")
def guarded(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Small queue, two running sequences, API key, CORS origin, 64 KiB bodies, INFO logs, faults on."""
    log = tmp_path_factory.mktemp("logs") / "guarded.log"
    server = ServerProcess(tiny_llama_dir, GUARDED_ARGS, log, {FAULT_INJECTION_ENV: "1"})
    server.wait_ready()
    yield server
    server.stop()


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _sse(r: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]


# ----------------------------------------------------------------------------- bounded admission


def test_burst_beyond_the_queue_gets_429_and_every_admitted_request_is_intact(
    guarded: ServerProcess,
) -> None:
    bodies = [_greedy(f"Request {i} says", max_tokens=8) for i in range(30)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=guarded.url, headers=AUTH, timeout=120, limits=httpx.Limits(max_connections=64)
        ) as client:
            return list(
                await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
            )

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    refused = [r for r in responses if r.status_code == 429]
    admitted = [(b, r) for b, r in zip(bodies, responses, strict=True) if r.status_code == 200]
    assert refused, "a burst of 30 against 2 running + 4 queued was never refused"
    assert admitted
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert err["message"]
    guarded.wait_idle(AUTH)
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        for body, r in admitted:
            alone = client.post("/v1/completions", json=body)
            assert _text(r) == _text(alone)
            assert r.json()["usage"]["completion_tokens"] == 8


# ------------------------------------------------------------------------------ fault isolation


def test_a_nan_fault_fails_only_its_request(guarded: ServerProcess) -> None:
    normal = [_greedy("The quick brown fox", 16), _greedy("In a land far away", 16)]
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=120) as client:
        expected = [_text(client.post("/v1/completions", json=b)) for b in normal]

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client:
            first = asyncio.ensure_future(client.post("/v1/completions", json=normal[0]))
            while guarded.stats(AUTH)["num_running"] == 0 and not first.done():
                await asyncio.sleep(0.01)
            faulty = _greedy(NAN_LOGITS + " and then", 16)
            rest = [
                client.post("/v1/completions", json=faulty),
                client.post("/v1/completions", json=normal[1]),
                client.post("/v1/completions", json={**faulty, "stream": True}),
            ]
            return [await first, *await asyncio.gather(*rest)]

    first, faulty, second, faulty_stream = asyncio.run(together())
    assert [_text(first), _text(second)] == expected
    assert faulty.status_code == 500
    err = faulty.json()["error"]
    assert err["type"] == "server_error" and "non-finite" in err["message"]
    # The stream had started (200, some text) when the fault hit: it ends with an error event.
    assert faulty_stream.status_code == 200
    events = _sse(faulty_stream)
    assert "[DONE]" not in events
    assert json.loads(events[0])["choices"][0]["text"]
    assert json.loads(events[-1])["error"]["type"] == "server_error"
    assert httpx.get(guarded.url + "/health").status_code == 200
    stats = guarded.wait_idle(AUTH)
    assert stats["num_unfinished_requests"] == 0
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        assert _text(client.post("/v1/completions", json=normal[0])) == expected[0]


def test_a_dead_engine_fails_waiting_clients_and_health(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = ServerProcess(
        tiny_llama_dir, TINY_ARGS, tmp_path / "dead.log", {FAULT_INJECTION_ENV: "1"}
    )
    try:
        server.wait_ready()

        async def scenario() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                events: list[str] = []

                async def stream() -> None:
                    body = _greedy("Once upon a time", 240, stream=True)
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[len("data: ") :])

                reader = asyncio.ensure_future(stream())
                while not events:
                    await asyncio.sleep(0.01)
                killer = await client.post("/v1/completions", json=_greedy(ENGINE_DEATH, 4))
                await asyncio.wait_for(reader, timeout=60)  # the stream ends: it does not hang
                return events, killer

        events, killer = asyncio.run(scenario())
        assert killer.status_code == 503 and killer.json()["error"]["code"] == "service_unavailable"
        assert json.loads(events[-1])["error"]["code"] == "service_unavailable"
        assert "[DONE]" not in events
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        late = httpx.post(server.url + "/v1/completions", json=_greedy("hello", 2), timeout=30)
        assert late.status_code == 503 and "engine" in late.json()["error"]["message"]
        assert server.proc.poll() is None, "the process must stay up to answer /health"
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------- leaks


def test_100_clients_vanishing_mid_stream_leave_the_pool_free(tiny_server: ServerProcess) -> None:
    before = tiny_server.wait_idle()["num_generation_tokens"]
    max_tokens = 200
    finished: list[int] = []  # completion tokens of non-streaming requests that beat their timeout

    async def vanish(client: httpx.AsyncClient, i: int) -> int:
        body = _greedy(f"Client {i} writes", max_tokens, stream=i % 4 != 0)
        if not body["stream"]:  # a non-streaming client that hangs up while waiting
            # On a fast machine a request may finish before its client gives up: that is no leak,
            # and its tokens are taken out of the run-on bound below.
            try:
                r = await client.post("/v1/completions", json=body, timeout=0.1 + 0.005 * i)
                finished.append(r.json()["usage"]["completion_tokens"])
            except httpx.TimeoutException:
                pass
            return 0
        seen = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 1 + i % 3:
                    break  # leaving the block closes the connection mid-stream
        return seen

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120, limits=limits) as c:
            return list(await asyncio.gather(*(vanish(c, i) for i in range(100))))

    seen = asyncio.run(run())
    assert sum(1 for s in seen if s) == 75
    stats = tiny_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == stats["num_unfinished_requests"] == 0
    generated = stats["num_generation_tokens"] - before - sum(finished)
    assert len(finished) < 25, "no non-streaming client hung up: the test measured nothing"
    assert generated < 100 * max_tokens / 4, f"aborted requests ran on ({generated} tokens)"
    # The server is still fine.
    r = httpx.post(tiny_server.url + "/v1/completions", json=_greedy("after", 4), timeout=60)
    assert r.status_code == 200


@pytest.fixture(scope="module")
def smol_tiny_pool(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # 6 blocks x 16 tokens: two or three of the requests below fit at a time, and they outgrow it.
    args = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "1024", "--num-kv-blocks", "6",
            "--max-num-seqs", "8", "--served-model-name", "smol", "--log-level", "warning"]  # fmt: skip
    server = ServerProcess(smollm2_dir, args, tmp_path_factory.mktemp("logs") / "smol_tiny.log")
    server.wait_ready()
    yield server
    server.stop()


def test_greedy_outputs_under_heavy_preemption_equal_a_large_pool(
    smol_server: ServerProcess, smol_tiny_pool: ServerProcess
) -> None:
    prompts = [
        "The capital of France is",
        "Water boils at a temperature of",
        "The largest planet in our solar system is",
        "A haiku about autumn:",
        "def fibonacci(n):",
        "The three primary colors are",
    ]
    bodies = [{**_greedy(p, 20), "model": "smol"} for p in prompts]

    async def all_at_once(server: ServerProcess) -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        return [_text(r) for r in rs]

    before = smol_tiny_pool.wait_idle()["num_preemptions"]
    small = asyncio.run(all_at_once(smol_tiny_pool))
    stats = smol_tiny_pool.wait_idle()
    assert stats["num_preemptions"] - before >= len(prompts) / 2, (
        "the pool did not force preemption"
    )
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 6
    large = asyncio.run(all_at_once(smol_server))
    assert small == large
    assert all(small)


# -------------------------------------------------------------------------------------- security


def test_api_key_guards_every_route_but_health(guarded: ServerProcess) -> None:
    assert httpx.get(guarded.url + "/health").status_code == 200
    routes = [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/version"),
        ("GET", "/metrics"),
        ("GET", "/v1/internal/stats"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
    ]
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer " + KEY[:-1]}, {"Authorization": KEY}):
                r = client.request(method, path, headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/openapi.json", headers=AUTH).status_code == 200
        assert client.get("/metrics", headers=AUTH).status_code == 200


def test_cors_only_for_the_configured_origin(
    guarded: ServerProcess, tiny_server: ServerProcess
) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(guarded.url + "/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(guarded.url + "/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(guarded.url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    # Without --allowed-origins there is no CORS at all.
    r = httpx.options(tiny_server.url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(tiny_server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_body_cap_holds_without_content_length(guarded: ServerProcess) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}'

    r = httpx.post(
        guarded.url + "/v1/completions",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
        timeout=30,
    )
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert _text(
        httpx.post(guarded.url + "/v1/completions", json=_greedy("ok", 2), headers=AUTH, timeout=60)
    )


def test_prompts_and_outputs_stay_out_of_the_logs(guarded: ServerProcess) -> None:
    marker = f"zebra{uuid.uuid4().hex}"
    with httpx.Client(base_url=guarded.url, headers=AUTH, timeout=60) as client:
        out = client.post("/v1/completions", json=_greedy(f"{marker} says", 6, echo=True))
        assert marker in _text(out)  # echoed back to the client, never to the log
        chat = {"messages": [{"role": "user", "content": marker}], "max_tokens": 4}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        stream = client.post("/v1/completions", json=_greedy(marker, 4, stream=True))
        assert stream.status_code == 200
        # Refusals carry the request to the log only as counts, never as text.
        too_long = client.post("/v1/completions", json=_greedy(marker * 200, 4))
        assert too_long.status_code == 400
        stop = client.post(
            "/v1/completions", json=_greedy("x", 4, stop=[marker], logit_bias={marker: 1})
        )
        assert stop.status_code == 400
        assert client.post("/tokenize", json={"prompt": marker}).status_code == 200
    time.sleep(0.5)  # let the log lines of those requests land
    log = guarded.log()
    assert "uvicorn.access" in log or "INFO" in log, "the server did not log at INFO"
    assert marker not in log
