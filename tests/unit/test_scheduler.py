"""Scheduler budget, chunking, ordering and preemption invariants (no model)."""

from __future__ import annotations

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.runner_output import RunnerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


def make_group(name: str, num_tokens: int, n: int = 1, max_tokens: int = 16) -> RequestGroup:
    prompt = [hash((name, i)) % 1000 for i in range(num_tokens)]
    group = RequestGroup(name, None, prompt, SamplingParams(n=n, max_tokens=max_tokens), max_tokens)
    for i in range(n):
        group.seqs.append(Sequence(f"{name}/{i}", group, i, list(prompt), num_tokens))
    return group


def run_step(sched: Scheduler, token: int = 7):
    """Schedule, pretend the model ran, append a sampled token where one was due."""
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput())
    for s in out.scheduled:
        if s.needs_sample:
            s.seq.append_token(token)
    return out


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)


def test_long_prompt_is_chunked_to_the_budget():
    sched = make_scheduler(budget=10)
    g = make_group("a", 25)
    sched.add_group(g)
    chunks = []
    for _ in range(3):
        out = run_step(sched)
        chunks.append([s.num_new_tokens for s in out.scheduled])
        assert out.num_batched_tokens <= 10
    assert chunks == [[10], [10], [5]]
    assert [s.needs_sample for s in out.scheduled] == [True]  # only the last chunk samples


def test_decodes_first_then_prefill_chunks_share_the_step():
    sched = make_scheduler(budget=8)
    a, b = make_group("a", 4), make_group("b", 20)
    sched.add_group(a)
    run_step(sched)  # a prefilled (4 tokens) and b's first chunk (4 tokens)
    sched.add_group(b)
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("a/0", 1), ("b/0", 7)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 7


def test_budget_and_max_num_seqs_are_never_exceeded():
    sched = make_scheduler(num_blocks=256, budget=16, max_seqs=3)
    for i in range(6):
        sched.add_group(make_group(f"r{i}", 5 + i))
    for _ in range(20):
        out = run_step(sched)
        assert out.num_batched_tokens <= 16
        assert len(sched.running) <= 3
        assert sum(s.num_new_tokens for s in out.scheduled) == out.num_batched_tokens


def test_first_come_first_served():
    sched = make_scheduler(budget=6)
    for name in "abc":
        sched.add_group(make_group(name, 4))
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["a/0", "b/0"]  # b chunked after a
    assert [s.num_new_tokens for s in out.scheduled] == [4, 2]


def test_preemption_evicts_the_newest_and_frees_its_blocks():
    # 6 blocks of 4 tokens: two sequences of 8 prompt tokens fill 4 blocks, decodes then need more.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_group("a", 8), make_group("b", 8)
    sched.add_group(a)
    sched.add_group(b)
    preempted = []
    for _ in range(12):
        out = run_step(sched)
        preempted += [p.seq_id for p in out.preempted]
        used = sum(len(sched.kv.get_block_table(s)) for s in sched.running)
        assert used + sched.kv.num_free_blocks == 6  # every block accounted for
    assert preempted and preempted[0] == "b/0"
    assert b.metrics.num_preemptions >= 1
    assert a.seqs[0].status is SequenceStatus.RUNNING


def test_preempted_sequence_resumes_with_its_generated_tokens():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)
    a, b = make_group("a", 8), make_group("b", 7)
    sched.add_group(a)
    sched.add_group(b)
    for _ in range(30):
        run_step(sched, token=3)
        for g in (a, b):
            s = g.seqs[0]
            if s.status is SequenceStatus.RUNNING and s.num_output_tokens >= 6:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH)
        if not (sched.waiting or sched.running):
            break
    assert a.seqs[0].num_output_tokens == 6 and b.seqs[0].num_output_tokens == 6
    assert sched.kv.num_free_blocks == 5


def test_followers_wait_for_the_leaders_prefill_and_hit_the_cache():
    sched = make_scheduler(budget=64)
    g = make_group("a", 12, n=3)
    sched.add_group(g)
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["a/0"]
    sched.release_followers(g)
    out = run_step(sched)
    followers = [s for s in out.scheduled if s.seq.index > 0]
    assert len(followers) == 2
    # 12 prompt tokens = 3 blocks; the last token is recomputed, so 2 blocks come from the cache.
    assert all(s.seq.num_cached_tokens == 8 and s.num_new_tokens == 4 for s in followers)


def test_finish_releases_blocks_of_waiting_and_running():
    sched = make_scheduler(budget=4)
    a, b = make_group("a", 6), make_group("b", 6)
    sched.add_group(a)
    sched.add_group(b)
    run_step(sched)
    sched.finish(a.seqs[0], SequenceStatus.FINISHED_ABORTED)
    sched.finish(b.seqs[0], SequenceStatus.FINISHED_ABORTED)
    assert not (sched.waiting or sched.running) and sched.kv.num_free_blocks == sched.kv.num_blocks


