"""kvserve on a local Ray cluster: `kvserve serve --replicas 2` (one thread each) driven through
Ray Serve's HTTP proxy with the openai SDK and httpx; prefix affinity, spreading, the updates sent to
every replica (LoRA adapters, a prefix-cache reset), replica death."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'kvserve[ray]'")

from engine.faults import FAULT_INJECTION_ENV, SLOW_STEPS  # noqa: E402
from tests.e2e.conftest import ServerProcess  # noqa: E402

API_KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ARGS = [
    "--replicas", "2", "--threads", "1", "--replica-cpus", "0.5", "--api-key", API_KEY,
    "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256",
    "--max-num-seqs", "4", "--max-queued-requests", "4", "--log-level", "warning", "--log-stats-interval", "0",
]  # fmt: skip


def replicas(server: ServerProcess) -> list[dict]:
    return httpx.get(server.url + "/v1/internal/replicas", headers=AUTH, timeout=30).json()["data"]


def wait_replicas(server: ServerProcess, count: int, timeout: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout
    found: list[dict] = []
    while time.monotonic() < deadline:
        found = replicas(server)
        if len(found) == count:
            return found
        time.sleep(1)
    raise AssertionError(f"expected {count} replicas, found {found}:\n{server.log()[-3000:]}")


def running_requests(replica: dict) -> float:
    """Requests the replica's engine is running now, as its own /metrics says."""
    text = httpx.get(replica["url"] + "/metrics", headers=AUTH, timeout=10).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^kvserve_num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    )


def served_requests(replica: dict) -> float:
    """Finished requests as the replica's own /metrics counts them."""
    text = httpx.get(replica["url"] + "/metrics", headers=AUTH, timeout=10).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^kvserve_request_success_total\{[^}]*\} (\S+)$", text, re.M)
    )


@pytest.fixture(scope="module")
def ray_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # fault injection: the killed-replica test's streams are slowed (KVSERVE_FAULT:slow) so that
    # they are surely running when it kills their replica, however fast the machine decodes
    env = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", FAULT_INJECTION_ENV: "1"}
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    server = ServerProcess(tiny_llama_dir, ARGS, log, env=env)
    try:
        server.wait_ready()
        wait_replicas(server, 2)
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(ray_server: ServerProcess):
    import openai

    return openai.OpenAI(
        base_url=ray_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


def model_id(client) -> str:
    return client.models.list().data[0].id


def test_openai_sdk_through_the_ingress(ray_server: ServerProcess, client) -> None:
    import openai

    model = model_id(client)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=4)
    assert completion.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Stream please"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Errors, API key and health come from the same server code as `kvserve serve`.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert bad.value.body is not None and "max_tokens" in str(bad.value.body)
    unauthorized = httpx.get(ray_server.url + "/v1/models", timeout=30)
    assert unauthorized.status_code == 401 and "error" in unauthorized.json()
    assert httpx.get(ray_server.url + "/health", timeout=30).status_code == 200


