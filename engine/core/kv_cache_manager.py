"""KV block bookkeeping (no torch): per-sequence block tables, one per KV cache group, over one shared
block pool (engine.core.block_pool), automatic prefix caching by exact block keys, and the release of
blocks that fall out of a sliding-window group's window.

Every group's table of a sequence has one entry per block of the sequence. In a sliding group the
blocks wholly before the window of every query the sequence will still compute are given back to the
pool (or never taken, after a prefix hit); their entries become NULL_BLOCK placeholders, always a
leading run of the table (`num_skipped`), which attention never reads. See engine.core.kv_cache_groups
for the layout and why one pool serves all groups."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import BlockPool, block_key
from engine.core.kv_cache_groups import first_needed_block
from engine.core.kv_offload import TIER_BLOCK, KVTiers, TierLoad
from engine.core.request import Sequence

NULL_BLOCK = 0  # a released / never-taken entry: a valid block id so a stray read stays in bounds


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found in the cache


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The leading `num_blocks` blocks of a sequence whose KV other sequences' blocks already hold:
    per group, `num_blocks` entries (NULL_BLOCK before the group's first needed block)."""

    num_blocks: int
    tables: tuple[list[int], ...]
    loads: tuple[TierLoad, ...] = ()  # entries (TIER_BLOCK in `tables`) a KV offload tier fills


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows  # per KV cache group: its sliding window, or None
        self.sliding = [g for g, w in enumerate(windows) if w is not None]
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[list[int]]] = {}  # seq id -> a table per group
        self.num_skipped: dict[str, list[int]] = {}  # seq id -> leading placeholders per group
        self.block_tokens: dict[str, list[tuple[int, ...]]] = {}  # token ids of each full block
        self.node_chains: dict[str, list[int]] = {}  # trie nodes of a sequence's full blocks
        self.stats = PrefixCacheStats()
        self.tiers: KVTiers | None = None  # KV offload tiers of evicted blocks (None: off)
        self._no_tables: list[list[int]] = [[] for _ in windows]  # never mutated

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once (over all groups) when steps
        compute at most `max_chunk` of its tokens: what the pool must at least have."""
        full = self.blocks_needed(num_tokens)
        total = 0
        for window in self.windows:
            if window is None:
                total += full
            else:  # the window before a step's first query, that step's chunk, block rounding
                total += min(full, self.blocks_needed(window + max_chunk + self.block_size - 2))
        return total

    # -- reading tables ---------------------------------------------------------------------------
    def get_block_tables(self, seq: Sequence) -> list[list[int]]:
        """Per group, the sequence's live block table (entries before num_skipped are placeholders)."""
        return self.block_tables.get(seq.seq_id) or self._no_tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The first group's table (the only one of a one-group model)."""
        return self.get_block_tables(seq)[0]

    def holds_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def held_blocks(self, seq_id: str) -> list[int]:
        """The real blocks a sequence references, over all groups (placeholders left out)."""
        tables = self.block_tables.get(seq_id)
        if tables is None:
            return []
        skipped = self.num_skipped[seq_id]
        return [b for g, table in enumerate(tables) for b in table[skipped[g] :]]

    def block_holders(self) -> dict[int, list[str]]:
        """Block id -> the ids of the sequences holding it (every group's live blocks)."""
        holders: dict[int, list[str]] = {}
        for seq_id in self.block_tables:
            for block_id in self.held_blocks(seq_id):
                holders.setdefault(block_id, []).append(seq_id)
        return holders

    def num_held_blocks(self, seq: Sequence) -> int:
        tables = self.block_tables.get(seq.seq_id)
        if tables is None:
            return 0
        if len(tables) == 1 and not self.sliding:
            return len(tables[0])
        return sum(len(t) for t in tables) - sum(self.num_skipped[seq.seq_id])

    # -- prefix reuse -----------------------------------------------------------------------------
    def _full_block_tokens(self, seq: Sequence, num_full_blocks: int) -> list[tuple[int, ...]]:
        blocks = self.block_tokens.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(blocks) < num_full_blocks:
            i = len(blocks)
            blocks.append(tuple(seq.token_ids[i * bs : (i + 1) * bs]))
        return blocks

    def _first_needed(self, group: int, num_blocks: int) -> int:
        """The first block group `group` needs to compute from block `num_blocks` on."""
        return first_needed_block(
            self.windows[group], num_blocks * self.block_size, self.block_size
        )

    def find_cached_prefix(self, seq: Sequence) -> PrefixHit | None:
        """The longest cached prefix of `seq`'s tokens (whole blocks, matched exactly) for which every
        group has the blocks the rest of the computation reads: all of them for full attention, those
        of the last `window` positions for a sliding group. At least the last token is always left to
        compute (its logits are needed), and so is every position whose prompt logprobs are wanted."""
        if not self.enable_prefix_caching:
            return None
        max_blocks = seq.num_reusable_tokens // self.block_size
        if max_blocks == 0:
            return None
        nodes: list[int] = []
        trie = self.pool.trie
        parent = trie.root(seq.group.cache_namespace)
        for tokens in self._full_block_tokens(seq, max_blocks)[:max_blocks]:
            node = trie.find(block_key(parent, tokens))
            if node is None:
                break
            nodes.append(node)
            parent = node
        found = [[self.pool.lookup(g, node) for node in nodes] for g in range(self.num_groups)]
        hit = len(nodes)
        loads: list[TierLoad] = []
        tiers = self.tiers
        if tiers is not None:  # the tiers fill the pool's gaps, up to the whole reusable prefix
            hit, loads = tiers.extend(seq, found, max_blocks, self.windows, self._longest_usable)
        else:
            hit = self._longest_usable(found, hit)
        if hit == 0:
            return None
        tables: list[list[int]] = []
        for g, blocks in enumerate(found):
            first = self._first_needed(g, hit)
            needed = [b for b in blocks[first:hit] if b is not None]
            assert len(needed) == hit - first, "a usable hit has every block it reads"
            tables.append([NULL_BLOCK] * first + needed)
        return PrefixHit(hit, tuple(tables), tuple(loads))

    def _longest_usable(self, found: list[list[int | None]], limit: int) -> int:
        """The largest h <= limit at which every group has the blocks a sequence resuming at block h
        reads, [first_needed(h), h) (all of [0, h) for full attention), in `found`. Usable at h does
        not make a sliding group usable at h - 1 (its window then reaches one block further back),
        so the groups agree on one h, never on the smallest of their own longest ones."""
        usable = [True] * (limit + 1)  # usable[h], h = 0..limit
        for g, blocks in enumerate(found):
            run = 0  # found blocks in a row ending at block i
            for i in range(limit):
                run = run + 1 if blocks[i] is not None else 0
                if run < i + 1 - self._first_needed(g, i + 1):
                    usable[i + 1] = False
        return next((h for h in range(limit, 0, -1) if usable[h]), 0)

    def _shared_from(self, source: Sequence, num_blocks: int) -> PrefixHit | None:
        """`source`'s blocks for the leading `num_blocks` blocks, if it still holds all that a
        sequence computing on from there reads."""
        tables = self.block_tables.get(source.seq_id)
        if not tables or num_blocks == 0:
            return None
        skipped = self.num_skipped[source.seq_id]
        shared = []
        for g, table in enumerate(tables):
            first = self._first_needed(g, num_blocks)
            if skipped[g] > first:
                return None  # its window has moved on past what a newcomer still reads
            shared.append([NULL_BLOCK] * first + table[first:num_blocks])
        return PrefixHit(num_blocks, tuple(shared))

    def sibling_prefix(self, seq: Sequence) -> PrefixHit | None:
        """For a follower (n > 1 samples, or a score choice) with prefix caching off: the computed blocks
        of the group's shared prompt held by a sibling (the leader, or a follower that took them), shared
        by reference so the prompt is prefilled once per request either way."""
        if seq.index == 0:
            return None
        limit = min(seq.num_reusable_tokens, len(seq.group.prompt_token_ids))
        best: PrefixHit | None = None
        for other in seq.group.seqs:
            if other is seq:
                continue
            num_blocks = min(other.num_computed_tokens, limit) // self.block_size
            if best is None or num_blocks > best.num_blocks:
                best = self._shared_from(other, num_blocks) or best
        return best

    def share_prefix(self, seq: Sequence, source: Sequence) -> None:
        """Give a waiting follower references to `source`'s computed blocks of the group's shared prompt
        now, so they outlive `source` (a score leader ends with its prefill)."""
        assert seq.num_computed_tokens == 0 and seq.seq_id not in self.block_tables
        limit = min(seq.num_reusable_tokens, len(seq.group.prompt_token_ids))
        hit = self._shared_from(source, min(source.num_computed_tokens, limit) // self.block_size)
        if hit is None:
            return
        self._adopt(seq, hit)
        seq.num_computed_tokens = hit.num_blocks * self.block_size

    def _adopt(self, seq: Sequence, hit: PrefixHit) -> list[list[int]]:
        """Start `seq`'s tables with references to the blocks of `hit`."""
        skipped = [self._first_needed(g, hit.num_blocks) for g in range(self.num_groups)]
        for g, table in enumerate(hit.tables):
            for block_id in table[skipped[g] :]:
                if block_id != TIER_BLOCK:
                    self.pool.touch(block_id)
        tables = [list(t) for t in hit.tables]
        if hit.loads:  # fresh blocks (taken after the touches, so never one of the hit's own)
            assert self.tiers is not None
            block_ids = [self.pool.allocate() for _ in hit.loads]
            for (g, i, _, _), block_id in zip(hit.loads, block_ids, strict=True):
                tables[g][i] = block_id
            self.tiers.adopted(seq, list(hit.loads), block_ids)
        self.block_tables[seq.seq_id] = tables
        self.num_skipped[seq.seq_id] = skipped
        return tables

    def record_prefix_query(
        self, num_query_tokens: int, num_hit_tokens: int, step: PrefixCacheStats | None = None
    ) -> None:
        """Count a lookup in the totals (and in `step`, the lookups of the step being scheduled)."""
        if not self.enable_prefix_caching:
            return  # followers sharing their leader's blocks are not cache lookups
        for counts in (self.stats, step) if step is not None else (self.stats,):
            counts.queries += num_query_tokens
            counts.hits += num_hit_tokens

    def record_tier_query(self, seq: Sequence, num_hit_tokens: int) -> None:
        if self.tiers is not None and self.enable_prefix_caching:
            self.tiers.record_query(seq.num_reusable_tokens, num_hit_tokens)

    # -- allocation -------------------------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq` (after `hit`, when admitting), first
        giving back the sliding groups' blocks that no query from here on reads. Returns False, taking
        nothing, when the pool cannot provide the blocks."""
        tables = self.block_tables.get(seq.seq_id)
        if tables is not None and hit is None:
            if self.sliding:
                self._release(seq, tables)
            if seq.num_computed_tokens + num_new_tokens <= len(tables[0]) * self.block_size:
                return True  # most decode steps: the token fits in the last block
        num_computed = seq.num_computed_tokens
        if hit is not None:
            assert tables is None, "a prefix hit is only taken on admission"
            num_computed += hit.num_blocks * self.block_size
            length = hit.num_blocks
        else:
            length = len(tables[0]) if tables is not None else 0
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - length
        revived = 0  # reviving an unreferenced cached block takes it out of the free queue too
        if hit is not None:
            for g, table in enumerate(hit.tables):
                first = self._first_needed(g, hit.num_blocks)
                revived += sum(1 for b in table[first:] if b >= 0 and self.pool.ref_counts[b] == 0)
            revived += len(hit.loads)  # a tier's blocks are loaded into fresh ones
        if max(0, num_new_blocks) * self.num_groups + revived > self.pool.num_free:
            if tables is None or hit is not None or not self._release(seq, tables, hold=False):
                return False
            # The prompt blocks held for siblings went back (they compute their own prompt): a
            # sequence never waits, or preempts itself, for blocks it keeps only for others.
            if max(0, num_new_blocks) * self.num_groups > self.pool.num_free:
                return False
        if hit is not None:
            tables = self._adopt(seq, hit)
        elif tables is None:
            tables = self.block_tables[seq.seq_id] = [[] for _ in self.windows]
            self.num_skipped[seq.seq_id] = [0] * self.num_groups
        for table in tables:
            table.extend(self.pool.allocate() for _ in range(max(0, num_new_blocks)))
        return True

    def _release_point(self, seq: Sequence) -> int:
        """The first position any query still reads from: the next one `seq` computes, or, while a
        sibling has yet to take the group's shared prompt blocks from it, that share's end."""
        position = seq.num_computed_tokens
        group = seq.group
        if len(group.seqs) > 1:
            for other in group.seqs:
                if (
                    other is not seq
                    and other.num_computed_tokens == 0
                    and not other.status.finished
                ):
                    shared_end = (len(group.prompt_token_ids) - 1) // self.block_size
                    return min(position, shared_end * self.block_size)
        return position

    def release_out_of_window(self, seq: Sequence) -> None:
        """Give back the sliding groups' blocks no query of `seq` reads any more (after a step; call
        cache_full_blocks first so they stay reusable while cached)."""
        if self.sliding:
            tables = self.block_tables.get(seq.seq_id)
            if tables is not None:
                self._release(seq, tables)

    def _release(self, seq: Sequence, tables: list[list[int]], hold: bool = True) -> bool:
        """Give back the sliding groups' blocks before the release point (hold=False: before the
        next position `seq` computes, its siblings' share or not); True when any went back."""
        position = self._release_point(seq) if hold else seq.num_computed_tokens
        skipped = self.num_skipped[seq.seq_id]
        released = False
        for g in self.sliding:
            table = tables[g]
            first = min(first_needed_block(self.windows[g], position, self.block_size), len(table))
            for i in range(skipped[g], first):  # oldest first: the first eviction candidates
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
                released = True
            skipped[g] = max(skipped[g], first)
        return released

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the now-computed full blocks of `seq` so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        tables = self.block_tables.get(seq.seq_id)
        if not tables:
            return
        chain = self.node_chains.setdefault(seq.seq_id, [])
        start = len(chain)
        if num_full <= start:
            return
        blocks = self._full_block_tokens(seq, num_full)
        trie = self.pool.trie
        root = trie.root(seq.group.cache_namespace)
        for i in range(start, num_full):
            parent = chain[-1] if chain else root
            chain.append(trie.intern(parent, block_key(parent, blocks[i])))
        skipped = self.num_skipped[seq.seq_id]
        for g, table in enumerate(tables):
            for i in range(max(start, skipped[g]), num_full):
                self.pool.register(g, table[i], chain[i])

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release `seq`'s blocks past its first `num_tokens` tokens in every group (rejected
        speculative tokens' KV). Never registered in the prefix cache: registration covers
        computed, held tokens only. The tables are replaced, not shortened in place, so views of
        them see new tables."""
        tables = self.block_tables.get(seq.seq_id)
        keep = self.blocks_needed(num_tokens)
        if tables is None or len(tables[0]) <= keep:
            return
        for table in tables:
            for block_id in reversed(table[keep:]):
                self.pool.release(block_id)
        self.block_tables[seq.seq_id] = [table[:keep] for table in tables]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its tail blocks become the first eviction candidates."""
        tables = self.block_tables.pop(seq.seq_id, None)
        if tables is not None:
            skipped = self.num_skipped.pop(seq.seq_id)
            for g, table in enumerate(tables):
                for block_id in reversed(table[skipped[g] :]):
                    self.pool.release(block_id)
        self.block_tokens.pop(seq.seq_id, None)
        for node in reversed(self.node_chains.pop(seq.seq_id, [])):
            self.pool.trie.unref(node)
