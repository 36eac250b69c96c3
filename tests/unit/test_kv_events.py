"""KV events without a model: the recorder on a real KVCacheManager (merged stores, removals on
eviction, namespaced extra keys), the wire arrays, the hash scheme and --kv-events-config parsing."""

from __future__ import annotations

import msgpack
import pytest

from engine.core.block_hashes import external_block_hashes
from engine.core.cache_namespace import cache_namespace, split_namespace, stored_namespace
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_event_recorder import KVEventRecorder
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
)
from engine.core.request import RequestGroup, Sequence
from engine.core.sampling_params import SamplingParams
from server.settings import build_configs, resolve
from tests.kv_event_subscriber import CacheView, Event, low64, prompt_digests

BS = 4


def seq(tokens: list[int], name: str, namespace: str | None = None) -> Sequence:
    group = RequestGroup(name, None, list(tokens), SamplingParams(max_tokens=1), 1)
    group.cache_namespace = namespace
    s = Sequence(f"{name}/0", group, 0, list(tokens), len(tokens))
    group.seqs.append(s)
    return s


def compute(kv: KVCacheManager, s: Sequence) -> None:
    hit = kv.find_cached_prefix(s)
    assert kv.allocate_slots(s, s.num_tokens - (hit.num_blocks * BS if hit else 0), hit)
    s.num_computed_tokens = s.num_tokens
    kv.cache_full_blocks(s)


def manager(num_blocks: int = 8) -> tuple[KVCacheManager, KVEventRecorder]:
    kv = KVCacheManager(num_blocks, BS)
    recorder = KVEventRecorder(kv.pool.trie, BS)
    kv.pool.listener = recorder
    return kv, recorder


def as_events(events) -> list[Event]:
    return [Event(e.wire()[0], e.wire()) for e in events]


def test_a_chain_is_one_event_and_its_hashes_recompute_from_tokens() -> None:
    kv, recorder = manager()
    tokens = list(range(1, 11))  # two full blocks and a partial one
    s = seq(tokens, "a")
    compute(kv, s)
    (stored,) = recorder.take()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and stored.token_ids == tokens[:8]
    assert stored.block_hashes == external_block_hashes(tokens, BS)
    assert stored.block_hashes == [low64(d) for d in prompt_digests(tokens, BS)]
    # A longer prompt on the same prefix stores only its new block, chained to the old ones.
    kv.free(s)
    longer = seq(tokens + [11, 12], "b")
    compute(kv, longer)
    (more,) = recorder.take()
    assert more.parent_block_hash == stored.block_hashes[-1]
    assert more.block_hashes == external_block_hashes(tokens + [11, 12], BS)[2:]


def test_eviction_removes_and_a_subscriber_view_tracks_the_pool() -> None:
    kv, recorder = manager(num_blocks=4)
    view = CacheView()
    for i in range(5):  # each takes 3 blocks of a 4-block pool: older cached blocks are evicted
        s = seq([100 * i + j for j in range(12)], f"r{i}")
        compute(kv, s)
        kv.free(s)
        view.apply(as_events(recorder.take()))
    assert view.removed > 0
    assert len(view.held) == len(kv.pool.cached)
    newest = external_block_hashes([400 + j for j in range(12)], BS)
    assert set(newest) <= view.held, "the last prompt's blocks are the last evicted"
    oldest = external_block_hashes(list(range(12)), BS)
    assert view.held.isdisjoint(oldest)


def test_namespaces_hash_apart_and_carry_their_extra_keys() -> None:
    kv, recorder = manager()
    tokens = list(range(1, 9))
    compute(kv, seq(tokens, "plain"))
    compute(kv, seq(tokens, "lora", namespace="adapter-sha"))
    plain, lora = recorder.take()
    assert plain.extra_keys is None
    assert lora.extra_keys == [("adapter-sha",), ("adapter-sha",)]
    assert lora.block_hashes == external_block_hashes(tokens, BS, namespace="adapter-sha")
    assert set(lora.block_hashes).isdisjoint(plain.block_hashes)
    CacheView().apply(as_events([plain, lora]))  # recomputable from the published extra keys


