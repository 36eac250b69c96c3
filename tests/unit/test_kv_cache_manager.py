"""Block allocation, reference counts, exact chained prefix keys and LRU eviction (no model)."""

from __future__ import annotations

from engine.core.block_pool import ROOT_NODE, block_key
from engine.core.kv_cache_manager import KVCacheManager, PrefixHit
from engine.core.request import RequestGroup, Sequence
from engine.core.sampling_params import SamplingParams


def make_seq(tokens: list[int], name: str = "r", params: SamplingParams | None = None) -> Sequence:
    group = RequestGroup(name, None, list(tokens), params or SamplingParams(), 16)
    seq = Sequence(f"{name}/0", group, 0, list(tokens), len(tokens))
    group.seqs.append(seq)
    return seq


def hit_blocks(hit: PrefixHit | None) -> list[int]:
    """The first group's blocks of a prefix hit ([] for a miss)."""
    return [] if hit is None else hit.tables[0]


def compute(kv: KVCacheManager, seq: Sequence, hit: PrefixHit | None = None) -> None:
    """Admit `seq` (after its cached prefix) and mark all of its tokens computed."""
    seq.num_computed_tokens = 0
    num_hit = hit.num_blocks if hit is not None else 0
    assert kv.allocate_slots(seq, seq.num_tokens - num_hit * kv.block_size, hit)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seqs = [make_seq(list(range(i * 10, i * 10 + 7)), f"r{i}") for i in range(3)]
    for s in seqs:
        assert kv.allocate_slots(s, 7)
        assert len(kv.get_block_table(s)) == 2
    assert kv.num_free_blocks == 2
    assert len({b for s in seqs for b in kv.get_block_table(s)}) == 6  # no block handed out twice
    for s in seqs:
        kv.free(s)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_seq(list(range(8)), "a"), make_seq(list(range(100, 110)), "b")
    assert kv.allocate_slots(a, 8)
    assert not kv.allocate_slots(b, 10)  # needs 3, only 1 free
    assert kv.num_free_blocks == 1 and kv.get_block_table(b) == []


def test_growing_a_sequence_allocates_only_at_block_boundaries():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = make_seq([1, 2, 3])
    assert kv.allocate_slots(s, 3)
    s.num_computed_tokens = 3
    s.append_token(4)
    assert kv.allocate_slots(s, 1) and len(kv.get_block_table(s)) == 1
    s.num_computed_tokens = 4
    s.append_token(5)
    assert kv.allocate_slots(s, 1) and len(kv.get_block_table(s)) == 2


def test_shared_prefix_hits_whole_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)), "a")
    compute(kv, a)
    b = make_seq(list(range(9)) + [99, 98], "b")
    hits = hit_blocks(kv.find_cached_prefix(b))
    assert hits == kv.get_block_table(a)[:2]
    # An identical prompt still recomputes its last token: 8 tokens = 2 blocks, only 1 reusable.
    c = make_seq(list(range(8)), "c")
    compute(kv, make_seq(list(range(8)), "d"))
    assert len(hit_blocks(kv.find_cached_prefix(c))) == 1


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_seq(list(range(9)), "a")
    compute(kv, a)
    b = make_seq(list(range(9)), "b")
    hits = kv.find_cached_prefix(b)
    assert hits is not None and hits.num_blocks == 2
    compute(kv, b, hits)
    shared = kv.get_block_table(a)[:2]
    assert kv.get_block_table(b)[:2] == shared
    assert all(kv.pool.ref_counts[x] == 2 for x in shared)
    kv.free(a)
    assert all(kv.pool.ref_counts[x] == 1 for x in shared)
    assert not any(x in kv.pool.free_queue for x in shared)  # still referenced: never reusable
    kv.free(b)
    assert kv.num_free_blocks == 6


