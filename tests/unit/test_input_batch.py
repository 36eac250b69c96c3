"""The runner's persistent input batch: the same tensors from_lists would build, kept incrementally."""

from __future__ import annotations

import gc

import torch

from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSeq
from engine.executor.input_batch import InputBatch
from engine.kernels.attention import AttentionMetadata

BS = 4


def _seq(name: str, tokens: list[int]) -> Sequence:
    params = SamplingParams(temperature=0.0)
    group = RequestGroup(name, None, list(tokens), params, max_output_tokens=16)
    seq = Sequence(f"{name}-0", group, 0, list(tokens), len(tokens))
    group.seqs.append(seq)
    return seq


def _scheduled(seq: Sequence, table: list[int], start: int, n: int) -> ScheduledSeq:
    return ScheduledSeq(seq, n, start, [table], True, 0)


def _check(batch: InputBatch, scheduled: list[ScheduledSeq]) -> None:
    ids, pos, meta = batch.prepare(scheduled)
    ref = AttentionMetadata.from_lists(
        [s.num_new_tokens for s in scheduled],
        [s.start_pos + s.num_new_tokens for s in scheduled],
        [list(s.block_tables[0]) for s in scheduled],
        BS,
    )
    expected_ids = [
        t for s in scheduled for t in s.seq.token_ids[s.start_pos :][: s.num_new_tokens]
    ]
    assert ids.tolist() == expected_ids
    assert pos.tolist() == [
        p for s in scheduled for p in range(s.start_pos, s.start_pos + s.num_new_tokens)
    ]
    assert meta.slot_mapping.tolist() == ref.slot_mapping.tolist()
    assert meta.seq_lens.tolist() == ref.seq_lens.tolist()
    assert meta.query_start_loc.tolist() == ref.query_start_loc.tolist()
    assert meta.num_decode_seqs == ref.num_decode_seqs
    for i, s in enumerate(scheduled):  # entries past a sequence's blocks are never read
        n = len(s.block_tables[0])
        assert meta.block_tables[i, :n].tolist() == s.block_tables[0]


def test_steps_with_growing_tables_match_from_lists():
    batch = InputBatch(BS, torch.device("cpu"), rows=2, width=2)  # forces both to grow
    a, b = _seq("a", list(range(10, 19))), _seq("b", list(range(50, 53)))
    ta, tb = [7, 3, 9], [4]
    _check(batch, [_scheduled(b, tb, 0, 3), _scheduled(a, ta, 0, 9)])  # two prefills
    for step in range(9):  # decodes; tables gain a block every BS tokens
        for seq, table in ((a, ta), (b, tb)):
            seq.token_ids.append(100 + step)
            if seq.num_tokens > len(table) * BS:
                table.append(20 + len(table) + (0 if seq is a else 10))
        c = _seq(f"c{step}", [1, 2, 3, 4, 5])  # a new sequence each step takes and frees a row
        _check(
            batch,
            [
                _scheduled(a, ta, a.num_tokens - 1, 1),
                _scheduled(b, tb, b.num_tokens - 1, 1),
                _scheduled(c, [30 + step, 40 + step], 0, 5),
            ],
        )
        c.status = SequenceStatus.FINISHED_LENGTH
    assert batch.block_tables.shape[1] >= 5


def test_a_replaced_block_table_is_rewritten():
    """After preemption the KV manager gives the sequence a new list: every entry is rewritten."""
    batch = InputBatch(BS, torch.device("cpu"))
    a = _seq("a", list(range(8)))
    _check(batch, [_scheduled(a, [5, 6], 0, 8)])
    _check(batch, [_scheduled(a, [11, 12], 0, 8)])  # recomputed into other blocks


def test_rows_of_finished_or_collected_sequences_are_reused():
    batch = InputBatch(BS, torch.device("cpu"), rows=2)
    for i in range(6):
        seq = _seq(f"s{i}", [1, 2])
        batch.prepare([_scheduled(seq, [i + 1], 0, 2)])
        if i % 2:
            seq.status = SequenceStatus.FINISHED_STOPPED
        del seq
        gc.collect()
    assert batch.block_tables.shape[0] == 2  # never grew


def test_sampling_row_reads_the_live_token_list():
    batch = InputBatch(BS, torch.device("cpu"))
    a = _seq("a", [1, 2, 3])
    row = batch.sampling_row(a, frozenset({0}))
    a.token_ids.append(9)
    assert batch.sampling_row(a, frozenset({0})) is not None
    assert row.prompt_token_ids == [1, 2, 3] and row.output_token_ids == [9]
    assert row.num_output_tokens == 1


def test_each_kv_cache_group_gets_its_own_tables_and_slots():
    """Layers 0 and 2 in group 0, layer 1 in group 1: for_layer(i) is its group's metadata."""
    batch = InputBatch(BS, torch.device("cpu"), rows=2, width=2, layer_groups=[0, 1, 0])
    a, b = _seq("a", list(range(10, 19))), _seq("b", list(range(50, 53)))
    tables = {a: ([7, 3, 9], [0, 4, 8]), b: ([1], [2])}  # a's group 1 released its first block

    def step(scheduled: list[tuple[Sequence, int, int]]) -> None:
        sched = [ScheduledSeq(s, n, start, list(tables[s]), True, 0) for s, start, n in scheduled]
        _, _, meta = batch.prepare(sched)
        assert meta.for_layer(0) is meta and meta.for_layer(2) is meta
        for g in (0, 1):
            group_meta = meta.for_layer(g)
            ref = AttentionMetadata.from_lists(
                [n for _, _, n in scheduled],
                [start + n for _, start, n in scheduled],
                [tables[s][g] for s, _, _ in scheduled],
                BS,
            )
            assert group_meta.slot_mapping.tolist() == ref.slot_mapping.tolist()
            assert group_meta.seq_lens.tolist() == ref.seq_lens.tolist()
            for i, (s, _, _) in enumerate(scheduled):
                n = len(tables[s][g])
                assert group_meta.block_tables[i, :n].tolist() == tables[s][g]

    step([(b, 0, 3), (a, 0, 9)])
    a.token_ids.append(5)
    b.token_ids.extend([6, 7])
    tables[b][0].append(11)
    tables[b][1].append(12)
    step([(a, 9, 1), (b, 3, 2)])