def test_a_cache_salt_roots_its_chain_apart_and_hashes_into_the_first_block_only() -> None:
    kv, recorder = manager(16)
    recorder.lora_names = {"lora:abc": "sql"}
    tokens = list(range(1, 9))
    compute(kv, seq(tokens, "plain"))
    salted_a = cache_namespace(None, "tenant-a")
    compute(kv, seq(tokens, "a", namespace=salted_a))
    compute(kv, seq(tokens, "b", namespace=cache_namespace(None, "tenant-b")))
    both = cache_namespace("lora:abc", "tenant-a")
    compute(kv, seq(tokens, "ab", namespace=both))
    plain, a, b, ab = recorder.take()
    assert a.extra_keys == [("tenant-a",), None], "vLLM: the salt keys the first block only"
    assert ab.extra_keys == [("lora:abc", "tenant-a"), ("lora:abc",)]
    assert ab.lora_name == "sql", "the adapter is named through a salted namespace too"
    assert a.block_hashes == external_block_hashes(tokens, BS, namespace=salted_a)
    assert ab.block_hashes == external_block_hashes(tokens, BS, namespace=both)
    assert len({h for e in (plain, a, b, ab) for h in e.block_hashes}) == 8
    CacheView().apply(as_events([plain, a, b, ab]))
    hit = kv.find_cached_prefix(
        seq(tokens + [9], "a2", namespace=cache_namespace(None, "tenant-a"))
    )
    miss = kv.find_cached_prefix(seq(tokens + [9], "c", namespace=cache_namespace(None, "other")))
    assert hit is not None and hit.num_blocks == 2
    assert miss is None or miss.num_blocks == 0


def test_salted_namespaces_split_back_and_keep_the_salt_off_disk() -> None:
    for lora in (None, "lora:abc"):
        for salt in (None, "s", "x|salt:y", "salt:z"):
            assert split_namespace(cache_namespace(lora, salt)) == (lora, salt)
    stored = stored_namespace(cache_namespace("lora:abc", "secret"))
    assert stored is not None and "secret" not in stored and stored.startswith("lora:abc|salt:")
    assert stored == stored_namespace(cache_namespace("lora:abc", "secret"))
    assert stored_namespace("lora:abc") == "lora:abc" and stored_namespace(None) is None


def test_wire_arrays_follow_vllms_positions() -> None:
    stored = BlockStored([1, 2], None, [5] * 8, 4)
    assert stored.wire() == ["BlockStored", [1, 2], None, [5] * 8, 4, None, "GPU", None]
    hybrid = BlockStored([1], 9, [5] * 4, 4, group_idx=1, kv_cache_spec_kind="sliding_window")
    assert hybrid.wire()[8:] == [None, 1, "sliding_window"]
    assert BlockRemoved([7]).wire() == ["BlockRemoved", [7], "GPU"]
    assert AllBlocksCleared().wire() == ["AllBlocksCleared"]
    batch = KVEventBatch(1.5, [stored, AllBlocksCleared()])
    decoded = msgpack.unpackb(msgpack.packb(batch.wire()))
    assert decoded == [1.5, [stored.wire(), ["AllBlocksCleared"]], 0]
    big = BlockStored([(1 << 64) - 1], None, [1] * 4, 4)  # hashes are unsigned 64-bit
    assert msgpack.unpackb(msgpack.packb(big.wire()))[1] == [(1 << 64) - 1]


def test_kv_events_config_parses_vllms_json_and_refuses_bad_fields() -> None:
    text = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", "topic": "kv"}'
    config = KVEventsConfig.parse(text)
    assert config is not None and config.enabled and config.endpoint == "tcp://*:6000"
    assert KVEventsConfig.parse("") is None and KVEventsConfig.parse("null") is None
    assert not KVEventsConfig.parse('{"publisher": "null", "enable_kv_cache_events": true}').enabled
    engine_config, _ = build_configs(resolve({"kv_events_config": config}, environ={}))
    assert engine_config.kv_events_config == config
    env = {"KVSERVE_KV_EVENTS_CONFIG": '{"enable_kv_cache_events": true}'}
    assert build_configs(resolve({}, environ=env))[0].kv_events_config.enabled
    assert KVEventsConfig.parse('{"hwm": 0}').hwm == 0  # ZMQ's (and vLLM's) "no limit"
    for bad, match in (
        ("{not json", "not valid JSON"),
        ('{"endpoint": "tcp://*:1", "colour": 1}', "unknown key"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"hwm": -1}', "hwm must be a non-negative integer"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ("[1, 2]", "JSON object"),
    ):
        with pytest.raises(ValueError, match=match):
            KVEventsConfig.parse(bad)
        with pytest.raises(ValueError, match="KVSERVE_KV_EVENTS_CONFIG"):
            resolve({}, environ={"KVSERVE_KV_EVENTS_CONFIG": bad})