def test_key_is_chained_on_the_parent():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    compute(kv, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    # Same second block, different first block: no hit at all.
    assert hit_blocks(kv.find_cached_prefix(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b"))) == []


# Python hashes ints modulo the Mersenne prime 2**61 - 1, so these two token blocks have equal tuple
# hashes: a cache trusting hash((parent, tokens)) would hand one prompt the other's KV.
COLLIDING = (0, 1, 2, 3), (2**61 - 1, 1, 2, 3)


def test_colliding_hashes_never_share_kv():
    a_tokens, b_tokens = COLLIDING
    assert hash(block_key(ROOT_NODE, a_tokens)) == hash(block_key(ROOT_NODE, b_tokens))
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq([*a_tokens, 7, 8, 9, 10, 11], "a")
    compute(kv, a)
    b = make_seq([*b_tokens, 7, 8, 9, 10, 11], "b")
    assert hit_blocks(kv.find_cached_prefix(b)) == []
    compute(kv, b)  # b computes (and caches) its own first block
    assert kv.get_block_table(b)[0] != kv.get_block_table(a)[0]
    # Both contents stay cached side by side, each found only by its own tokens.
    again_a = hit_blocks(kv.find_cached_prefix(make_seq([*a_tokens, 7, 8, 9, 10, 11], "a2")))
    again_b = hit_blocks(kv.find_cached_prefix(make_seq([*b_tokens, 7, 8, 9, 10, 11], "b2")))
    assert again_a == kv.get_block_table(a)[:2] and again_b == kv.get_block_table(b)[:2]


def test_a_colliding_parent_never_leads_to_the_other_prompts_children():
    a_tokens, b_tokens = COLLIDING
    kv = KVCacheManager(num_blocks=8, block_size=4)
    compute(kv, make_seq([*a_tokens, 5, 6, 7, 8, 9], "a"))
    # b shares a's second block but not its first: neither block may be reused.
    assert hit_blocks(kv.find_cached_prefix(make_seq([*b_tokens, 5, 6, 7, 8, 9], "b"))) == []


def test_evicted_parent_orphans_its_children():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(9)), "a")  # 2 full blocks + a partial one
    compute(kv, a)
    kv.free(a)
    # Reuse all three blocks for other content: a's blocks are evicted, their keys forgotten.
    b = make_seq(list(range(100, 112)), "b")
    assert kv.allocate_slots(b, 12)
    assert kv.find_cached_prefix(make_seq(list(range(9)), "a2")) is None
    assert kv.pool.cached == {} and len(kv.pool.trie) == 0


def test_finished_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(9)), "a")  # 3 blocks, 2 full
    compute(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    again = make_seq(list(range(9)), "a2")
    # Still cached after the request finished.
    assert len(hit_blocks(kv.find_cached_prefix(again))) == 2
    # Taking 3 fresh blocks evicts the partial tail block first and then the last full block (LRU order
    # puts a sequence's tail ahead of its prefix); the first block survives.
    b = make_seq(list(range(100, 112)), "b")
    assert kv.allocate_slots(b, 12)
    hits = hit_blocks(kv.find_cached_prefix(make_seq(list(range(9)), "a3")))
    assert len(hits) == 1
    assert hits[0] not in kv.get_block_table(b)


def test_referenced_block_is_never_evicted():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(8)), "a")
    compute(kv, a)  # 2 blocks referenced
    b = make_seq(list(range(50, 58)), "b")
    assert not kv.allocate_slots(b, 8)  # only 1 free: must not steal a's blocks
    assert kv.get_block_table(a) and all(kv.pool.ref_counts[x] == 1 for x in kv.get_block_table(a))


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute(kv, make_seq(list(range(9)), "a"))
    assert kv.find_cached_prefix(make_seq(list(range(9)), "b")) is None


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    compute(kv, make_seq(list(range(9)), "a"))
    seq = make_seq(list(range(9)), "b", SamplingParams(prompt_logprobs=1))
    assert hit_blocks(kv.find_cached_prefix(seq)) == []


def test_namespaces_never_share_kv_and_the_plain_model_is_unaffected():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    tokens = list(range(13))

    def seq_in(name: str, namespace: str | None) -> Sequence:
        seq = make_seq(tokens, name)
        seq.group.cache_namespace = namespace
        return seq

    base, lora_a = seq_in("base", None), seq_in("a", "adapter-a")
    compute(kv, base)
    assert kv.find_cached_prefix(seq_in("a0", "adapter-a")) is None  # base KV is not the adapter's
    compute(kv, lora_a)
    assert (
        hit_blocks(kv.find_cached_prefix(seq_in("a1", "adapter-a")))
        == kv.get_block_table(lora_a)[:3]
    )
    assert kv.find_cached_prefix(seq_in("b", "adapter-b")) is None  # another namespace misses
    assert hit_blocks(kv.find_cached_prefix(seq_in("base1", None))) == kv.get_block_table(base)[:3]
    for seq in (base, lora_a):
        kv.free(seq)
    assert kv.num_free_blocks == 32
    # Evicting every block frees every content node (namespace roots stay, holding nothing).
    taken = [make_seq(list(range(1000 + 4 * i, 1004 + 4 * i)), f"x{i}") for i in range(32)]
    for seq in taken:
        assert kv.allocate_slots(seq, 4)
    for seq in taken:
        kv.free(seq)
    assert len(kv.pool.trie) == 0 and kv.pool.trie.refs == {}


def test_the_pool_view_reports_holders_references_and_cached_free_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(9)), "a")  # 2 full blocks + 1 token
    compute(kv, a)
    b = make_seq(list(range(8)) + [50, 51], "b")
    compute(kv, b, kv.find_cached_prefix(b))  # shares a's 2 full blocks
    view = kv.pool.view
    shared = kv.get_block_table(a)[:2]
    assert kv.block_holders()[shared[0]] == ["a/0", "b/0"]
    assert [view.ref_count(x) for x in shared] == [2, 2] and all(view.is_cached(x) for x in shared)
    assert view.cached_free_blocks() == ()
    kv.free(b)
    kv.free(a)
    # A sequence's tail goes first in eviction order: a's second full block before its first.
    assert view.cached_free_blocks() == (shared[1], shared[0])
    assert view.num_free == view.num_blocks == 8 and kv.block_holders() == {}
