"""KV offload tiers, the torch-free half: exact tier keys, the pool's eviction hook that queues a
cached block's save, the extension of a prefix hit with blocks a tier holds, and the per-step transfer
lists (save these blocks, load those) the model runner executes before the forward.

A tier entry is one block of one KV cache group. Its key is exact, like the pool's: the token ids of
the whole prefix up to the block's end (int32 bytes) and the cache namespace; a blake2b digest of
those names the entry (the dict hash, a disk file name), but every hit compares the stored tokens, so
a digest collision is only a miss. Model identity, KV dtype and block format are the store's own
fingerprint (engine.executor.kv_store): one store serves one model, and its disk files carry it."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.core.block_pool import ROOT_NODE, BlockPool
from engine.core.kv_cache_groups import first_needed_block
from engine.core.request import Sequence, SequenceStatus

Tier = Literal["memory", "disk"]
TIER_BLOCK = -2  # in a prefix lookup's per-group block list: not in the pool, loadable from a tier
_PERSON = b"kvserve-kvtier1"  # blake2b personalisation: these digests are no other hash


@dataclass(frozen=True, slots=True)
class TierKey:
    digest: bytes  # blake2b-128 of (namespace, the prefix's token bytes): names the entry
    group: int  # the KV cache group whose layers the entry holds
    namespace: str | None  # RequestGroup.cache_namespace (None: the plain model)
    tokens: bytes  # int32 token ids of the whole prefix through this block: compared on every hit

    def __hash__(self) -> int:
        return hash((self.digest, self.group))

    @property
    def name(self) -> str:
        """A file-name-safe name (digest and group; the tokens are checked inside the file)."""
        return f"{self.digest.hex()}-g{self.group}"


def _hasher(namespace: str | None) -> hashlib.blake2b:
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(b"\x00" if namespace is None else b"\x01" + namespace.encode() + b"\x00")
    return h


def token_bytes(token_ids: list[int] | tuple[int, ...]) -> bytes:
    return array("i", token_ids).tobytes()


class PrefixKeys:
    """A sequence's tier keys, block by block, built lazily (one blake2b chain over its tokens)."""

    def __init__(self, namespace: str | None, token_ids: list[int], block_size: int) -> None:
        self.namespace = namespace
        self.stride = block_size * 4
        self.tokens = token_bytes(token_ids)
        self._hasher = _hasher(namespace)
        self._digests: list[bytes] = []

    def key(self, index: int, group: int) -> TierKey:
        while len(self._digests) <= index:
            j = len(self._digests)
            self._hasher.update(self.tokens[j * self.stride : (j + 1) * self.stride])
            self._digests.append(self._hasher.digest())
        end = (index + 1) * self.stride
        return TierKey(self._digests[index], group, self.namespace, self.tokens[:end])


def key_of_node(pool: BlockPool, group: int, node: int) -> TierKey:
    """The tier key of content `node` (walking the trie up to its namespace root)."""
    trie = pool.trie
    blocks: list[tuple[int, ...]] = []
    while node in trie.keys:
        parent, tokens = trie.keys[node]
        blocks.append(tokens)
        node = parent
    namespace = None
    if node != ROOT_NODE:
        namespace = next(ns for ns, root in trie.roots.items() if root == node)
    data = token_bytes([t for tokens in reversed(blocks) for t in tokens])
    h = _hasher(namespace)
    h.update(data)
    return TierKey(h.digest(), group, namespace, data)


@dataclass(frozen=True, slots=True)
class TierEvent:
    """An entry entered (`key` set) or left (`key` None) a tier; `name` is its TierKey.name."""

    tier: Tier
    name: str
    key: TierKey | None = None


@dataclass
class KVOffloadStats:
    """Counters since start-up (blocks and bytes) and the tiers' fill now."""

    memory_hits: int = 0  # blocks loaded back from the host-memory tier
    disk_hits: int = 0  # blocks loaded back from the disk tier
    misses: int = 0  # full prompt blocks neither the pool nor a tier held (computed)
    memory_hit_tokens: int = 0  # prompt tokens the host tier supplied
    disk_hit_tokens: int = 0
    saved_blocks: int = 0  # blocks copied out of the pool as they were evicted
    saved_bytes: int = 0
    loaded_bytes: int = 0  # bytes copied back into the pool
    disk_written_bytes: int = 0
    disk_read_bytes: int = 0
    corrupt_entries: int = 0  # disk entries that failed their checksum or were cut short
    load_seconds: float = 0.0  # reading disk entries and copying blocks back into the pool
    memory_bytes: int = 0  # fill now
    memory_capacity: int = 0
    memory_entries: int = 0
    disk_bytes: int = 0
    disk_capacity: int = 0
    disk_entries: int = 0
    disk_enabled: bool = False  # a disk tier is configured and working


