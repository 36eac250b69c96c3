"""The physical block pool (no torch): reference counts, LRU free queue, and the prefix cache, i.e. the
exact-key trie of block contents and which block holds each content for each KV cache group.

Prefix-cache keys are exact, never a bare hash: a content node is found by `(parent node, token ids)`,
where the parent node is the unique, never-reused id the trie gave the block before it. The dict
lookup compares the stored tokens on every hit, so two prompts whose hashes collide (Python's int-tuple
hash is unkeyed and can be forced to collide) never share KV; by induction a node means the whole
prefix matched token for token. `benchmarks/prefix_key_bench.py` measures this against keyed
blake2b/sha256 chains (see benchmarks/README.md).

The trie is apart from the blocks because a sliding-window group keeps only the blocks of its window:
its cached block for position i must be findable when the blocks before it are long gone. A node lives
while a sequence's chain, a cached block (of any group) or a child node refers to it."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

ROOT_NODE = 0  # parent node of a sequence's first block
NO_NODE = -1  # a block holding no registered content

# (parent node, the block's token ids): the identity of a block's content and its whole prefix
BlockKey = tuple[int, tuple[int, ...]]


def block_key(parent_node: int, token_ids: tuple[int, ...]) -> BlockKey:
    """The trie key of a full block: compared exactly on lookup, so a hash collision is only a miss."""
    return (parent_node, token_ids)


class PrefixTrie:
    """Content nodes of full blocks, reference counted (see the module docstring)."""

    def __init__(self) -> None:
        self.nodes: dict[BlockKey, int] = {}
        self.keys: dict[int, BlockKey] = {}
        self.parents: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self._ids = itertools.count(ROOT_NODE + 1)
        # Namespace roots: the parent of a namespaced chain's first block (see root()); permanent.
        self.roots: dict[str, int] = {}
        self._root_ids: set[int] = {ROOT_NODE}

    def __len__(self) -> int:
        return len(self.nodes)

    def root(self, namespace: str | None) -> int:
        """The parent node of the first block of a chain computed in `namespace` (None: the plain
        model, ROOT_NODE). KV computed under one namespace (a LoRA adapter's content, a cache salt)
        is only ever found by chains of the same namespace: their first keys differ."""
        if namespace is None:
            return ROOT_NODE
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = next(self._ids)
            self._root_ids.add(node)
        return node

    def find(self, key: BlockKey) -> int | None:
        return self.nodes.get(key)

    def intern(self, parent: int, key: BlockKey) -> int:
        """The node of `key` (a block key on `parent`; created if new), with one more reference for
        the caller."""
        node = self.nodes.get(key)
        if node is None:
            node = next(self._ids)
            self.nodes[key] = node
            self.keys[node] = key
            self.parents[node] = parent
            self.refs[node] = 0
            if parent not in self._root_ids:
                self.refs[parent] += 1  # the child keeps its parent
        self.refs[node] += 1
        return node

    def ref(self, node: int) -> None:
        self.refs[node] += 1

    def unref(self, node: int) -> None:
        """Drop one reference; a node left with none goes, and its parent loses the child's."""
        while node not in self._root_ids:
            self.refs[node] -= 1
            assert self.refs[node] >= 0, f"node {node} unreferenced twice"
            if self.refs[node]:
                return
            del self.refs[node], self.nodes[self.keys.pop(node)]
            node = self.parents.pop(node)


class BlockPoolListener(Protocol):
    """Told when a block's content enters or leaves the prefix cache (KV events)."""

    def block_stored(self, group: int, node: int) -> None: ...
    def block_removed(self, group: int, node: int) -> None: ...
    def cleared(self) -> None: ...


class BlockPool:
    """Physical blocks with reference counts. Free blocks wait in LRU order (oldest first); a free
    block may still hold cached content (it keeps its node) until it is reused."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_nodes = [NO_NODE] * num_blocks  # content node of a registered block
        self.block_groups = [0] * num_blocks  # the group a registered block was cached for
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[tuple[int, int], int] = {}  # (group, node) -> block id
        self.trie = PrefixTrie()
        # Called as (pool, group, node, block id) when a cached block is evicted, before its content
        # is dropped (the KV offload tiers save it; engine.core.kv_offload).
        self.on_evict: Callable[[BlockPool, int, int, int], None] | None = None
        self.listener: BlockPoolListener | None = None  # KV events (engine.core.kv_event_recorder)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def view(self) -> BlockPoolView:
        """A read-only view of the pool for observers (the detail snapshot)."""
        return BlockPoolView(self)

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

    def register(self, group: int, block_id: int, node: int) -> None:
        """Cache `block_id` as `group`'s copy of content `node`. When the group already caches that
        content in another block, this copy stays private."""
        if self.block_nodes[block_id] != NO_NODE:
            return  # a prefix hit: the lookup that found this block matched exactly this node
        if self.cached.setdefault((group, node), block_id) != block_id:
            return
        self.block_nodes[block_id] = node
        self.block_groups[block_id] = group
        self.trie.ref(node)
        if self.listener is not None:
            self.listener.block_stored(group, node)

    def lookup(self, group: int, node: int) -> int | None:
        return self.cached.get((group, node))

    def reset_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); only while no block is held, so
        False (and nothing changed) when a sequence still holds one."""
        if self.num_free != self.num_blocks:
            return False
        for block_id, node in enumerate(self.block_nodes):
            if node != NO_NODE:
                self.block_nodes[block_id] = NO_NODE
                del self.cached[(self.block_groups[block_id], node)]
                self.trie.unref(node)
        if self.listener is not None:
            self.listener.cleared()
        return True

    def is_cached_block(self, block_id: int) -> bool:
        return self.block_nodes[block_id] != NO_NODE

    def _evict(self, block_id: int) -> None:
        node = self.block_nodes[block_id]
        if node != NO_NODE:
            if self.on_evict is not None:
                self.on_evict(self, self.block_groups[block_id], node, block_id)
            self.block_nodes[block_id] = NO_NODE
            del self.cached[(self.block_groups[block_id], node)]
            if self.listener is not None:
                self.listener.block_removed(self.block_groups[block_id], node)
            self.trie.unref(node)


class BlockPoolView:
    """What a BlockPool holds now, read-only: for observers such as the engine's detail snapshot,
    which must not reach into the pool's own structures."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    def ref_count(self, block_id: int) -> int:
        """References to `block_id` (0: free)."""
        return self._pool.ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether `block_id` holds registered prefix-cache content."""
        return self._pool.is_cached_block(block_id)

    def cached_free_blocks(self) -> tuple[int, ...]:
        """Free blocks that still hold cached content, in eviction order (the next evicted first)."""
        pool = self._pool
        return tuple(b for b in pool.free_queue if pool.is_cached_block(b))
