"""A consumer built on vLLM's msgspec structs (their field order and defaults, array_like and
tagged: the layout llm-d and Dynamo read) decodes kvserve's KV event batches unchanged."""

from __future__ import annotations

import msgpack
import pytest

from engine.core.block_hashes import external_block_hashes
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_event_recorder import KVEventRecorder
from engine.core.kv_events import KVEventBatch
from tests.unit.test_kv_events import BS, compute, seq

msgspec = pytest.importorskip("msgspec")


class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class Stored(Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class Removed(Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class Cleared(Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


def test_vllms_own_msgspec_structs_decode_the_payload() -> None:
    kv = KVCacheManager(16, BS, windows=(None, 8))  # a hybrid model: two groups
    recorder = KVEventRecorder(kv.pool.trie, BS, kv.windows)
    kv.pool.listener = recorder
    compute(kv, seq(list(range(1, 13)), "plain"))
    compute(kv, seq(list(range(1, 9)), "lora", namespace="ns"))
    recorder.cleared()
    payload = msgpack.packb(KVEventBatch(2.0, recorder.take()).wire())
    batch = msgspec.msgpack.decode(payload, type=Batch)
    assert batch.ts == 2.0 and batch.data_parallel_rank == 0
    kinds = [type(e).__name__ for e in batch.events]
    assert kinds[-1] == "Cleared" and kinds.count("Stored") == 4  # 2 chains x 2 groups
    full, sliding = batch.events[0], batch.events[1]
    assert isinstance(full, Stored) and isinstance(sliding, Stored)
    assert full.group_idx == 0 and full.kv_cache_spec_kind == "full_attention"
    assert sliding.group_idx == 1 and sliding.kv_cache_spec_sliding_window == 8
    assert full.medium == "GPU" and full.parent_block_hash is None
    assert full.block_hashes == external_block_hashes(list(range(1, 13)), BS)
    lora = batch.events[2]
    assert isinstance(lora, Stored) and lora.extra_keys == [("ns",), ("ns",)]