class TierStore(Protocol):
    """The tiers' data (engine.executor.kv_store); the core sees only this."""

    stats: KVOffloadStats

    def contains(self, key: TierKey) -> bool:
        """Whether a tier's index has the entry (cheap: no data read)."""
        ...

    def prepare(self, key: TierKey) -> Tier | None:
        """Make the entry loadable this step (a disk entry is read and verified now); the tier it
        came from, or None when it is a miss after all (corrupt, vanished)."""
        ...

    def touch(self, key: TierKey) -> None:
        """Mark the entry most recently used (its block left the pool again, unchanged)."""
        ...

    def accepts(self) -> bool:
        """Whether a tier takes new entries (False: no host tier and the disk tier is off)."""
        ...


@dataclass
class KVTransfers:
    """One step's copies between the pool and the tiers, run before the forward in this order: read
    every save out of the pool, then write the loads in (a load's block may be a just-evicted one)."""

    saves: list[tuple[int, TierKey]] = field(default_factory=list)  # (block id, key)
    loads: list[tuple[int, TierKey]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


# (group, index in the group's table, key, the tier it comes from)
TierLoad = tuple[int, int, TierKey, Tier]


class KVTiers:
    """The scheduler side of the tiers: what to save as blocks leave the pool, what a lookup may take
    from the tiers, and the transfers queued for the next forward."""

    def __init__(self, store: TierStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.pending = KVTransfers()

    @property
    def stats(self) -> KVOffloadStats:
        return self.store.stats

    def on_evict(self, pool: BlockPool, group: int, node: int, block_id: int) -> None:
        """A cached block leaves the pool (before it is overwritten): queue its save."""
        if not self.store.accepts():
            return  # nothing would keep the copy
        key = key_of_node(pool, group, node)
        if self.store.contains(key):
            self.store.touch(key)
        else:
            self.pending.saves.append((block_id, key))

    def take(self) -> KVTransfers | None:
        transfers, self.pending = self.pending, KVTransfers()
        return transfers or None

    def extend(
        self,
        seq: Sequence,
        found: list[list[int | None]],
        max_blocks: int,
        windows: tuple[int | None, ...],
        usable: Callable[[list[list[int | None]], int], int],
    ) -> tuple[int, list[TierLoad]]:
        """Fill the pool lookup's gaps (`found`: per group, the pool's block per matched block) with
        TIER_BLOCK where a tier holds the block, up to `max_blocks`; returns the usable prefix length
        (the pool's own rules: `usable`) and the loads it takes. Only the blocks the hit needs are
        prepared (read from disk); one that fails is a gap, and the hit is worked out again."""
        tokens = seq.token_ids[: max_blocks * self.block_size]
        keys = PrefixKeys(seq.group.cache_namespace, tokens, self.block_size)
        bs = self.block_size

        def first_needed(group: int, num_blocks: int) -> int:
            return first_needed_block(windows[group], num_blocks * bs, bs)

        for g, blocks in enumerate(found):
            blocks.extend([None] * (max_blocks - len(blocks)))
            for i in range(max_blocks):
                if blocks[i] is None:
                    if self.store.contains(keys.key(i, g)):
                        blocks[i] = TIER_BLOCK
                    elif windows[g] is None:
                        break  # full attention: no later block helps a prefix through a gap
        prepared: dict[tuple[int, int], Tier] = {}
        while True:
            hit = usable(found, max_blocks)
            failed = False
            for g, blocks in enumerate(found):
                for i in range(first_needed(g, hit), hit):
                    if blocks[i] == TIER_BLOCK and (g, i) not in prepared:
                        tier = self.store.prepare(keys.key(i, g))
                        if tier is None:
                            blocks[i] = None
                            failed = True
                        else:
                            prepared[(g, i)] = tier
            if not failed:
                break
        loads = [
            (g, i, keys.key(i, g), prepared[(g, i)])
            for g, blocks in enumerate(found)
            for i in range(first_needed(g, hit), hit)
            if blocks[i] == TIER_BLOCK
        ]
        return hit, loads

    def adopted(self, seq: Sequence, loads: list[TierLoad], block_ids: list[int]) -> None:
        """A hit was taken: queue its loads into the fresh `block_ids`, credit the tiers. The
        request's cost-sheet counts are a part of its `num_cached_tokens`, which is its leader's first
        admission: a resumed (preempted) sequence or a follower adds to the totals only."""
        positions: dict[int, Tier] = {}
        for (_, i, key, tier), block_id in zip(loads, block_ids, strict=True):
            self.pending.loads.append((block_id, key))
            if positions.get(i) != "disk":
                positions[i] = tier
        stats, metrics = self.stats, seq.group.metrics
        reported = seq.index == 0 and seq.status is SequenceStatus.WAITING
        for tier in positions.values():
            if tier == "disk":
                stats.disk_hit_tokens += self.block_size
                if reported:
                    metrics.num_disk_tier_tokens += self.block_size
            else:
                stats.memory_hit_tokens += self.block_size
                if reported:
                    metrics.num_memory_tier_tokens += self.block_size
        for _, _, _, tier in loads:
            if tier == "disk":
                stats.disk_hits += 1
            else:
                stats.memory_hits += 1

    def record_query(self, num_reusable_tokens: int, num_cached_tokens: int) -> None:
        """A first admission: its full prompt blocks that nothing supplied are tier misses."""
        self.stats.misses += max(0, num_reusable_tokens - num_cached_tokens) // self.block_size
