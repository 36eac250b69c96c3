"""Client disconnects free the KV pool; API key and body cap; SIGTERM drains and exits 0; SmolLM2 text."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import TINY_ARGS, ServerProcess

# Near the 256-token limit, so a request that is not aborted visibly runs on.
LONG = {"prompt": "Once upon a time", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def test_stream_disconnect_aborts_and_frees_blocks(tiny_server: ServerProcess) -> None:
    before = tiny_server.wait_idle()["num_generation_tokens"]
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", tiny_server.url + "/v1/completions", json={**LONG, "stream": True}
        ) as r:
            lines = r.iter_lines()
            got = [
                line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")
            ]
            assert got, "the stream produced no chunks"
            assert tiny_server.stats()["num_running"] == 1
    # The connection is closed mid-stream: the engine must abort it and give all blocks back.
    stats = tiny_server.wait_idle()
    assert stats["num_generation_tokens"] - before < LONG["max_tokens"], "the request ran on"


def test_non_stream_disconnect_aborts(tiny_server: ServerProcess) -> None:
    before = tiny_server.wait_idle()["num_generation_tokens"]
    body = json.dumps(LONG).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", tiny_server.port))
    sock.sendall(head.encode() + body)
    deadline = time.monotonic() + 60
    while tiny_server.stats()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    sock.close()  # gone before any response: the server must notice without writing anything
    stats = tiny_server.wait_idle()
    assert stats["num_generation_tokens"] - before < LONG["max_tokens"], "the request ran on"


@pytest.fixture(scope="module")
def keyed_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {"KVSERVE_API_KEY": "s3cret", "KVSERVE_MAX_REQUEST_BODY_BYTES": "64KiB"}
    server = ServerProcess(
        tiny_llama_dir, TINY_ARGS, tmp_path_factory.mktemp("logs") / "keyed.log", env
    )
    server.wait_ready()
    yield server
    assert server.stop() == 0


def test_api_key_from_env(keyed_server: ServerProcess) -> None:
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    r = httpx.get(keyed_server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0
        ).models.list()
    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="s3cret", max_retries=0)
    model = client.models.list().data[0].id
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices
    big = httpx.post(
        keyed_server.url + "/v1/completions",
        json={"prompt": "x" * 70_000},
        headers={"Authorization": "Bearer s3cret"},
    )
    assert big.status_code == 413 and "error" in big.json()


def test_sigterm_drains_in_flight_requests_then_exits_0(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    server = ServerProcess(
        tiny_llama_dir, [*TINY_ARGS, "--shutdown-timeout", "60"], tmp_path / "term.log"
    )
    try:
        server.wait_ready()
        frames: list[str] = []

        def stream() -> None:
            body = {**LONG, "max_tokens": 60, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                frames.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        while server.stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = None
        try:
            refused = httpx.post(
                server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10
            )
        except httpx.TransportError:
            pass  # the listener may already be closed when the stream finished very fast
        if refused is not None:
            assert (
                refused.status_code == 503
                and refused.json()["error"]["code"] == "service_unavailable"
            )
        reader.join(timeout=120)
        assert server.proc.wait(timeout=60) == 0
        assert frames[-1] == "data: [DONE]", "the in-flight stream was cut off"
        chunks = [json.loads(f[6:]) for f in frames[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("drain_seconds", "signals", "why"),
    [("0", 1, "shutdown timeout"), ("60", 2, "second SIGTERM")],
    ids=["drain-time-ran-out", "second-signal"],
)
def test_shutdown_ends_running_requests_in_their_api_s_error(
    tiny_llama_dir: Path, tmp_path: Path, drain_seconds: str, signals: int, why: str
) -> None:
    """When the drain time runs out (or a second signal cuts it short), in-flight requests end as
    failures of their own API (a stream's in-band error event, a whole response's 503) and their
    engine work stops; a watched /engine page does not hold the shutdown; the process exits 0
    without a traceback."""
    log = tmp_path / "drain.log"
    # Requests as long as the model allows (500 tokens; the later flags win).
    longer = ["--max-model-len", "512", "--num-kv-blocks", "128", "--shutdown-timeout"]
    server = ServerProcess(tiny_llama_dir, [*TINY_ARGS, *longer, drain_seconds], log)
    long = {**LONG, "max_tokens": 500}
    try:
        server.wait_ready()
        frames: list[str] = []
        whole: list[httpx.Response] = []
        page_lines: list[str] = []

        def stream() -> None:
            body = {**long, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                frames.extend(line for line in r.iter_lines() if line)

        def post() -> None:
            whole.append(httpx.post(server.url + "/v1/completions", json=long, timeout=120))

        def page() -> None:
            with httpx.stream("GET", server.url + "/engine/stream", timeout=120) as r:
                page_lines.extend(r.iter_lines())

        threads = [threading.Thread(target=f) for f in (stream, post, page)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while server.stats()["num_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        if signals == 2:
            time.sleep(0.05)  # two signals, not one merged pending signal
            server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        assert server.proc.wait(timeout=60) == 0
        error = json.loads(frames[-1][6:])["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        assert whole[0].status_code == 503
        assert whole[0].json()["error"]["code"] == "service_unavailable"
        assert page_lines, "the /engine feed sent nothing"
        text = log.read_text()
        assert "Traceback" not in text and "Exception in ASGI application" not in text
        assert re.search(why + r": ending \d request\(s\) \(2 in the engine\)", text)
    finally:
        server.stop()


def test_smollm2_answers_sensibly(smol_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].id == "smol"
    out = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert "Paris" in out.choices[0].text
    chat = client.chat.completions.create(
        model="smol",
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one word."}
        ],
        max_tokens=10,
        temperature=0,
    )
    assert "Paris" in (chat.choices[0].message.content or "")


def test_default_server_greedy_chat_is_the_same_alone_and_concurrent(
    smol_server: ServerProcess,
) -> None:
    """16 concurrent greedy chats on the real model with default settings answer exactly as each
    does alone (batch composition must not change greedy output)."""
    topics = ["cats", "rivers", "bread", "trains", "stars", "chess", "rain", "music",
              "bees", "glass", "maps", "tea", "snow", "bridges", "owls", "paper"]  # fmt: skip

    async def one(client: openai.AsyncOpenAI, topic: str) -> str:
        out = await client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": f"Write one sentence about {topic}."}],
            max_tokens=24,
            temperature=0,
        )
        return out.choices[0].message.content or ""

    async def run_all() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0)
        alone = [await one(client, t) for t in topics]
        together = await asyncio.gather(*(one(client, t) for t in topics))
        await client.close()
        return alone, list(together)

    alone, together = asyncio.run(run_all())
    assert all(alone)
    assert together == alone


def test_sigterm_while_the_model_loads_exits_0(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A stop during start-up (an orchestrator that gives up on a starting pod) is a clean exit 0,
    not the C++ abort of tearing down the interpreter under the loading thread."""
    log = tmp_path / "load.log"
    server = ServerProcess(tiny_llama_dir, [*TINY_ARGS, "--log-level", "info"], log)
    try:
        deadline = time.monotonic() + 120
        while "loading model" not in server.log() and time.monotonic() < deadline:
            assert server.proc.poll() is None, server.log()
            time.sleep(0.02)
        time.sleep(0.3)  # into the load
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log()
    finally:
        server.stop()
