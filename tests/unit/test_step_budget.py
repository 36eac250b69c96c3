"""The step-time token budget (engine.core.step_budget) against a fake cost model: no clocks, each
step's "duration" is a known function of what it carries, so the tests are deterministic."""

from __future__ import annotations

import pytest

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.step_budget import (
    AUTO_TARGET_STEP_MS,
    CALIBRATION_STEPS,
    MIN_PREFILL_SHARE,
    WARMUP_TOKENS,
    StepBudget,
    StepLoad,
    chunk_pairs,
    resolve_target_step_ms,
)
from tests.unit.test_scheduler import make_group, run_step

TARGET = 0.2  # seconds


def fake_seconds(load: StepLoad) -> float:
    """A 2-core CPU, roughly: 15 ms a step, 2 ms a decode, 0.6 ms a prefill token, and attention
    growing with the context (40 ns per query-key pair)."""
    return (
        0.015
        + 0.002 * load.num_decodes
        + 0.0006 * load.num_prefill_tokens
        + 4e-8 * load.attention_pairs
    )


def test_step_load_counts_decodes_tokens_and_pairs():
    load = StepLoad.of([(1, 40), (1, 7), (100, 0), (50, 300)])
    assert (load.num_decodes, load.num_prefill_tokens) == (2, 150)
    assert load.attention_pairs == chunk_pairs(100, 0) + chunk_pairs(50, 300)
    assert chunk_pairs(4, 0) == 1 + 2 + 3 + 4  # row j of a fresh chunk reads j + 1 keys


def test_nothing_decoding_takes_the_full_budget():
    budget = StepBudget(TARGET, 2048)
    assert budget.token_budget(0, 0) == 2048
    for _ in range(10):  # even once it knows prefill steps are slow
        budget.observe(StepLoad(0, 2048, chunk_pairs(2048, 0)), 3.0)
    assert budget.token_budget(0, 4096) == 2048


def test_warmup_then_the_fit_meets_the_target_as_the_context_grows():
    budget = StepBudget(TARGET, 2048)
    decodes, start, chunks = 6, 0, []
    for _ in range(3):  # the streams decode alone first
        budget.observe(StepLoad(decodes), fake_seconds(StepLoad(decodes)))
    for _ in range(60):  # a long prompt prefilled beside 6 decoding streams
        n = budget.token_budget(decodes, start) - decodes
        load = StepLoad(decodes, n, chunk_pairs(n, start))
        budget.observe(load, fake_seconds(load))
        chunks.append((n, fake_seconds(load)))
        start += n
    assert chunks[0][0] == WARMUP_TOKENS
    # Once calibrated (and grown past what it had measured), every step lands near the target:
    settled = chunks[CALIBRATION_STEPS + 3 :]
    assert all(0.85 * TARGET <= seconds <= 1.02 * TARGET for _, seconds in settled), settled
    # ... with smaller chunks as the prompt's attention context grows.
    sizes = [n for n, _ in settled]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 1.5 * sizes[-1]


def test_growth_is_bounded_by_what_was_measured():
    budget = StepBudget(TARGET, 2048)
    for n in (64, 64, 64, 64):  # only small chunks seen, all cheap
        load = StepLoad(4, n, chunk_pairs(n, 0))
        budget.observe(load, fake_seconds(load))
    assert budget.calibrated
    assert budget.prefill_tokens(4, 0) <= 2 * 64


def test_when_decodes_alone_fill_the_target_prefill_gets_as_long_as_they_take():
    """60 streams at 5 ms each overrun the 200 ms target by themselves: the long prompt still gets
    as much time per step as the decodes (ITL about twice a decode step), not a crawl."""
    budget = StepBudget(TARGET, 2048)
    budget.observe(StepLoad(60), fake_seconds(StepLoad(60)) + 0.003 * 60)
    start = 0
    for _ in range(40):
        n = budget.prefill_tokens(60, start)
        load = StepLoad(60, n, chunk_pairs(n, start))
        budget.observe(load, fake_seconds(load) + 0.003 * 60)
        start += n
    decode_seconds = 0.015 + 0.005 * 60
    assert budget.decode_s == pytest.approx(decode_seconds)
    n = budget.prefill_tokens(60, start)
    prefill_seconds = 0.0006 * n + 4e-8 * chunk_pairs(n, start)
    assert decode_seconds > TARGET > MIN_PREFILL_SHARE * TARGET
    assert 0.9 * decode_seconds <= prefill_seconds <= 1.05 * decode_seconds


