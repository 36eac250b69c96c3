"""`kvserve serve --kv-events-config ...`: a pyzmq + msgpack subscriber (tests/kv_event_subscriber.py,
written as llm-d's reader is) follows a real server: every batch decodes, sequence numbers are
gapless, the blocks of a chat's prompt (token ids from the server's own /tokenize) recompute to
published hashes, replay returns what the subscriber missed, /metrics counts the events, and a bad
config is a one-line start-up error."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TINY_ARGS, KVEventPorts, ServerProcess, running_server
from tests.kv_event_subscriber import CacheView, decode, low64, prompt_digests

BLOCK_SIZE = 16
TOPIC = "kv@e2e@tiny"


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, kv_event_ports: KVEventPorts
) -> Iterator[ServerProcess]:
    args = [*TINY_ARGS, *kv_event_ports.server_args(topic=TOPIC)]
    log = tmp_path_factory.mktemp("kv_events") / "server.log"
    with running_server(tiny_llama_dir, args, log) as server:
        yield server


def test_a_subscriber_follows_a_real_server(
    server: ServerProcess, kv_event_ports: KVEventPorts
) -> None:
    sub = kv_event_ports.subscriber(topic="kv@")
    try:
        sub.poll(0.5)
        messages = [
            {"role": "system", "content": "You answer questions about harbours. " * 6},
            {"role": "user", "content": "How many bridges does Port Ellis have?"},
        ]
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        tokens = httpx.post(
            server.url + "/tokenize", json={"model": model, "messages": messages}, timeout=30
        ).json()["tokens"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(sub.received) < 2:
            sub.poll(0.2)
        assert sub.received, server.log()[-2000:]
        assert sub.topics == {TOPIC.encode()}
        history = sub.replay(0)  # batch 0 (the start-up clear) came before we subscribed
        last = max(history)
        assert sorted(history) == list(range(last + 1)), "sequence numbers are gapless from 0"
        assert all(history[s] == p for s, p in sub.received.items())
        view = CacheView()
        for seq in range(last + 1):
            _, events, rank = decode(history[seq])
            assert rank == 0
            view.apply(events)  # every hash recomputes from its parent and token ids
        assert view.cleared == 1 and view.stored > 0
        prompt_hashes = [low64(d) for d in prompt_digests(tokens, BLOCK_SIZE)]
        assert prompt_hashes and set(prompt_hashes) <= view.held, (
            "the server holds every full block of the chat's prompt under the hash a router "
            "computes from the token ids"
        )
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert "kvserve_kv_events_published_total" in metrics
    finally:
        sub.close()


def test_a_bad_kv_events_config_is_a_one_line_start_up_error(tiny_llama_dir: Path) -> None:
    for bad in ('{"enable_kv_cache_events": true, "colour": "red"}', "{not json"):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "server",
                "serve",
                str(tiny_llama_dir),
                "--kv-events-config",
                bad,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode != 0
        assert "kv events config" in result.stderr and "Traceback" not in result.stderr
