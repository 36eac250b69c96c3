"""The KV offload tiers' bookkeeping without a model: evictions queue saves under exact prefix keys
(namespaced), a lookup extends the pool's hit with tier blocks and stops at a tier's miss or a failed
read, a sliding group takes only its window's blocks, and the disk file format rejects damage."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_offload import KVOffloadStats, KVTiers, PrefixKeys, Tier, TierKey
from engine.core.request import SequenceStatus
from engine.executor.kv_disk_tier import decode_entry, encode_entry
from tests.unit.test_kv_cache_manager import compute, make_seq

BS = 4


class FakeStore:
    """Keys only; `broken` keys fail their read (a damaged disk entry)."""

    def __init__(self) -> None:
        self.stats = KVOffloadStats()
        self.keys: set[TierKey] = set()
        self.broken: set[TierKey] = set()
        self.prepared: list[TierKey] = []

    def contains(self, key: TierKey) -> bool:
        return key in self.keys

    def prepare(self, key: TierKey) -> Tier | None:
        self.prepared.append(key)
        return None if key in self.broken else "memory"

    def touch(self, key: TierKey) -> None:
        pass

    def accepts(self) -> bool:
        return True


def tiered(
    num_blocks: int, windows: tuple[int | None, ...] = (None,)
) -> tuple[KVCacheManager, FakeStore]:
    kv = KVCacheManager(num_blocks, BS, windows=windows)
    store = FakeStore()
    kv.tiers = KVTiers(store, BS)
    kv.pool.on_evict = kv.tiers.on_evict
    return kv, store


def saved_into_store(kv: KVCacheManager, store: FakeStore) -> list[TierKey]:
    transfers = kv.tiers.take()
    keys = [key for _, key in transfers.saves] if transfers else []
    store.keys.update(keys)
    return keys


def test_evicted_blocks_are_saved_under_their_exact_prefix_keys():
    kv, store = tiered(5)
    a = make_seq(list(range(17)), "a")  # 4 full blocks + 1 token
    compute(kv, a)
    kv.free(a)
    b = make_seq(list(range(100, 117)), "b")
    compute(kv, b)  # takes all 5 blocks: evicts a's 4 cached ones
    keys = saved_into_store(kv, store)
    expected = PrefixKeys(None, list(range(16)), BS)
    assert sorted(k.tokens for k in keys) == sorted(expected.key(i, 0).tokens for i in range(4))
    assert {k.digest for k in keys} == {expected.key(i, 0).digest for i in range(4)}


def test_a_lookup_extends_the_pool_hit_with_tier_blocks_and_stops_at_a_failed_read():
    kv, store = tiered(16)
    tokens = list(range(21))  # 5 full blocks reusable
    keys = PrefixKeys(None, tokens, BS)
    store.keys.update(keys.key(i, 0) for i in range(5))
    hit = kv.find_cached_prefix(make_seq(tokens))
    assert hit is not None and hit.num_blocks == 5 and len(hit.loads) == 5
    store.broken.add(keys.key(3, 0))
    seq = make_seq(tokens, "c")
    hit = kv.find_cached_prefix(seq)
    assert hit is not None and hit.num_blocks == 3
    assert kv.allocate_slots(seq, len(tokens) - 12, hit)
    loads = kv.tiers.take().loads
    assert len(loads) == 3 and len({b for b, _ in loads}) == 3  # fresh blocks, one per load
    assert seq.group.metrics.num_memory_tier_tokens == 12


def test_namespaces_key_the_tiers_apart():
    kv, store = tiered(16)
    tokens = list(range(9))
    store.keys.update(PrefixKeys("adapter-a", tokens, BS).key(i, 0) for i in range(2))
    plain = make_seq(tokens, "p")
    assert kv.find_cached_prefix(plain) is None
    other = make_seq(tokens, "o")
    other.group.cache_namespace = "adapter-a"
    assert kv.find_cached_prefix(other).num_blocks == 2


def test_a_sliding_group_reads_only_its_window_from_the_tiers():
    kv, store = tiered(64, windows=(None, 8))  # group 1 slides over 8 tokens = 2 blocks
    tokens = list(range(41))  # 10 full blocks reusable
    keys = PrefixKeys(None, tokens, BS)
    store.keys.update(keys.key(i, g) for i in range(10) for g in (0, 1))
    hit = kv.find_cached_prefix(make_seq(tokens))
    assert hit is not None and hit.num_blocks == 10
    sliding = [i for g, i, _, _ in hit.loads if g == 1]
    assert sliding and min(sliding) >= 10 - 3  # only the blocks the next query's window reads
    assert sum(1 for g, *_ in hit.loads if g == 0) == 10
    window_start = keys.key(min(sliding), 1).tokens
    assert all(len(k.tokens) >= len(window_start) for k in store.prepared if k.group == 1)


def test_the_disk_format_rejects_damage_and_other_prefixes():
    fp = b"f" * 16
    key = PrefixKeys(None, list(range(8)), BS).key(1, 0)
    other = PrefixKeys(None, list(range(1, 9)), BS).key(1, 0)
    data = encode_entry(fp, key, b"payload-bytes" * 10)
    assert decode_entry(data, fp, key) == b"payload-bytes" * 10
    flipped = bytearray(data)
    flipped[60] ^= 1
    assert decode_entry(bytes(flipped), fp, key) is False
    assert decode_entry(data[:-7], fp, key) is False
    assert decode_entry(data[:10], fp, key) is False
    assert decode_entry(data, b"g" * 16, key) is None  # another model's file
    collided = TierKey(key.digest, 0, None, other.tokens)  # same name, other tokens
    assert decode_entry(data, fp, collided) is None


def _disk(directory, stats=None):
    import torch

    from engine.executor.kv_disk_tier import DiskTier

    shapes: dict[int, tuple[int, ...]] = {0: (1, 2, BS, 1, 2)}
    return DiskTier(directory, 1 << 20, b"f" * 16, stats or KVOffloadStats(), shapes, torch.float32)


def test_a_disk_tier_that_cannot_start_or_fills_up_turns_off_with_one_warning(
    tmp_path, caplog, monkeypatch
):
    import errno
    import logging
    from pathlib import Path

    import torch

    from engine.executor.kv_store import Entry

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="engine.executor.kv_disk_tier"):
        broken = _disk(blocker / "kv")
    assert not broken.enabled and not broken.stats.disk_enabled
    assert [r.getMessage() for r in caplog.records if "disk tier off" in r.getMessage()]
    caplog.clear()

    disk = _disk(tmp_path / "kv")

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    keys = [PrefixKeys(None, list(range(12)), BS).key(i, 0) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="engine.executor.kv_disk_tier"):
        for key in keys:
            disk.write(key, Entry(torch.zeros(1, 2, BS, 1, 2)))
        disk.flush()
    assert len([r for r in caplog.records if "disk tier off" in r.getMessage()]) == 1
    assert not disk.enabled and not any(disk.contains(k) for k in keys)
    assert disk.read(keys[0]) is None
    disk.close()


def test_tier_tokens_count_only_for_the_admission_whose_cached_tokens_are_reported():
    kv, store = tiered(16)
    tokens = list(range(21))  # 5 full blocks reusable
    keys = PrefixKeys(None, tokens, BS)
    store.keys.update(keys.key(i, 0) for i in range(2))
    seq = make_seq(tokens, "first")
    hit = kv.find_cached_prefix(seq)
    assert hit is not None and hit.num_blocks == 2
    assert kv.allocate_slots(seq, len(tokens) - 8, hit)
    assert seq.group.metrics.num_memory_tier_tokens == 8
    kv.free(seq)  # preempted; by its resumption the tiers hold all of its prefix
    seq.status = SequenceStatus.PREEMPTED
    seq.num_computed_tokens = 0
    store.keys.update(keys.key(i, 0) for i in range(5))
    fresh = KVCacheManager(16, BS)  # an empty pool over the same tiers: every block is a load
    fresh.tiers = kv.tiers
    hit = fresh.find_cached_prefix(seq)
    assert hit is not None and hit.num_blocks == 5 and len(hit.loads) == 5
    assert fresh.allocate_slots(seq, 1, hit)
    assert seq.group.metrics.num_memory_tier_tokens == 8  # the resumed admission: not reported
    assert store.stats.memory_hit_tokens == 8 + 20  # the totals count every token loaded


def _open(tmp_path, **cache_options):
    import torch

    from engine.core.config import CacheConfig
    from engine.core.kv_cache_groups import KVCacheGroup, KVCacheSpec
    from engine.executor.kv_store import open_kv_store

    spec = KVCacheSpec((KVCacheGroup(None, (0, 1)),), 2)
    cache = CacheConfig(block_size=BS, **cache_options)
    # one block: 2 layers x K,V x 4 tokens x 2 heads x 8 dims x 4 bytes = 1024 bytes
    return open_kv_store(cache, b"f" * 16, spec, BS, (2, 8), torch.float32, torch.device("cpu"))


def test_tier_sizes_and_directories_that_cannot_work_are_start_up_errors(tmp_path):
    import pytest

    from engine.core.errors import StartupError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for options, message in (
        ({"kv_offload_dir": str(blocker)}, "cannot use .*a-file as the disk tier"),
        ({"kv_offload_dir": str(blocker / "kv")}, "cannot use .*a-file/kv as the disk tier"),
        (
            {"kv_offload_memory": 1000},
            r"host-memory tier \(1000 bytes\) cannot hold one KV block "
            r"\(1024 bytes",
        ),
        (
            {"kv_offload_dir": str(tmp_path / "d"), "kv_offload_disk": 0},
            "disk tier .* one KV block",
        ),
        ({"kv_offload_memory": 100 << 40}, "larger than the memory available"),
    ):
        with pytest.raises(StartupError, match=message):
            _open(tmp_path, **options)
    with pytest.raises(ValueError, match="needs --kv-offload-dir"):
        _open(tmp_path, kv_offload_disk=1 << 30)
    store = _open(tmp_path, kv_offload_memory=1024, kv_offload_dir=str(tmp_path / "ok"))
    assert store is not None and store.disk is not None and store.disk.enabled
    store.disk.close()


def test_with_no_host_tier_and_the_disk_tier_off_nothing_is_saved_or_counted(tmp_path):
    import torch

    from engine.executor.kv_store import Entry, TieredKVStore

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    stats = KVOffloadStats()
    disk = _disk(blocker / "kv", stats)  # turns itself off at once
    store = TieredKVStore(0, disk, stats)
    assert not store.accepts()
    key = PrefixKeys(None, list(range(4)), BS).key(0, 0)
    store.put(key, Entry(torch.zeros(1, 2, BS, 1, 2)))
    assert stats.saved_blocks == 0 and stats.saved_bytes == 0
    tiers = KVTiers(store, BS)
    kv = KVCacheManager(2, BS)
    kv.tiers = tiers
    kv.pool.on_evict = tiers.on_evict
    a = make_seq(list(range(5)), "a")
    compute(kv, a)
    kv.free(a)
    compute(kv, make_seq(list(range(100, 105)), "b"))  # evicts a's cached block
    assert tiers.take() is None  # no save queued: nothing would keep it
    disk.close()


def test_a_block_still_queued_for_the_disk_is_read_back_from_its_entry(tmp_path):
    """Disk tier only: a hit on a block whose write is still queued is served from the queued
    entry (QA: it came back as the entry itself, which the store wrapped again, and the engine
    loop died on the first hit in that window)."""
    import threading

    import torch

    from engine.executor.kv_store import Entry, TieredKVStore

    class Held(Entry):  # the writer thread waits on this one until released
        release = threading.Event()

        def ready_tensor(self) -> torch.Tensor:
            self.release.wait(timeout=60)
            return self.tensor

    stats = KVOffloadStats()
    disk = _disk(tmp_path / "kv", stats)
    store = TieredKVStore(0, disk, stats)
    first = PrefixKeys(None, list(range(50, 54)), BS).key(0, 0)
    key = PrefixKeys(None, list(range(4)), BS).key(0, 0)
    value = torch.arange(2 * BS * 2, dtype=torch.float32).view(1, 2, BS, 1, 2)
    store.put(first, Held(torch.zeros_like(value)))  # occupies the writer
    store.put(key, Entry(value))  # queued behind it
    assert disk.contains(key)
    assert store.prepare(key) == "disk"
    assert torch.equal(store.take(key).ready_tensor(), value)
    Held.release.set()
    store.close()
    fresh = TieredKVStore(0, _disk(tmp_path / "kv", KVOffloadStats()), KVOffloadStats())
    assert fresh.prepare(key) == "disk" and torch.equal(fresh.take(key).ready_tensor(), value)
    fresh.close()
