"""KV block bookkeeping (no torch): a pool of fixed-size blocks, per-sequence block tables, reference
counts, and automatic prefix caching by chained block hashes with LRU eviction of unreferenced blocks."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.core.request import Sequence

_ROOT_HASH = 0x6B7673657276  # parent hash of a sequence's first block


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash: a block's identity is its tokens *and* everything before them."""
    return hash((parent_hash, token_ids))


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache


class BlockPool:
    """Physical blocks with reference counts. Free blocks wait in LRU order (oldest first); a free
    block may still hold cached content (it keeps its hash) until it is reused."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        self._evict(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take a reference to a cached block (reviving it from the free queue if unreferenced)."""
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} released twice"
        if self.ref_counts[block_id] == 0:
            self.free_queue[block_id] = None  # most recently used end: evicted last

    def register(self, block_id: int, block_hash: int) -> None:
        if block_hash in self.cached or self.block_hashes[block_id] is not None:
            return  # same content already cached elsewhere: keep this copy private
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.block_hash_chains: dict[str, list[int]] = {}  # hashes of a sequence's full blocks
        self.num_registered: dict[str, int] = {}  # leading blocks of a sequence already registered
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables.get(seq.seq_id, [])

    def _hash_chain(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        chain = self.block_hash_chains.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(chain) < num_full_blocks:
            i = len(chain)
            parent = chain[-1] if chain else _ROOT_HASH
            chain.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return chain

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of `seq`'s tokens. At least the last token is always left to
        compute, since its logits are needed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        chain = self._hash_chain(seq, max_blocks)
        hits: list[int] = []
        for block_hash in chain[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def leader_prefix(self, seq: Sequence) -> list[int]:
        """For a follower sample (n > 1) with prefix caching off: the leader's full prompt blocks,
        shared by reference so the prompt is prefilled once per request either way."""
        if seq.index == 0:
            return []
        leader = seq.group.seqs[0]
        table = self.block_tables.get(leader.seq_id, [])
        num_blocks = min(leader.num_computed_tokens, seq.num_tokens - 1) // self.block_size
        return table[:num_blocks]

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return  # followers sharing their leader's blocks are not cache lookups
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq` (after `cached_blocks`, when admitting).
        Returns False, changing nothing, when the pool cannot provide the blocks."""
        table = self.block_tables.setdefault(seq.seq_id, [])
        cached_blocks = cached_blocks or []
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(table) - len(cached_blocks)
        # Reviving an unreferenced cached block takes it out of the free queue too.
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_revived > self.pool.num_free:
            if not table:
                del self.block_tables[seq.seq_id]
            return False
        for block_id in cached_blocks:
            self.pool.touch(block_id)
        table.extend(cached_blocks)
        table.extend(self.pool.allocate() for _ in range(max(0, num_new_blocks)))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the now-computed full blocks of `seq` so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        table = self.block_tables.get(seq.seq_id)
        if not table:
            return
        start = self.num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        chain = self._hash_chain(seq, num_full)
        for i in range(start, num_full):
            self.pool.register(table[i], chain[i])
        self.num_registered[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks become the first eviction candidates."""
        table = self.block_tables.pop(seq.seq_id, [])
        for block_id in reversed(table):
            self.pool.release(block_id)
        self.block_hash_chains.pop(seq.seq_id, None)
        self.num_registered.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.pool.free_queue):
            self.pool._evict(block_id)
