"""CUDA-graph decisions that need no GPU: which batch sizes are captured, which bucket a step pads
to, and which steps fall back to eager execution."""

from __future__ import annotations

import pytest
import torch

from engine.executor.cuda_graphs import CudaGraphRunner, batch_buckets, bucket_for
from engine.kernels.attention import AttentionMetadata, allocate_kv_cache


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    big = batch_buckets(256)
    assert big[-1] == 256 and len(big) == 20
    for max_batch in (1, 3, 8, 31, 100, 256):
        buckets = batch_buckets(max_batch)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
        for batch in range(1, max_batch + 1):
            padded = bucket_for(batch, buckets)
            assert padded is not None and batch <= padded and padded - batch < 16
    assert bucket_for(257, big) is None


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _Recorder(torch.nn.Module):
    """A stand-in model: records the metadata of each forward, returns [n, 4] hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.metas: list[AttentionMetadata] = []

    def forward(self, ids, pos, kv_caches, meta):
        self.metas.append(meta)
        return torch.zeros(ids.shape[0], 4)


class _Runner(CudaGraphRunner):
    fail_at: int | None = None

    def _capture(self, padded):
        if padded == self.fail_at:
            raise RuntimeError("capture failed")
        return _FakeGraph(), self._forward(padded)


def _runner(max_batch=8, max_blocks=4, fail_at=None):
    kv = allocate_kv_cache(1, 10, 4, 1, 8, torch.float32, "cpu")
    runner = _Runner(_Recorder(), kv, 4, max_blocks, max_batch, scratch_block=9)
    runner.fail_at = fail_at
    runner.capture_all()
    return runner


def _meta(query_lens, seq_lens, block_size=4):
    tables = [list(range(-(-s // block_size))) for s in seq_lens]
    return AttentionMetadata.from_lists(query_lens, seq_lens, tables, block_size)


def test_capture_at_start_up_over_the_in_place_decode_kernel():
    runner = _runner(max_batch=8)
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    captured = runner.model.metas
    assert [m.num_seqs for m in captured] == [8, 4, 2, 1]  # largest first
    # One graph per batch size: the host-side lengths are the maximum, so the launch never
    # depends on the step's context length; the real lengths are device buffers.
    assert all(m.backend == "triton" and m.max_seq_len == 16 for m in captured)
    assert all(m.seq_lens.data_ptr() == runner.seq_lens.data_ptr() for m in captured)


def test_which_steps_replay_and_which_run_eagerly():
    runner = _runner(max_batch=8, max_blocks=4)
    assert runner.can_run(_meta([1], [5]))
    assert runner.can_run(_meta([1] * 3, [1, 9, 16]))  # pads to 4
    assert runner.can_run(_meta([1] * 8, [3] * 8))
    assert not runner.can_run(_meta([1] * 9, [3] * 9))  # more than max_num_seqs
    assert not runner.can_run(_meta([1, 4], [6, 4]))  # a prefill chunk: mixed step
    assert not runner.can_run(_meta([3], [3]))  # prefill only
    assert not runner.can_run(_meta([1], [17]))  # wider than the static block tables


def test_replay_pads_with_scratch_rows():
    runner = _runner(max_batch=8)
    meta = _meta([1] * 3, [5, 9, 2])
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor([4, 8, 1])
    hidden = runner.run(ids, pos, meta)
    assert hidden.shape == (3, 4)
    graph, _ = runner.graphs[4]
    assert graph.replays == 1
    assert runner.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert runner.seq_lens[:4].tolist() == [5, 9, 2, 1]
    assert runner.slot_mapping[3].item() == 9 * 4  # padding writes the scratch block only
    assert runner.block_tables[3, 0].item() == 9


def test_capture_failure_leaves_decode_eager():
    runner = _runner(max_batch=8, fail_at=2)
    assert runner.graphs == {}
    assert not runner.can_run(_meta([1], [5]))


@pytest.mark.parametrize("max_batch", [1, 5])
def test_small_max_num_seqs(max_batch):
    runner = _runner(max_batch=max_batch)
    assert max(runner.graphs) == max_batch
    assert runner.can_run(_meta([1] * max_batch, [2] * max_batch))