def test_shared_prefixes_stick_to_the_replica_holding_them(ray_server, client) -> None:
    model = model_id(client)
    topics = ["astronomy", "gardening", "railways", "chemistry"]
    prefixes = [
        f"You are an expert on {topic}. "
        + " ".join(f"{topic} fact {i} is notable." for i in range(40))
        for topic in topics
    ]
    prefix_tokens = [
        httpx.post(
            ray_server.url + "/tokenize", json={"prompt": p}, headers=AUTH, timeout=30
        ).json()["count"]
        for p in prefixes
    ]

    def ask(prefix: str, question: int) -> int:
        out = client.completions.create(
            model=model, prompt=f"{prefix} Question {question}: why?", max_tokens=2
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    for p in prefixes:  # the first request of each prefix fills some replica's cache
        ask(p, 0)
    cached: list[list[int]] = [[] for _ in prefixes]
    with ThreadPoolExecutor(4) as pool:
        for question in range(1, 4):  # rounds of one request per prefix, concurrently
            asked = pool.map(ask, prefixes, [question] * len(prefixes))
            for i, got in enumerate(asked):
                cached[i].append(got)
    for i, n in enumerate(prefix_tokens):
        covered = (n - 1) // 16 * 16  # whole KV blocks of the shared prefix
        assert all(c >= covered for c in cached[i]), (topics[i], n, cached[i])


def test_routing_follows_the_replicas_kv_events_not_the_prompt_text(ray_server, client) -> None:
    """A prompt sent as token ids has no text in common with its earlier text form, so only the
    replicas' KV events (each replica lists its publisher) can send it to the replica holding it."""
    from tests.kv_event_subscriber import Subscriber

    model = model_id(client)
    found = wait_replicas(ray_server, 2)
    assert all(r["kv_events"]["endpoint"].startswith("tcp://") for r in found)
    sub = Subscriber(found[0]["kv_events"]["endpoint"], found[0]["kv_events"]["replay_endpoint"])
    try:
        assert sub.replay(0), "a replica publishes its KV events"
    finally:
        sub.close()
    for i in range(6):
        text = f"Token routing case {i}. " + " ".join(f"item {i}-{j} is listed." for j in range(30))
        ids = httpx.post(
            ray_server.url + "/tokenize", json={"prompt": text}, headers=AUTH, timeout=30
        ).json()["tokens"]
        client.completions.create(model=model, prompt=text, max_tokens=1)  # some replica holds it
        time.sleep(1.0)  # its events reach the router (a margin, not a measurement)
        out = client.completions.create(model=model, prompt=ids + [13, 13], max_tokens=1)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        covered = len(ids) // 16 * 16
        assert (out.usage.prompt_tokens_details.cached_tokens or 0) >= covered, (i, len(ids))


def test_distinct_prompts_are_served_by_both_replicas(ray_server, client) -> None:
    model = model_id(client)
    found = wait_replicas(ray_server, 2)
    before = [served_requests(r) for r in found]
    words = ["apple", "river", "cobalt", "tiger", "violin", "meadow", "quartz", "harbor"]
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda i: client.completions.create(
                    model=model, prompt=f"{words[i % 8]} {i} " * 20, max_tokens=8
                ),
                range(16),
            )
        )
    after = [served_requests(r) for r in found]
    gained = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(gained) == 16 and all(g > 0 for g in gained), gained


def test_a_replicas_429_reaches_the_client_with_retry_after(ray_server, client) -> None:
    model = model_id(client)
    body = {"model": model, "prompt": "flood", "max_tokens": 60, "ignore_eos": True}

    def post(i: int) -> httpx.Response:
        payload = {**body, "prompt": f"flood {i}"}
        return httpx.post(
            ray_server.url + "/v1/completions", json=payload, headers=AUTH, timeout=120
        )

    with ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(post, range(32)))
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected and any(r.status_code == 200 for r in responses)
    assert all(r.status_code in (200, 429) for r in responses)
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"]


def replica_models(replica: dict) -> list[str]:
    models = httpx.get(replica["url"] + "/v1/models", headers=AUTH, timeout=30).json()["data"]
    return [m["id"] for m in models]


