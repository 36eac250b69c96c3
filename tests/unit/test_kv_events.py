"""KV events without a model: the recorder on a real KVCacheManager (merged stores, removals on
eviction, namespaced extra keys), the wire arrays, the hash scheme and --kv-events-config parsing."""

from __future__ import annotations

import msgpack
import pytest

from engine.core.block_hashes import external_block_hashes
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
    for bad, match in (
        ("{not json", "not valid JSON"),
        ('{"endpoint": "tcp://*:1", "colour": 1}', "unknown key"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ("[1, 2]", "JSON object"),
    ):
        with pytest.raises(ValueError, match=match):
            KVEventsConfig.parse(bad)
        with pytest.raises(ValueError, match="KVSERVE_KV_EVENTS_CONFIG"):
            resolve({}, environ={"KVSERVE_KV_EVENTS_CONFIG": bad})