def test_preempted_sequence_resumes_from_its_cached_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    g = make_group("a", 10)
    sched.add_group(g)
    for _ in range(4):
        run_step(sched)  # prefill + 3 decodes: 13 tokens, 12 computed = 3 full blocks
    seq = g.seqs[0]
    sched.running.remove(seq)
    sched._preempt(seq)
    assert seq.num_computed_tokens == 0 and sched.kv.num_free_blocks == 16
    out = sched.schedule()
    (resumed,) = out.scheduled
    # The recompute starts after the three cached full blocks, not from scratch.
    assert resumed.start_pos == 12 and resumed.num_new_tokens == seq.num_tokens - 12
    assert seq.num_cached_tokens == 0  # cached_tokens reports the first admission only
    # The cost sheet: 13 computed tokens were lost, 12 came back from the cache: 1 is recomputed.
    assert g.metrics.num_preemptions == 1 and g.metrics.num_recomputed_tokens == 1


def test_recomputed_tokens_count_what_the_cache_does_not_give_back():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    g = make_group("a", 10)
    sched.add_group(g)
    for _ in range(3):
        run_step(sched)  # prefill + 2 decodes: 13 tokens, 12 computed
    seq = g.seqs[0]
    sched.running.remove(seq)
    sched._preempt(seq)
    out = run_step(sched)
    assert out.scheduled[0].num_new_tokens == 13  # everything again, the newest token included
    assert g.metrics.num_preemptions == 1 and g.metrics.num_recomputed_tokens == 12
    assert seq.num_lost_tokens == 0  # counted once, not again at a later admission


def test_followers_share_the_leaders_blocks_with_prefix_caching_off():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    g = make_group("a", 12, n=2)
    sched.add_group(g)
    run_step(sched)
    sched.release_followers(g)
    out = run_step(sched)
    (follower,) = [s for s in out.scheduled if s.seq.index == 1]
    assert follower.num_new_tokens == 4  # two shared blocks; only the last block is recomputed
    leader_table, follower_table = (kv.get_block_table(s) for s in g.seqs)
    assert follower_table[:2] == leader_table[:2]
    assert all(kv.pool.ref_counts[b] == 2 for b in leader_table[:2])
    for s in g.seqs:
        sched.finish(s, SequenceStatus.FINISHED_LENGTH)
    assert kv.num_free_blocks == 64


def _ids(out) -> list[str]:
    return [s.seq.seq_id for s in out.scheduled]


def test_requests_behind_a_kv_blocked_head_are_served_when_they_fit():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a = make_group("a", 13, max_tokens=3)  # 4 blocks: its prompt and all its output tokens
    sched.add_group(a)
    run_step(sched)
    assert sched.kv.num_free_blocks == 2
    big, small = make_group("big", 12), make_group("small", 4)  # 3 blocks (blocked), 1 block
    sched.add_group(big)
    sched.add_group(small)
    out = run_step(sched)
    assert _ids(out) == ["a/0", "small/0"]  # the small request did not wait behind the big one
    assert list(sched.waiting) == [big.seqs[0]] and sched.bypassed == {"big/0": 1}
    # Once `a` is done, the head gets its blocks at the next step.
    sched.finish(a.seqs[0], SequenceStatus.FINISHED_LENGTH)
    out = run_step(sched)
    assert "big/0" in _ids(out) and not sched.waiting and sched.bypassed == {}


def test_a_blocked_head_lets_only_a_bounded_number_go_first():
    from engine.core.scheduler import HEAD_BYPASS_LIMIT

    sched = make_scheduler(num_blocks=4 + 7, block_size=4, budget=256, max_seqs=32)
    a = make_group("a", 13, max_tokens=3)
    sched.add_group(a)
    run_step(sched)
    big = make_group("big", 32)  # 8 blocks: never fits while `a` holds 4 of the 11
    smalls = [make_group(f"s{i}", 3, max_tokens=1) for i in range(HEAD_BYPASS_LIMIT + 3)]
    sched.add_group(big)
    for g in smalls:
        sched.add_group(g)
    out = run_step(sched)
    admitted = [i for i in _ids(out) if i.startswith("s")]
    # Each small prompt fits (1 block of the 7 free), but only HEAD_BYPASS_LIMIT pass the head.
    assert admitted == [f"s{i}/0" for i in range(HEAD_BYPASS_LIMIT)]
    assert sched.kv.num_free_blocks >= 1  # room was left: the limit, not the pool, stopped them
    assert sched.bypassed["big/0"] == HEAD_BYPASS_LIMIT
    for s in list(sched.running):
        sched.finish(s, SequenceStatus.FINISHED_LENGTH)
    # Blocks are back: the head goes first now, then the rest behind it in arrival order.
    out = run_step(sched)
    assert _ids(out)[0] == "big/0"
    assert _ids(out)[1:] == [f"s{i}/0" for i in range(HEAD_BYPASS_LIMIT, len(smalls))]


def test_without_blocked_sequences_admission_stays_first_come_first_served():
    sched = make_scheduler(num_blocks=64, budget=8)
    groups = [make_group(f"r{i}", 6) for i in range(3)]
    for g in groups:
        sched.add_group(g)
    out = run_step(sched)
    # The budget (not KV) stops admission: the second prompt is chunked, the third waits its turn.
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("r0/0", 6), ("r1/0", 2)]
    assert list(sched.waiting) == [groups[2].seqs[0]] and sched.bypassed == {}