def test_a_lora_load_or_unload_reaches_every_replica(
    ray_server, client, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    import openai

    pytest.importorskip("peft")
    from tests.model.lora_adapters import make_adapter

    model = model_id(client)
    adapter = str(make_adapter(tiny_llama_dir, tmp_path / "sql", rank=4, seed=1))
    found = wait_replicas(ray_server, 2)

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(ray_server.url + path, json=body, headers=AUTH, timeout=120)

    r = post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": adapter})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert all(replica_models(rep) == [model, "sql"] for rep in found)
    for i in range(4):  # whichever replica the router picks serves it
        out = client.completions.create(model="sql", prompt=f"query {i} " * 8, max_tokens=3)
        assert out.model == "sql"
    bad = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    # One replica already serves "solo": the other's load is undone, and the answer says which.
    solo = {"lora_name": "solo", "lora_path": adapter}
    direct = httpx.post(found[0]["url"] + "/v1/load_lora_adapter", json=solo, headers=AUTH)
    assert direct.status_code == 200
    r = post("/v1/load_lora_adapter", solo)
    assert r.status_code == 400 and found[0]["replica_id"] in r.json()["error"]["message"]
    assert [replica_models(rep) for rep in found] == [[model, "sql", "solo"], [model, "sql"]]
    assert post("/v1/unload_lora_adapter", {"lora_name": "solo"}).status_code == 200
    # A replica Ray starts later (here: after a crash) loads the adapters loaded at run time.
    victim = found[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        found = replicas(ray_server)
        restored = len(found) == 2 and victim not in {rep["pid"] for rep in found}
        if restored and all(replica_models(rep) == [model, "sql"] for rep in found):
            break
        time.sleep(2)
    else:
        raise AssertionError(f"no restored replica serving the adapter: {replicas(ray_server)}")
    r = post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert all(replica_models(rep) == [model] for rep in found)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt="x", max_tokens=1)
    assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404


def test_a_prefix_cache_reset_reaches_every_replica(ray_server, client) -> None:
    model = model_id(client)
    found = wait_replicas(ray_server, 2)
    prompt = "reset on every replica: " + "the boats come home at dusk " * 8

    def cached(replica: dict) -> int:
        """The prompt's cached tokens on this replica (asked on its own port, not routed)."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        r = httpx.post(replica["url"] + "/v1/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    for replica in found:
        cached(replica)
    assert all(cached(replica) > 0 for replica in found)
    url = ray_server.url + "/reset_prefix_cache"
    assert httpx.post(url, timeout=60).status_code == 401  # every replica asks for the key
    deadline = time.monotonic() + 30
    while (r := httpx.post(url, headers=AUTH, timeout=120)).status_code == 409:
        assert time.monotonic() < deadline, r.text  # a finished request's blocks not yet freed
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert all(cached(replica) == 0 for replica in found), "every replica's cache was emptied"


def test_killed_replica_fails_its_requests_and_ray_restores_it(ray_server, client) -> None:
    model = model_id(client)
    found = wait_replicas(ray_server, 2)
    # 4 streams: even all on one replica they run at once (--max-num-seqs 4), so every stream has
    # its first token before the kill (a 5th, queued, would get it only after the others finished)
    streams = 4
    started = threading.Barrier(streams + 1)
    results: list[tuple[str, str]] = []

    def stream(i: int) -> None:
        body = {
            "model": model,
            "prompt": f"{SLOW_STEPS} story number {i} about " + "a distant land " * (i + 1),
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        released = False
        try:
            with httpx.stream(
                "POST", ray_server.url + "/v1/completions", json=body, headers=AUTH, timeout=120
            ) as r:
                status = r.status_code
                for line in r.iter_lines():
                    if not released:
                        released = True
                        started.wait(60)
                    text += line + "\n"
            if not released:
                started.wait(60)
            results.append(("done" if status == 200 and "[DONE]" in text else "error", text))
        except httpx.HTTPError as e:
            results.append(("error", repr(e)))
        finally:
            if not released:
                with __import__("contextlib").suppress(threading.BrokenBarrierError):
                    started.wait(1)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream is under way
    # The replica running most of them (the router may have sent them all to one; the tiny model's
    # streams that started first may be over already)
    running = [running_requests(r) for r in found]
    victim = found[running.index(max(running))]
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    outcomes = [o for o, _ in results]
    assert "error" in outcomes, (outcomes, running)  # the victim's streams fail, with its error
    if min(running):  # and the other replica's finish
        assert "done" in outcomes, (outcomes, running)
    for outcome, text in results:
        if outcome == "error":
            assert "replica" in text, text[-500:]
    # The other replica keeps serving while Ray replaces the dead one.
    ok = 0
    for i in range(4):
        try:
            client.completions.create(model=model, prompt=f"after the crash {i}", max_tokens=2)
            ok += 1
        except Exception:  # noqa: BLE001 - at most the first one may meet the dead replica
            pass
    assert ok >= 3
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = replicas(ray_server)
        if len(now) == 2 and victim["pid"] not in {r["pid"] for r in now}:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"Ray did not restore 2 replicas: {replicas(ray_server)}")
    client.completions.create(model=model, prompt="back to two", max_tokens=2)
