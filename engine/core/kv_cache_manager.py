"""KV block bookkeeping (no torch): a pool of fixed-size blocks, per-sequence block tables, reference
counts, and automatic prefix caching by exact block keys with LRU eviction of unreferenced blocks.

Prefix-cache keys are exact, never a bare hash: a cached block is found by `(parent node, token ids)`,
where the parent node is the unique, never-reused id that the cache gave the block before it. The dict
lookup compares the stored tokens on every hit, so two prompts whose hashes collide (Python's int-tuple
hash is unkeyed and can be forced to collide) never share KV; by induction a hit means the whole prefix
matched token for token. `benchmarks/prefix_key_bench.py` measures this against keyed blake2b/sha256
chains (see benchmarks/README.md)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.request import Sequence

ROOT_NODE = 0  # parent node of a sequence's first block

# (parent node, the block's token ids): the identity of a cached block's content and its whole prefix
BlockKey = tuple[int, tuple[int, ...]]


def block_key(parent_node: int, token_ids: tuple[int, ...]) -> BlockKey:
    """The cache key of a full block: compared exactly on lookup, so a hash collision is only a miss."""
    return (parent_node, token_ids)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache


class BlockPool:
    """Physical blocks with reference counts. Free blocks wait in LRU order (oldest first); a free
    block may still hold cached content (it keeps its key) until it is reused."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[BlockKey | None] = [None] * num_blocks
        self.block_nodes = [ROOT_NODE] * num_blocks  # node id of a registered block's content
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}  # block key -> block id
        self._node_ids = itertools.count(ROOT_NODE + 1)

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

    def register(self, block_id: int, key: BlockKey) -> int:
        """Cache `block_id` under `key` and return the node id of that content. When the same content
        is already cached in another block, that block's node is returned and this copy stays private."""
        if self.block_keys[block_id] is not None:
            # A prefix hit: the lookup that found this block matched exactly this key.
            return self.block_nodes[block_id]
        existing = self.cached.setdefault(key, block_id)
        if existing != block_id:
            return self.block_nodes[existing]
        node = next(self._node_ids)
        self.block_keys[block_id] = key
        self.block_nodes[block_id] = node
        return node

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key)

    def _evict(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        if key is not None:
            self.block_keys[block_id] = None
            self.block_nodes[block_id] = ROOT_NODE
            del self.cached[key]  # node ids are never reused, so this block's children are orphaned


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.block_tokens: dict[str, list[tuple[int, ...]]] = {}  # token ids of each full block
        self.node_chains: dict[str, list[int]] = {}  # node ids of a sequence's registered blocks
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

    def _full_block_tokens(self, seq: Sequence, num_full_blocks: int) -> list[tuple[int, ...]]:
        blocks = self.block_tokens.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(blocks) < num_full_blocks:
            i = len(blocks)
            blocks.append(tuple(seq.token_ids[i * bs : (i + 1) * bs]))
        return blocks

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of `seq`'s tokens exactly. At least the last token is always
        left to compute (its logits are needed), and so is every position whose prompt logprobs are
        wanted."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = seq.num_reusable_tokens // self.block_size
        if max_blocks == 0:
            return []
        hits: list[int] = []
        parent = ROOT_NODE
        for tokens in self._full_block_tokens(seq, max_blocks)[:max_blocks]:
            block_id = self.pool.lookup(block_key(parent, tokens))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.pool.block_nodes[block_id]
        return hits

    def sibling_prefix(self, seq: Sequence) -> list[int]:
        """For a follower (n > 1 samples, or a score choice) with prefix caching off: the computed blocks
        of the group's shared prompt held by a sibling (the leader, or a follower that took them), shared
        by reference so the prompt is prefilled once per request either way."""
        if seq.index == 0:
            return []
        limit = min(seq.num_reusable_tokens, len(seq.group.prompt_token_ids))
        best: list[int] = []
        for other in seq.group.seqs:
            table = self.block_tables.get(other.seq_id)
            if other is seq or not table:
                continue
            num_blocks = min(other.num_computed_tokens, limit) // self.block_size
            if num_blocks > len(best):
                best = table[:num_blocks]
        return best

    def share_prefix(self, seq: Sequence, source: Sequence) -> None:
        """Give a waiting follower references to `source`'s computed blocks of the group's shared prompt
        now, so they outlive `source` (a score leader ends with its prefill)."""
        assert seq.num_computed_tokens == 0 and seq.seq_id not in self.block_tables
        limit = min(seq.num_reusable_tokens, len(seq.group.prompt_token_ids))
        num_blocks = min(source.num_computed_tokens, limit) // self.block_size
        blocks = self.block_tables.get(source.seq_id, [])[:num_blocks]
        if not blocks:
            return
        for block_id in blocks:
            self.pool.touch(block_id)
        self.block_tables[seq.seq_id] = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size

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
        table = self.block_tables.get(seq.seq_id)
        if (
            table is not None
            and not cached_blocks
            and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
        ):
            return True  # most decode steps: the token fits in the last block
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
        nodes = self.node_chains.setdefault(seq.seq_id, [])
        if num_full <= len(nodes):
            return
        blocks = self._full_block_tokens(seq, num_full)
        for i in range(len(nodes), num_full):
            parent = nodes[-1] if nodes else ROOT_NODE
            nodes.append(self.pool.register(table[i], block_key(parent, blocks[i])))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks past its first `num_tokens` tokens (rejected speculative tokens'
        KV). Never registered in the prefix cache: registration covers computed, held tokens only.
        The table is replaced, not shortened in place, so views of it see a new table."""
        table = self.block_tables.get(seq.seq_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        for block_id in reversed(table[keep:]):
            self.pool.release(block_id)
        self.block_tables[seq.seq_id] = table[:keep]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks become the first eviction candidates."""
        table = self.block_tables.pop(seq.seq_id, [])
        for block_id in reversed(table):
            self.pool.release(block_id)
        self.block_tokens.pop(seq.seq_id, None)
        self.node_chains.pop(seq.seq_id, None)
