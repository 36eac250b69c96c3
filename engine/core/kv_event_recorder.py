"""The block pool's KV events of one step (no torch): it listens to the pool (a block entered or left
the prefix cache), names each block by its external hash (engine.core.block_hashes) and merges
neighbouring events, so a step's batch has one BlockStored per chain run, as vLLM's has.

It keeps, per live trie node, the node's digest and namespace: a child's digest chains from its
parent's, and a removal names the block it stored. Entries of nodes the trie has dropped are
pruned in bulk, never looked up again (node ids are never reused)."""

from __future__ import annotations

from array import array

from engine.core.block_hashes import (
    DEFAULT_SEED,
    block_digest,
    external_hash,
    extra_keys,
    none_hash,
)
from engine.core.block_pool import ROOT_NODE, PrefixTrie
from engine.core.cache_namespace import split_namespace
from engine.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from engine.core.kv_offload import PrefixKeys, Tier, TierEvent, TierKey

TIER_MEDIUMS: dict[Tier, str] = {"memory": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


class KVEventRecorder:
    """A BlockPoolListener collecting events until `take()`."""

    def __init__(
        self,
        trie: PrefixTrie,
        block_size: int,
        windows: tuple[int | None, ...] = (None,),
        seed: str = DEFAULT_SEED,
    ) -> None:
        self.trie = trie
        self.block_size = block_size
        self.windows = windows
        self.seed = seed
        self._none_hash = none_hash(seed)
        # node -> (digest, namespace of its chain, external hash)
        self._digests: dict[int, tuple[bytes, str | None, int]] = {}
        self._root_namespaces: dict[int, str] = {}
        self.events: list[KVCacheEvent] = []
        self.num_events = 0  # since start-up, merged events counted once
        # A LoRA adapter's namespace -> its served name (BlockStored.lora_name); the engine's
        # adapter registry keeps it (engine/executor/lora_adapters.py).
        self.lora_names: dict[str, str] = {}
        # (tier, entry name) -> the digest of a block a tier holds, as its BlockStored named it
        self._tier_digests: dict[tuple[Tier, str], bytes] = {}

    # -- the pool's hooks ---------------------------------------------------------------------------
    def block_stored(self, group: int, node: int) -> None:
        _, namespace, ext = self._digest(node)
        parent = self.trie.parents[node]
        tokens = list(self.trie.keys[node][1])
        at_root = parent == ROOT_NODE or parent in self._roots()
        parent_hash = None if at_root else self._digest(parent)[2]
        extra = extra_keys(namespace, first=at_root)
        last = self.events[-1] if self.events else None
        if (
            isinstance(last, BlockStored)
            and last.group_idx == self._group_idx(group)
            and last.block_hashes[-1] == parent_hash
            and parent_hash is not None
        ):
            last.block_hashes.append(ext)
            last.token_ids.extend(tokens)
            if last.extra_keys is not None:
                last.extra_keys.append(extra)
            return
        window = self.windows[group] if len(self.windows) > 1 else None
        self._add(
            BlockStored(
                [ext],
                parent_hash,
                tokens,
                self.block_size,
                lora_name=self._lora_name(namespace),
                extra_keys=None if extra is None else [extra],
                group_idx=self._group_idx(group),
                kv_cache_spec_kind=self._kind(group),
                kv_cache_spec_sliding_window=window,
            )
        )

    def block_removed(self, group: int, node: int) -> None:
        entry = self._digests.get(node)
        if entry is None:
            return  # stored before this recorder listened
        ext = entry[2]
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.group_idx == self._group_idx(group):
            last.block_hashes.append(ext)
            return
        self._add(BlockRemoved([ext], group_idx=self._group_idx(group)))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    # -- the offload tiers (engine.core.kv_offload), once per step ---------------------------------
    def tier_events(self, events: list[TierEvent]) -> None:
        """Blocks that entered or left a tier: BlockStored / BlockRemoved with the tier's medium
        ("CPU", "STORAGE", as vLLM's offloading connector names them), under the same hashes the
        pool's events give the same blocks. A removal of a block never announced (a disk entry
        from an earlier run) is left out."""
        for event in events:
            medium = TIER_MEDIUMS[event.tier]
            if event.key is None:
                digest = self._tier_digests.pop((event.tier, event.name), None)
                if digest is not None:
                    self._add(
                        BlockRemoved([external_hash(digest)], medium, self._tier_group(event))
                    )
                continue
            self._tier_stored(event.tier, event.key, medium)

    def _tier_group(self, event: TierEvent) -> int | None:
        group = int(event.name.rsplit("-g", 1)[1]) if "-g" in event.name else 0
        return self._group_idx(group)

    def _tier_stored(self, tier: Tier, key: TierKey, medium: str) -> None:
        bs = self.block_size
        tokens = list(array("i", key.tokens))
        num_blocks = len(tokens) // bs
        parent = self._none_hash
        start = 0
        if num_blocks > 1:  # the block before, when a tier named it already: one hash, not n
            keys = PrefixKeys(key.namespace, tokens, bs)
            known = self._tier_digests.get((tier, keys.key(num_blocks - 2, key.group).name))
            if known is not None:
                parent, start = known, num_blocks - 1
        parent_digest: bytes | None = None  # the digest of the block before the last
        for i in range(start, num_blocks):
            parent_digest = parent if i > 0 else None
            extra = extra_keys(key.namespace, first=i == 0)
            parent = block_digest(parent, tokens[i * bs : (i + 1) * bs], extra)
        self._tier_digests[(tier, key.name)] = parent
        last = tokens[(num_blocks - 1) * bs :]
        extra = extra_keys(key.namespace, first=num_blocks == 1)
        self._add(
            BlockStored(
                [external_hash(parent)],
                None if parent_digest is None else external_hash(parent_digest),
                last,
                bs,
                extra_keys=None if extra is None else [extra],
                medium=medium,
                group_idx=self._group_idx(key.group),
                kv_cache_spec_kind=self._kind(key.group),
                kv_cache_spec_sliding_window=self.windows[key.group]
                if len(self.windows) > 1
                else None,
                lora_name=self._lora_name(key.namespace),
            )
        )

    # -- reading ------------------------------------------------------------------------------------
    def take(self) -> list[KVCacheEvent]:
        """The events since the last take (in order), and prune digests of dropped nodes."""
        events, self.events = self.events, []
        if len(self._digests) > 2 * len(self.trie.keys) + 1024:
            keys = self.trie.keys
            self._digests = {n: d for n, d in self._digests.items() if n in keys}
        return events

    # -- internals ----------------------------------------------------------------------------------
    def _add(self, event: KVCacheEvent) -> None:
        self.events.append(event)
        self.num_events += 1

    def _group_idx(self, group: int) -> int | None:
        return group if len(self.windows) > 1 else None

    def _kind(self, group: int) -> str | None:
        if len(self.windows) == 1:
            return None
        return "full_attention" if self.windows[group] is None else "sliding_window"

    def _lora_name(self, namespace: str | None) -> str | None:
        lora = split_namespace(namespace)[0]
        return self.lora_names.get(lora) if lora is not None else None

    def _roots(self) -> dict[int, str]:
        if len(self._root_namespaces) != len(self.trie.roots):
            self._root_namespaces = {node: ns for ns, node in self.trie.roots.items()}
        return self._root_namespaces

    def _digest(self, node: int) -> tuple[bytes, str | None, int]:
        """The node's digest, namespace and external hash, computing those of its uncomputed
        ancestors first."""
        entry = self._digests.get(node)
        if entry is not None:
            return entry
        start = node
        path = []
        while node not in self._digests and node != ROOT_NODE and node not in self._roots():
            path.append(node)
            node = self.trie.parents[node]
        if node in self._digests:
            digest, namespace, _ = self._digests[node]
        else:
            digest, namespace = self._none_hash, self._roots().get(node)
        for child in reversed(path):
            first = (
                self.trie.parents[child] == ROOT_NODE or self.trie.parents[child] in self._roots()
            )
            extra = extra_keys(namespace, first)
            digest = block_digest(digest, self.trie.keys[child][1], extra)
            self._digests[child] = (digest, namespace, external_hash(digest))
        return self._digests[start]
