"""Speculative decoding without a model: vLLM-compatible config parsing and its errors, the n-gram
proposer against a plain-scan reference, the acceptance-aware back-off and batch-size switch, the
scheduler's budgeting and KV roll-back of drafts, and the verification rule's statistics (rejection
sampling keeps the target distribution)."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from engine.core.config import EngineConfig, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.ngram_proposer import NgramIndex, propose_ngram
from engine.core.request import RequestGroup, Sequence
from engine.core.runner_output import RunnerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.spec_config import SpeculativeConfig
from engine.core.spec_cost import DRAFT_ROW_COST, STEP_OVERHEAD_ROWS, MeasuredSpecCost
from engine.core.speculator import (
    FIRST_PAUSE,
    PROBE_PAUSE_CAP,
    PROBE_SHARE,
    Acceptance,
    Speculator,
    best_length,
)
from engine.executor.sampler import Sampler, SamplingRow
from engine.executor.spec_verify import num_accepted, verification_rows
from server.settings import add_serve_arguments, build_configs, resolve


# ---------------------------------------------------------------- config
def test_vllm_json_parses_with_vllm_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert c == SpeculativeConfig("ngram", 4, 5, 5, None)
    c = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse(
        {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4, "disable_by_batch_size": 8}
    )  # fmt: skip
    assert (c.method, c.prompt_lookup_min, c.disable_by_batch_size) == ("ngram", 1, 8)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("null") is None
    assert EngineConfig().speculative_config is None  # off unless configured
    assert EngineConfig.from_options(
        None, speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    ).speculative_config == SpeculativeConfig("ngram", 3)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ('{"method": "eagle3", "model": "x"}', "'eagle3' is not supported"),
        ('{"method": "medusa", "num_speculative_tokens": 3}', "'medusa' is not supported"),
        ('{"model": "/some/draft"}', "draft_model needs num_speculative_tokens"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "draft_model needs \"model\""),
        ('{"method": "layer_skip", "num_speculative_tokens": 3}', "needs num_draft_layers"),
        ('{"method": "layer_skip", "num_speculative_tokens": 3, "num_draft_layers": 1, '
         '"model": "x"}', "model does not apply to method layer_skip"),
        ('{"model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2}', "does not apply"),
        ('{"method": "magic", "num_speculative_tokens": 3}', "unknown speculative method 'magic'"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": "3"}', "positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}', "positive"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
         '"prompt_lookup_max": 2}', "must not exceed"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 1}', "at least 2"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "acceptance": 1}', "'acceptance'"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}', "not supported"),
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "JSON object"),
    ],
)  # fmt: skip
def test_bad_configs_fail_clearly(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        SpeculativeConfig.parse(value)


def test_cli_flag_and_its_errors(capsys):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    engine_config, _ = build_configs(
        resolve(vars(parser.parse_args(["--speculative-config", flag])), {})
    )
    assert engine_config.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "eagle"}'])
    assert (
        "'eagle' is not supported by kvserve; supported: ngram, suffix" in capsys.readouterr().err
    )
    env = {"KVSERVE_SPECULATIVE_CONFIG": flag}
    assert build_configs(resolve({}, env))[0].speculative_config == SpeculativeConfig(
        "ngram", 3, 4, 4
    )


# ---------------------------------------------------------------- proposer
def test_ngram_index_matches_the_reference_scan():
    rng = random.Random(0)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        index = NgramIndex(low, high)
        for _ in range(40):  # the list grows as a sequence's does, one or a few tokens at a time
            assert index.propose(tokens, k) == propose_ngram(tokens, k, low, high), (trial, tokens)
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))


def test_longest_match_and_most_recent_occurrence():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurs at 0 (then 9); [2, 3] most recently at 4 (then 8): longest wins
    assert propose_ngram(tokens, 2, 1, 3) == [9, 2]
    assert NgramIndex(1, 3).propose(tokens, 2) == [9, 2]
    assert NgramIndex(1, 2).propose(tokens, 3) == [8, 7, 1]  # only 2-grams: the latest one
    assert NgramIndex(4, 5).propose(tokens, 3) == []  # no 4-gram repeats
    assert NgramIndex(1, 1).propose([5, 5], 4) == [5]  # continuation stops at the end


# ---------------------------------------------------------------- speculator + scheduler
def _group(prompt: list[int], max_tokens: int = 16, **params) -> RequestGroup:
    group = RequestGroup(
        "r", None, list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens
    )
    group.seqs.append(Sequence("r/0", group, 0, list(prompt), len(prompt)))
    return group


class _Grammar:
    """A matcher that accepts the first `valid` tokens of any draft."""

    def __init__(self, valid: int, stopped: bool = False) -> None:
        self.valid, self.stopped = valid, stopped
        self.checked: list[list[int]] = []
        self.consumed = 0

    def is_error(self) -> bool:
        return False

    def is_stopped(self) -> bool:
        return self.stopped

    def validate_tokens(self, tokens: list[int]) -> int:
        self.checked.append(list(tokens))
        return min(self.valid, len(tokens))

    def consume_token(self, token: int) -> bool:
        self.consumed += 1
        return True


class _Cost:
    """A fake cost model: each verified draft row costs `row` plain steps (or `row[batch_size]`),
    from `overloaded_from` running sequences on two steps; each draft forward `forward` steps."""

    def __init__(
        self, row: float | dict[int, float] = 0.25, forward: float = 0.0, overloaded_from: int = 12
    ) -> None:
        self.row, self.forward, self.overloaded_from = row, forward, overloaded_from

    def verify_cost(self, batch_size: int, num_drafts: int) -> float:
        if batch_size >= self.overloaded_from:
            return 2.0 * num_drafts
        row = self.row[batch_size] if isinstance(self.row, dict) else self.row
        return num_drafts * row

    def draft_cost(self, batch_size: int, num_forwards: int) -> float:
        return num_forwards * self.forward


def test_speculator_limits():
    config = SpeculativeConfig("ngram", 4, 1, 2, disable_by_batch_size=3)
    spec = Speculator(config, max_model_len=100, cost=_Cost(row=0.01))
    seq = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=3).seqs[0]
    assert spec.propose(seq, budget=10) == [3, 4]  # max_tokens 3: two drafts + the bonus token
    assert spec.propose(seq, budget=1) == [3]
    assert spec.enabled_for_batch(2) and not spec.enabled_for_batch(3)
    seq.group.max_output_tokens = 50
    assert spec.propose(seq, 10) == [3, 4, 5, 6]  # cheap rows, optimistic start: the full draft
    seq.matcher = _Grammar(valid=1)  # structured outputs: cut where the grammar rejects
    assert spec.propose(seq, 10) == [3]
    assert seq.matcher.checked == [[3, 4, 5, 6]] and seq.matcher.consumed == 0  # checked only
    seq.matcher = _Grammar(valid=0)
    assert spec.propose(seq, 10) == []
    seq.matcher = _Grammar(valid=3, stopped=True)  # a complete constraint: nothing to propose
    assert spec.propose(seq, 10) == []


def test_draft_length_pays_best_for_its_cost():
    cost = _Cost(row=0.25)
    # scattered misses (each draft 0.5): one draft pays best (1.5 / 1.25 beats 1.75 / 1.5)
    assert best_length([0.5] * 4, 4, 1, cost)[0] == 1
    # a miss at the first position, long runs after it (copying): the whole draft pays
    assert best_length([0.5, 0.95, 0.95, 0.95], 4, 1, cost)[0] == 4
    assert best_length([0.5, 0.95, 0.95, 0.95], 2, 1, cost)[0] == 2  # at most the limit
    assert best_length([0.2] * 4, 4, 1, cost) == (0, 1.0)  # nothing pays
    # the same acceptance from a draft model whose forward costs half a step: nothing pays
    assert best_length([0.5] * 4, 4, 1, _Cost(row=0.25, forward=0.5))[0] == 0
    # under load a draft row costs two steps: not even certain drafts pay
    assert best_length([1.0] * 4, 4, 16, cost)[0] == 0


def test_acceptance_is_estimated_per_position():
    acc = Acceptance(4)
    for _ in range(3):
        acc.record(4, 0, 1.0)  # missed at the first draft
        acc.record(4, 4, 1.0)  # accepted whole
    assert acc.reached == [6, 3, 3, 3] and acc.accepted == [3, 3, 3, 3]
    assert acc.rates([0.5] * 4, 0.0) == [0.5, 1.0, 1.0, 1.0]
    assert acc.rates([0.0] * 4, 6.0) == [0.25, 1 / 3, 1 / 3, 1 / 3]  # a prior of 6 verifications
    acc.record(2, 1, 0.5)  # older verifications count half
    assert acc.reached == [4, 2.5, 1.5, 1.5] and acc.accepted == [2.5, 1.5, 1.5, 1.5]


def test_back_off_pauses_probes_and_comes_back():
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 2), max_model_len=1000, cost=_Cost(0.1))
    seq = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=500).seqs[0]
    assert spec.propose(seq, 10) == [3, 4, 5, 6]  # prior 0.8 everywhere, cheap rows: all pay
    for _ in range(3):
        spec.record(seq, 3, 0)
    assert spec.propose(seq, 10) == []  # no length pays: a pause starts
    seq.token_ids += [3, 4, 5, 6, 1, 2]
    assert spec.propose(seq, 10) == []  # paused for FIRST_PAUSE tokens
    seq.token_ids += [3, 4, 5, 6, 1, 2]
    assert spec.propose(seq, 10) == [3]  # a one-draft probe after the pause
    spec.record(seq, 1, 0)
    assert spec.propose(seq, 10) == []  # the probe failed: a pause twice as long
    assert seq.num_tokens + 2 * FIRST_PAUSE == spec._state(seq).resume_at
    # a new sequence probes first (its prompt may copy well where others did not), then pauses
    # from the first pause, whatever the other sequences' pauses are
    other = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=500).seqs[0]
    drafts = spec.propose(other, 10)
    assert drafts[:1] == [3]
    spec.record(other, len(drafts), 0)
    assert spec.propose(other, 10) == []
    assert spec._state(other).resume_at == other.num_tokens + FIRST_PAUSE
    seq.token_ids += [3, 4, 5, 6, 1, 2] * 3
    assert spec.propose(seq, 10) == [3]  # the next probe
    for _ in range(8):
        spec.record(seq, 2, 2)
    assert spec.propose(seq, 10) == [3, 4, 5, 6]  # accepted again: the full draft is back
    assert spec._state(seq).pause == FIRST_PAUSE


def test_a_draft_models_forwards_count_against_its_drafts():
    config = SpeculativeConfig("ngram", 4, 1, 2)
    proposed = []
    for forward in (0.0, 0.6):  # n-gram lookups cost nothing; a draft model's forwards do
        spec = Speculator(config, 1000, cost=_Cost(row=0.1, forward=forward))
        seq = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=500).seqs[0]
        for _ in range(4):
            spec.record(seq, 1, 0)
            spec.record(seq, 1, 1)  # half the drafts accepted
        proposed.append([spec.propose(seq, 10), spec.propose(seq, 10)])
    assert proposed[0] == [[3, 4, 5, 6]] * 2  # later positions: the prior 0.8
    assert proposed[1] == [[3], []]  # a new sequence's one-draft probe, then a pause


def test_under_load_only_near_certain_drafts_are_proposed():
    cost = _Cost(row={1: 0.25, 2: 0.2, 8: 0.09}, overloaded_from=32)
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 2), max_model_len=1000, cost=cost)
    seq = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=200).seqs[0]
    assert spec.propose(seq, 10, batch_size=8) == [3]  # a new sequence probes first
    assert spec.propose(seq, 10, batch_size=8) == []  # 0.8 acceptance is not enough at 8
    seq.token_ids += [3, 4, 5, 6, 1, 2] * 2
    assert spec.propose(seq, 10, batch_size=8) == [3]  # a one-draft probe after the pause
    for _ in range(8):
        spec.record(seq, 1, 1)
        spec.record(seq, 4, 4)
    assert spec.propose(seq, 10, batch_size=8) == [3, 4, 5, 6]  # always accepted: full drafts
    assert spec.propose(seq, 10, batch_size=1) == [3, 4, 5, 6]
    # at 32 a verified row costs more than it saves, however likely: no drafts, no probes
    for _ in range(3):
        assert spec.propose(seq, 10, batch_size=32) == []
        seq.token_ids += [3, 4, 5, 6, 1, 2] * 2
    assert spec.propose(seq, 10, batch_size=2) == [3, 4, 5, 6]  # the estimates were kept


def test_a_measured_cost_too_high_to_pay_still_gets_probes():
    # a measurement spoilt by a busy machine says no draft pays, even certain ones: the sequence
    # pauses and probes, so that the next verifications measure the cost again
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 2), max_model_len=1000, cost=_Cost(5.0))
    seq = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=500).seqs[0]
    assert spec.propose(seq, 10) == [3]  # a new sequence probes first
    assert spec.propose(seq, 10) == []
    assert spec._state(seq).resume_at == seq.num_tokens + PROBE_PAUSE_CAP  # not 5 / 0.02 tokens
    seq.token_ids += [3, 4, 5, 6, 1, 2] * 11
    assert spec.propose(seq, 10) == [3]


@pytest.mark.parametrize(
    ("row", "forward", "pause"),
    [
        (0.1, 0.0, FIRST_PAUSE),  # a cheap n-gram probe: the first pause as it is
        (0.25, 0.0, 13),  # 0.25 of a step per failed probe: 13 tokens keep them near 2%
        (0.25, 0.5, 38),  # a drafter's forward too
        (0.25, 1.25, PROBE_PAUSE_CAP),
    ],
)
def test_a_failed_probe_pauses_long_enough_to_pay_for_itself(
    row: float, forward: float, pause: int
) -> None:
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 2), 1000, cost=_Cost(row, forward))
    seq = _group([1, 2, 3, 4, 5, 6, 1, 2], max_tokens=500).seqs[0]
    for _ in range(4):
        spec.record(seq, 1, 0)  # never accepted
    assert spec.propose(seq, 10) == [3]  # the new sequence's probe
    spec.record(seq, 1, 0)
    assert spec.propose(seq, 10) == []
    assert spec._state(seq).resume_at == seq.num_tokens + pause
    assert pause * PROBE_SHARE >= row + forward or pause in (FIRST_PAUSE, PROBE_PAUSE_CAP)


def test_the_cost_model_learns_from_step_durations():
    cost = MeasuredSpecCost(drafts=True)
    assert cost.verify_cost(1, 4) == 4 * DRAFT_ROW_COST / (STEP_OVERHEAD_ROWS + 1)  # the prior
    cost.observe(1, 4, 0.014)  # no plain step measured yet: nothing to compare with
    assert cost.row_cost == DRAFT_ROW_COST
    for _ in range(3):
        cost.observe(1, 0, 0.010)  # plain decode steps
    cost.observe(1, 0, 0.100)  # one slowed by another process: the median ignores it
    assert cost.plain_seconds(1) == pytest.approx(0.010)
    assert cost.plain_seconds(5) == pytest.approx(0.020)  # scaled by the row model
    cost.observe(1, 4, 0.014)  # 0.4 plain steps for 4 rows: 0.4 rows each at batch 1
    assert cost.verify_cost(1, 4) == pytest.approx(0.4)
    assert cost.verify_cost(5, 4) == pytest.approx(0.2)
    cost.observe(1, 2, 0.020, draft_seconds=0.008, num_forwards=2)  # forwards: 0.4 steps each
    assert cost.draft_cost(1, 3) == pytest.approx(1.2)
    cost.observe(1, 2, 0.013)
    cost.observe(1, 2, 0.013)  # 0.6 rows each: the median row of 0.4, 0.4, 0.6, 0.6
    assert cost.row_cost == pytest.approx(0.5)
    assert cost.verify_cost(1, 4) == pytest.approx(0.5)
    assert MeasuredSpecCost(drafts=False).draft_cost(1, 3) == 0.0  # n-gram: no draft model


def test_the_scheduler_reports_step_durations_to_the_cost_model():
    kv = KVCacheManager(16, 4)
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 3), 100)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), kv, spec)
    group = _group([1, 2, 3, 4, 5, 6, 7, 8])
    group.seqs[0].detokenizer = _NoStopStrings()  # type: ignore[assignment]
    sched.add_group(group)
    out = sched.schedule()
    sched.observe_step(out, 0.5)  # a prefill step: not a decode step's duration
    sched.update_from_output(out, RunnerOutput())
    assert spec.measured is not None and spec.measured.plain_seconds(1) is None
    group.seqs[0].append_token(9)
    out = sched.schedule()  # 9 never seen before: no drafts, a plain decode
    sched.observe_step(out, 0.01)
    assert spec.measured.plain_seconds(1) == 0.01


class _NoStopStrings:
    """A detokenizer stand-in for the stop rules: no stop string ever matches."""

    def add_tokens(self, token_ids: list[int]) -> None:
        return None


def test_scheduler_budgets_drafts_and_rolls_back_rejected_kv():
    kv = KVCacheManager(16, 4)
    config = SpeculativeConfig("ngram", 4, 1, 3)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32),
        kv,
        Speculator(config, 100, cost=_Cost(row=0.01)),
    )
    group = _group([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    seq = group.seqs[0]
    seq.detokenizer = _NoStopStrings()  # type: ignore[assignment]  # the stop rules read it
    sched.add_group(group)
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput())
    seq.append_token(4)  # the prefill's sampled token; now [.. 1 2 3 4]: drafts 5 6 7 1
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.draft_token_ids == [5, 6, 7, 1] and s.num_new_tokens == 5 and s.needs_sample
    assert (out.num_draft_tokens, out.num_decode_tokens, out.num_batched_tokens) == (4, 0, 5)
    assert len(kv.get_block_table(seq)) == 4  # 15 positions of 4-token blocks
    sched.update_from_output(out, RunnerOutput(sampled={"r/0": 9}, num_accepted={"r/0": 1}))
    assert seq.num_computed_tokens == 12  # the last token and one accepted draft
    assert len(kv.get_block_table(seq)) == 4  # 13 tokens held next: 4 blocks
    assert seq.token_ids[-2:] == [5, 9]  # the accepted draft, then the token after it
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == []  # [.., 5, 9]: 9 never seen before
    sched.update_from_output(out, RunnerOutput())
    assert kv.pool.is_cached_block(kv.get_block_table(seq)[2])  # full, accepted: cached
    kv.trim(seq, 9)
    assert len(kv.get_block_table(seq)) == 3 and kv.num_free_blocks == 13


def test_a_full_pool_drops_drafts_rather_than_preempting():
    kv = KVCacheManager(3, 4)
    sched = Scheduler(
        SchedulerConfig(),
        kv,
        Speculator(SpeculativeConfig("ngram", 4, 1, 3), 100, cost=_Cost(0.01)),
    )
    group = _group([1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    sched.add_group(group)
    sched.update_from_output(sched.schedule(), RunnerOutput())
    group.seqs[0].append_token(2)  # 11 tokens in 3 blocks; the drafts 3 1 2 would need a 4th
    out = sched.schedule()
    assert [s.draft_token_ids for s in out.scheduled] == [[]] and not out.preempted


# ---------------------------------------------------------------- verification statistics
def _rows(n: int, temperature: float, **params) -> list[SamplingRow]:
    p = SamplingParams(temperature=temperature, max_tokens=8, **params)
    return [SamplingRow(p, [0], 1, None, frozenset()) for _ in range(n)]


def test_rejection_sampling_keeps_the_target_distribution():
    """A point-mass draft x at temperature 1: the emitted token is distributed as p_target (x
    accepted with probability p(x)); on rejection as p with x removed and renormalised."""
    torch.manual_seed(0)
    vocab, trials, draft = 6, 40000, 2
    logits = torch.tensor([[1.0, 0.2, 0.7, -0.5, 0.0, 1.3]])
    target = torch.softmax(logits[0], -1)
    base = _rows(1, 1.0)[0]
    rows = verification_rows(base, [draft])  # the position's row and the bonus row
    sampler = Sampler(torch.Generator().manual_seed(1))
    result = sampler(logits.repeat(2 * trials, 1), rows * trials)
    first = []
    rejected = []
    for t in range(trials):
        pair = result.token_ids[2 * t : 2 * t + 2]
        a = num_accepted(pair, [draft])
        first.append(pair[0] if a == 0 else draft)
        if a == 0:
            rejected.append(pair[0])
    counts = torch.bincount(torch.tensor(first), minlength=vocab).double()
    chi2 = ((counts - trials * target) ** 2 / (trials * target)).sum().item()
    assert chi2 < 30.0, (chi2, counts / trials, target)  # 5 degrees of freedom: p < 1e-5
    assert abs(1 - len(rejected) / trials - target[draft].item()) < 0.01
    rest = target.clone()
    rest[draft] = 0
    rest /= rest.sum()
    counts = torch.bincount(torch.tensor(rejected), minlength=vocab).double()
    assert counts[draft] == 0
    keep = rest > 0
    expected = len(rejected) * rest[keep]
    assert ((counts[keep] - expected) ** 2 / expected).sum().item() < 30.0


def test_greedy_verification_is_the_argmax_prefix():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    rows = verification_rows(_rows(1, 0.0)[0], [1, 2])
    tokens = Sampler()(logits, rows).token_ids
    assert tokens == [1, 0, 2] and num_accepted(tokens, [1, 2]) == 1  # bonus: argmax of row 1


def test_rows_see_the_drafts_before_them_for_penalties():
    base = _rows(1, 0.0, repetition_penalty=2.0)[0]
    rows = verification_rows(base, [4, 5])
    assert [r.token_ids for r in rows] == [[0], [0, 4], [0, 4, 5]]
    plain = _rows(1, 0.0)[0]
    assert all(r is plain for r in verification_rows(plain, [4, 5]))


def test_stats_log_line_reports_acceptance(caplog):
    from types import SimpleNamespace

    from engine.async_engine import AsyncLLMEngine
    from engine.core.stats import StepStats

    window = [
        StepStats("decode", num_running=1, spec_num_drafts=2, spec_num_draft_tokens=8,
                  spec_num_accepted_tokens=6),
        StepStats("decode", num_running=1),
    ]  # fmt: skip
    with caplog.at_level("INFO", logger="engine.async_engine"):
        AsyncLLMEngine._log_stats(SimpleNamespace(_log_window=window), 1.0)  # type: ignore[arg-type]
    line = caplog.messages[-1]
    assert "drafts=2 draft_tokens=8 accepted_tokens=6" in line
    assert "acceptance_rate=75.0%" in line and "mean_acceptance_length=4.00" in line