# -- the Ray router's side, with fake replicas: real pools and publishers, no model, no Ray ---------
class FakeReplica:
    """A block pool publishing its KV events, as a kvserve replica's engine does."""

    def __init__(self, name: str, num_blocks: int = 16) -> None:
        from engine.kv_event_publisher import KVEventStream

        self.name = name
        self.kv = KVCacheManager(num_blocks, BS)
        config = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            topic=f"kv@{name}@m",
        )
        self.events = KVEventStream.start(config, self.kv, "0")
        self.n = 0

    def serve(self, tokens: list[int]) -> None:
        self.n += 1
        s = seq(tokens, f"{self.name}-{self.n}")
        compute(self.kv, s)
        self.kv.free(s)
        self.events.flush()

    def source(self):
        from server.distributed.kv_feed import ReplicaEvents

        p = self.events.publisher
        return ReplicaEvents(self.name, p.endpoint, p.replay_endpoint, BS, "0", p.config.topic)


def wait_until(condition, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_router_picks_the_replica_whose_events_show_the_prefix() -> None:
    from server.distributed.kv_feed import KVEventFeed
    from server.distributed.kv_index import KVIndex, kv_matches, route

    replicas = [FakeReplica(f"r{i}") for i in range(3)]
    index = KVIndex()
    feed = KVEventFeed(index)
    try:
        doc = [7] * 3 + list(range(20, 41))  # 24 tokens: 6 blocks
        replicas[1].serve(doc + [1, 2, 3])  # r1 computed (and caches) the document
        replicas[2].serve(list(range(300, 316)))
        # r0 publishes before anyone follows it: the feed replays what it missed.
        replicas[0].serve(list(range(500, 512)))
        feed.set_replicas([r.source() for r in replicas])
        wait_until(lambda: index.num_blocks("r1") == 6 and index.num_blocks("r0") == 3)
        names = [r.name for r in replicas]
        sources = feed.sources()
        matches, total = kv_matches(index, sources, names, doc + [9, 9, 9, 9, 9])
        assert total == 7 and matches == {"r0": 0, "r1": 6, "r2": 0}
        loads = {"r0": 0, "r1": 3, "r2": 0}
        first, rest = route(names, lambda r: r, loads, matches, total, 4, 0.1)
        assert first == ["r1"] and sorted(rest) == ["r0", "r2"]
        # Too busy: the fallback spreads load (power of two among all, less loaded first).
        busy = {"r0": 0, "r1": 9, "r2": 0}
        (pair,) = route(names, lambda r: r, busy, matches, total, 4, 0.1)
        assert len(pair) == 2 and busy[pair[0]] <= busy[pair[1]]
        # Nobody holds it: power of two choices.
        other = kv_matches(index, sources, names, list(range(900, 932)))[0]
        assert not any(other.values())
        assert len(route(names, lambda r: r, loads, other, 8, 4, 0.1)) == 1
        # r1's pool evicts the document: its removals reach the router.
        for i in range(4):
            replicas[1].serve(list(range(1000 + 100 * i, 1000 + 100 * i + 16)))
        wait_until(lambda: kv_matches(index, sources, ["r1"], doc)[0]["r1"] < 6)
        assert feed.num_replays >= 3  # each replica's history was replayed when followed
    finally:
        feed.close()
        for r in replicas:
            r.events.close()


def test_the_feed_fills_a_gap_from_replay_and_forgets_past_it() -> None:
    import zmq

    from server.distributed.kv_feed import KVEventFeed, _Stream
    from server.distributed.kv_index import KVIndex

    replica = FakeReplica("g")
    index = KVIndex()
    feed = KVEventFeed(index)  # following nothing: the stream below is driven by hand
    sock = zmq.Context.instance().socket(zmq.SUB)
    try:
        for i in range(3):
            replica.serve(list(range(100 * i, 100 * i + 8)))
        wait_until(lambda: replica.events.publisher.num_batches == 4)  # the start-up clear + 3
        # A stream that applied batches 0 and 1 and then saw batch 3: replay brings 2 and 3.
        stream = _Stream(replica.source(), sock)
        stream.next_seq = 2
        feed._replay(stream)
        assert stream.next_seq == 4 and index.num_blocks("g") == 4  # batches 2 and 3
        # The publisher keeps only the last 2 batches: a stream still at batch 1 cannot be
        # filled, so the replica's state starts afresh from what replay still has.
        replica.events.publisher._buffer = type(replica.events.publisher._buffer)(
            list(replica.events.publisher._buffer)[-1:], maxlen=2
        )
        index.apply("g", [["BlockStored", [123], None, [0] * BS, BS, None, "GPU", None]])
        stream.next_seq = 1
        feed._replay(stream)
        assert stream.next_seq == 4
        assert index.match("g", [123]) == 0, "stale state was dropped"
        assert index.num_blocks("g") == 2  # batch 3's blocks only
    finally:
        sock.close()
        feed.close()
        replica.events.close()


def test_replicas_get_their_own_event_ports_and_the_ingress_tokenizes(tiny_llama_dir) -> None:
    import json

    from server.distributed.replica_events import with_replica_events
    from server.distributed.routing_tokens import RoutingTokenizer

    values = resolve({"model": str(tiny_llama_dir), "replicas": 2}, environ={})
    mine = with_replica_events(values, "abc")["kv_events_config"]
    assert mine.enabled and mine.endpoint == "tcp://*:*" and mine.topic.startswith("kv@abc@")
    given = KVEventsConfig(enable_kv_cache_events=True, topic="t", buffer_steps=7)
    kept = with_replica_events({**values, "kv_events_config": given}, "abc")["kv_events_config"]
    assert kept.topic == "t" and kept.buffer_steps == 7 and kept.replay_endpoint == "tcp://*:*"
    pow2 = with_replica_events({**values, "request_router": "pow2"}, "abc")
    assert pow2["kv_events_config"] is None, "the pow2 router reads no events"

    router_tokens = RoutingTokenizer.load(values)
    assert router_tokens is not None
    tok = router_tokens.tokenizer

    def chat(*turns: str) -> bytes:
        roles = ["user", "assistant"]
        messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
        return json.dumps({"model": "m", "messages": messages}).encode()

    prompt = b'{"model": "m", "prompt": "hello there"}'
    assert router_tokens.tokens("/v1/completions", prompt) == tok.encode("hello there")
    ids = b'{"model": "m", "prompt": [5, 6, 7]}'
    assert router_tokens.tokens("/v1/completions", ids) == [5, 6, 7]
    first = router_tokens.tokens("/v1/chat/completions", chat("Tell me about ships."))
    later = router_tokens.tokens(
        "/v1/chat/completions", chat("Tell me about ships.", "Ships float.", "And boats?")
    )
    assert first and later and len(later) > len(first)
    shared = 0
    while shared < len(first) and first[shared] == later[shared]:
        shared += 1
    assert shared >= len(first) - 8, "a later turn extends the earlier turn's tokens"
    assert router_tokens.tokens("/v1/chat/completions", b"{bad json") is None
    assert router_tokens.tokens("/v1/completions", b'{"prompt": "x", "n": "many"}') is None
    assert router_tokens.tokens("/v1/embeddings", b'{"input": "x"}') is None


def test_a_cache_reset_clears_the_pool_and_says_so() -> None:
    kv, recorder = manager()
    s = seq(list(range(1, 13)), "a")
    compute(kv, s)
    assert not kv.pool.reset_cache(), "refused while a sequence holds blocks"
    kv.free(s)
    view = CacheView()
    view.apply(as_events(recorder.take()))
    assert len(view.held) == 3
    assert kv.pool.reset_cache()
    events = recorder.take()
    assert [type(e) for e in events] == [AllBlocksCleared]
    view.apply(as_events(events))
    assert not view.held and not kv.pool.cached and len(kv.pool.trie) == 0
    assert kv.find_cached_prefix(seq(list(range(1, 13)), "b")) is None


def test_the_engine_page_and_metrics_show_the_publisher() -> None:
    from engine import EngineSnapshot, KVEventsState
    from server.engine_page import page_payload

    state = KVEventsState("tcp://0.0.0.0:5557", None, "kv", BS, "0", 3, 10, 1, 0, True)
    payload = page_payload(EngineSnapshot("generate", 0, 0.0, kv_events=state), {})
    assert payload["kv_events"]["num_events"] == 10 and payload["kv_events"]["num_dropped"] == 1
    assert page_payload(EngineSnapshot("generate", 0, 0.0), {})["kv_events"] is None


def test_a_publisher_that_cannot_open_its_endpoint_names_it() -> None:
    from engine.core.errors import StartupError
    from engine.kv_event_publisher import ZmqEventPublisher

    first = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"), BS, "0"
    )
    try:
        taken = first.endpoint.replace("127.0.0.1", "*")
        with pytest.raises(StartupError, match="^kv events: cannot open tcp://"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=taken), BS, "0")
        bad_replay = KVEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="nowhere"
        )
        with pytest.raises(ValueError, match="cannot open nowhere"):
            ZmqEventPublisher(bad_replay, BS, "0")
    finally:
        first.close()
