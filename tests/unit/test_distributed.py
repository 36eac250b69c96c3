"""The Ray-free parts of kvserve on Ray Serve: routing text, prefix index, settings, ASGI calls."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from server.distributed.asgi_call import ForwardRequest, ResponseStart, call_asgi
from server.distributed.config import RayConfig
from server.distributed.prefix_index import (
    PrefixIndex,
    block_hashes,
    routing_model,
    routing_salt,
    routing_text,
)
from server.settings import build_configs, build_ray_config, resolve


def chat(*messages: tuple[str, str]) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    ).encode()


def test_a_later_chat_turn_extends_the_routing_text_of_the_earlier_one() -> None:
    first = routing_text("/v1/chat/completions", chat(("system", "S" * 90), ("user", "hi")))
    second = routing_text(
        "/v1/chat/completions",
        chat(("system", "S" * 90), ("user", "hi"), ("assistant", "hello"), ("user", "more")),
    )
    assert second.startswith(first) and len(second) > len(first)
    parts = json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    ).encode()
    assert "abc" in routing_text("/v1/chat/completions", parts)


def test_routing_text_of_completions_and_bad_bodies() -> None:
    assert routing_text("/v1/completions", b'{"prompt": "hello world"}') == "hello world"
    assert routing_text("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1 2 3 "
    assert routing_text("/v1/completions", b"not json") == ""
    assert routing_text("/v1/completions", b"[1, 2]") == ""


def test_block_hashes_are_chained_over_whole_blocks() -> None:
    a = block_hashes("x" * 64 + "y" * 64 + "tail", 64)
    b = block_hashes("x" * 64 + "z" * 64, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_hashes("short", 64) == []
    # The same block after a different prefix hashes differently.
    assert block_hashes("q" * 64 + "y" * 64, 64)[1] != a[1]


def test_prefix_index_matches_the_longest_prefix_and_forgets() -> None:
    index = PrefixIndex(max_blocks_per_replica=3)
    doc = block_hashes("d" * 64 * 3, 64)
    index.insert("r1", doc[:2])
    assert index.match("r1", doc) == 2 and index.match("r2", doc) == 0
    index.insert("r1", block_hashes("e" * 64 * 2, 64))  # over the bound: the oldest goes
    assert index.match("r1", doc) == 0
    index.retain(["r2"])
    assert index.match("r1", block_hashes("e" * 128, 64)) == 0


def test_a_cache_salt_roots_the_routed_text_apart() -> None:
    body = json.dumps({"prompt": "hello", "cache_salt": "tenant-a"}).encode()
    assert routing_salt(body) == "tenant-a"
    for no_salt in (b'{"prompt": "x"}', b'{"cache_salt": ""}', b'{"cache_salt": 3}', b"[1]", b"{"):
        assert routing_salt(no_salt) is None, no_salt  # the replica refuses a bad one itself
    text = "t" * 64 * 3
    plain, a, b = (block_hashes(text, 64, salt) for salt in (None, "a", "b"))
    assert len(plain) == len(a) == len(b) == 3
    assert not set(plain) & set(a) and not set(a) & set(b), "every block hashes apart"
    assert block_hashes(text, 64, "a") == a
    index = PrefixIndex()
    index.insert("r1", a)
    assert index.match("r1", a) == 3 and index.match("r1", b) == 0 and index.match("r1", plain) == 0


def test_the_router_hashes_a_salted_request_as_the_engine_does() -> None:
    from engine import cache_namespace, external_block_hashes
    from server.distributed.kv_index import KVIndex, ReplicaEvents, kv_matches

    tokens = list(range(100, 132))  # two blocks of 16
    index = KVIndex()
    for replica, salt in (("plain", None), ("salted", "tenant-a")):
        held = external_block_hashes(tokens, 16, cache_namespace(None, salt))
        index.apply(replica, [["BlockStored", held, None, tokens, 16, None, "GPU", None]])
    sources = {r: ReplicaEvents(r, "tcp://x", None, 16, "0") for r in ("plain", "salted")}
    replicas = list(sources)
    assert kv_matches(index, sources, replicas, tokens)[0] == {"plain": 2, "salted": 0}
    salted = kv_matches(index, sources, replicas, tokens, "tenant-a")
    assert salted == ({"plain": 0, "salted": 2}, 2)
    assert kv_matches(index, sources, replicas, tokens, "tenant-b")[0] == {"plain": 0, "salted": 0}


def test_an_adapters_requests_match_the_blocks_stored_under_that_adapter() -> None:
    from engine import cache_namespace, external_block_hashes
    from server.distributed.kv_index import KVIndex, ReplicaEvents, kv_matches

    tokens = list(range(200, 248))  # three blocks of 16
    index = KVIndex()
    lora_a, lora_b = "lora:" + "a" * 64, "lora:" + "b" * 64
    for replica, name, lora, salt in (
        ("base", None, None, None),
        ("sql", "sql", lora_a, None),
        ("sql-salted", "sql", lora_a, "t1"),
        ("chat", "chat", lora_b, None),
    ):
        namespace = cache_namespace(lora, salt)
        held = external_block_hashes(tokens, 16, namespace)
        extra = [[lora, salt] if salt else [lora], [lora], [lora]] if lora else None
        event = ["BlockStored", held, None, tokens, 16, None, "GPU", name, extra]
        index.apply(replica, [event if lora else event[:8]])
    names = ("base", "sql", "sql-salted", "chat")
    sources = {r: ReplicaEvents(r, "tcp://x", None, 16, "0") for r in names}
    replicas = list(sources)
    none = dict.fromkeys(replicas, 0)
    assert kv_matches(index, sources, replicas, tokens)[0] == {**none, "base": 3}
    assert kv_matches(index, sources, replicas, tokens, model="sql") == ({**none, "sql": 3}, 3)
    assert kv_matches(index, sources, replicas, tokens, model="base-id:sql")[0]["sql"] == 3
    salted = kv_matches(index, sources, replicas, tokens, "t1", model="sql")[0]
    assert salted == {**none, "sql-salted": 3}
    assert kv_matches(index, sources, replicas, tokens, model="chat")[0] == {**none, "chat": 3}
    # An adapter no replica stored blocks of yet (or the base model's id): the base model's blocks
    assert kv_matches(index, sources, replicas, tokens, model="new")[0] == {**none, "base": 3}
    # A reloaded adapter under the same name: its newest content counts
    moved = external_block_hashes(tokens, 16, lora_b)
    index.apply("sql", [["BlockStored", moved, None, tokens, 16, None, "GPU", "sql", [[lora_b]]]])
    assert index.adapter_namespace("sql", "sql") == lora_b
    index.forget("sql")
    assert index.adapter_namespace("sql", "sql") is None


def test_the_router_reads_the_salt_the_ingress_forwards() -> None:
    pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'kvserve[ray]'")
    from types import SimpleNamespace

    from server.distributed.router import _cache_salt, _model, _text_hashes

    text = "u" * 128
    forward = ForwardRequest("POST", "/v1/chat/completions", b"", [], b"", routing_text=text)
    salted = SimpleNamespace(args=[dataclasses.replace(forward, cache_salt="s1")])
    plain = SimpleNamespace(args=[forward])  # a PendingRequest's args: the forwarded request
    assert _cache_salt(salted) == "s1" and _cache_salt(plain) is None
    adapter = SimpleNamespace(args=[dataclasses.replace(forward, model="sql")])
    assert _model(adapter) == "sql" and _model(plain) is None
    assert routing_model(b'{"model": "sql", "prompt": "x"}') == "sql"
    assert routing_model(b'{"model": 3}') is None and routing_model(b"[") is None
    assert _text_hashes(salted, 64) == block_hashes(text, 64, "s1")
    assert _text_hashes(plain, 64) == block_hashes(text, 64)


def test_ray_settings_resolve_and_validate() -> None:
    values = resolve({"replicas": 2, "max_replicas": 4}, environ={})
    config = build_ray_config(values)
    assert config.enabled and config.request_router == "prefix"
    scaling = config.scaling_options()["autoscaling_config"]
    assert scaling["min_replicas"] == 1 and scaling["initial_replicas"] == 2
    assert scaling["max_replicas"] == 4 and scaling["target_ongoing_requests"] == 8.0
    assert RayConfig(replicas=3).scaling_options() == {"num_replicas": 3}
    assert not build_ray_config(resolve({}, environ={})).enabled
    env = {"KVSERVE_REPLICAS": "2", "KVSERVE_REQUEST_ROUTER": "pow2"}
    assert build_ray_config(resolve({}, environ=env)).request_router == "pow2"
    build_configs(values)  # the engine and server configs still build
    for bad in ({"replicas": -1}, {"replicas": 2, "max_replicas": 0}, {"replica_cpus": 0.0}):
        with pytest.raises(ValueError):
            build_ray_config(resolve(bad, environ={}))
    with pytest.raises(ValueError, match="KVSERVE_REQUEST_ROUTER"):
        build_ray_config(resolve({}, environ={"KVSERVE_REQUEST_ROUTER": "random"}))


async def test_call_asgi_streams_start_then_body_and_reads_cancel_as_disconnect() -> None:
    disconnected = asyncio.Event()

    async def app(scope, receive, send):  # noqa: ANN001 - a bare ASGI app
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": body.upper(), "more_body": True})
        if scope["path"] == "/hang":
            assert (await receive())["type"] == "http.disconnect"
            disconnected.set()
            return
        await send({"type": "http.response.body", "body": b"!", "more_body": False})

    request = ForwardRequest("POST", "/x", b"", [], b"hello")
    items = [item async for item in call_asgi(app, request)]
    assert items == [ResponseStart(201, [(b"a", b"b")]), b"HELLO", b"!"]
    stream = call_asgi(app, ForwardRequest("POST", "/hang", b"", [], b"hi"))
    assert isinstance(await stream.__anext__(), ResponseStart)
    assert await stream.__anext__() == b"HI"
    await stream.aclose()  # the caller went away
    await asyncio.wait_for(disconnected.wait(), 5)


def test_the_serve_config_file_builds_the_application() -> None:
    pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'kvserve[ray]'")
    from pathlib import Path

    import yaml

    from server.distributed.app import build

    config = yaml.safe_load(
        (Path(__file__).parents[2] / "deploy" / "ray" / "serve-config.yaml").read_text()
    )
    (app_config,) = config["applications"]
    assert app_config["import_path"] == "server.distributed.app:build"
    app = build(app_config["args"])
    replica = app._bound_deployment.init_args[0]
    assert replica._bound_deployment.name == "KvserveReplica"
    assert replica._bound_deployment._deployment_config.num_replicas == 2
    with pytest.raises(ValueError, match="replicas"):
        build({"replicas": -3})