def test_the_fit_recovers_from_an_outlier_step():
    """A first step slowed 30x (a cold start, a busy neighbour) is forgotten within a few steps."""
    budget = StepBudget(TARGET, 2048)
    budget.observe(StepLoad(4), fake_seconds(StepLoad(4)))
    start, first = 0, True
    for _ in range(30):
        n = budget.prefill_tokens(4, start)
        load = StepLoad(4, n, chunk_pairs(n, start))
        budget.observe(load, fake_seconds(load) * (30 if first else 1))
        start, first = start + n, False
    n = budget.prefill_tokens(4, start)
    assert 0.85 * TARGET <= fake_seconds(StepLoad(4, n, chunk_pairs(n, start))) <= 1.02 * TARGET


def test_a_slower_machine_shrinks_the_chunks():
    fast, slow = StepBudget(TARGET, 2048), StepBudget(TARGET, 2048)
    for budget, factor in ((fast, 1.0), (slow, 3.0)):
        start = 0
        budget.observe(StepLoad(4), factor * fake_seconds(StepLoad(4)))
        for _ in range(30):
            n = budget.prefill_tokens(4, start)
            load = StepLoad(4, n, chunk_pairs(n, start))
            budget.observe(load, factor * fake_seconds(load))
            start = (start + n) % 2000
    assert slow.prefill_tokens(4, 500) < 0.5 * fast.prefill_tokens(4, 500)


def test_target_must_be_positive_and_config_rejects_negative():
    with pytest.raises(ValueError, match="target step time must be positive"):
        StepBudget(0, 2048)
    with pytest.raises(ValueError, match="target_step_ms"):
        SchedulerConfig(target_step_ms=-1)
    assert SchedulerConfig(target_step_ms=0).target_step_ms == 0


def test_auto_is_the_budget_on_cpu_under_block_weights_only():
    assert resolve_target_step_ms(None, on_cpu=True, block_weights=True) == AUTO_TARGET_STEP_MS
    assert resolve_target_step_ms(None, on_cpu=True, block_weights=False) == 0
    assert resolve_target_step_ms(None, on_cpu=False, block_weights=True) == 0
    assert resolve_target_step_ms(0, on_cpu=True, block_weights=True) == 0
    assert resolve_target_step_ms(350, on_cpu=True, block_weights=False) == 350
    assert resolve_target_step_ms(350, on_cpu=False, block_weights=True) == 0  # GPUs: fixed


def _scheduler(budget_tokens: int = 2048) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget_tokens),
        KVCacheManager(4096, 16),
    )
    sched.step_budget = StepBudget(TARGET, budget_tokens)
    return sched


def _simulate(sched: Scheduler, steps: int) -> list[tuple[int, int, float]]:
    """Run steps on the fake cost model: (decodes, prefill tokens, seconds) per step."""
    record = []
    for _ in range(steps):
        out = run_step(sched)
        if out.is_empty:
            break
        load = StepLoad.of((s.num_new_tokens, s.start_pos) for s in out.scheduled)
        assert sched.step_budget is not None
        sched.step_budget.observe(load, fake_seconds(load))
        record.append((load.num_decodes, load.num_prefill_tokens, fake_seconds(load)))
    return record


def test_long_prompts_do_not_freeze_decoding_streams():
    """Four streams decode while two 3000-token prompts arrive: every stream gets a token every
    step, steps stay near the target once calibrated, and the prompts still finish."""
    sched = _scheduler()
    streams = [make_group(f"s{i}", 20, max_tokens=400) for i in range(4)]
    for g in streams:
        sched.add_group(g)
    _simulate(sched, 2)  # the streams prefill and start decoding
    long_prompts = [make_group(f"p{i}", 3000, max_tokens=2) for i in range(2)]
    for g in long_prompts:
        sched.add_group(g)
    before = [len(g.seqs[0].token_ids) for g in streams]
    record = _simulate(sched, 120)
    prefill_steps = [r for r in record if r[1] > 0]
    assert all(r[0] >= 4 for r in prefill_steps)  # the 4 streams decoded in every one of them
    steps = len(record)
    assert all(len(g.seqs[0].token_ids) - b >= steps for g, b in zip(streams, before, strict=True))
    settled = prefill_steps[CALIBRATION_STEPS + 3 :]
    assert max(seconds for _, _, seconds in settled) <= 1.05 * TARGET
    assert all(g.seqs[0].num_computed_tokens >= 3000 for g in long_prompts)  # both prefilled


def test_without_the_step_budget_the_fixed_budget_is_unchanged():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(512, 16)
    )
    sched.add_group(make_group("a", 8, max_tokens=50))
    run_step(sched)
    sched.add_group(make_group("b", 500, max_tokens=2))
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [1, 63]
