"""CUDA graphs for pure decode steps: one graph per (padded batch size, context width) bucket, captured
on first use over static input buffers and replayed; prefill and mixed steps stay eager."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.executor.attention import AttentionMetadata

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _bucket(value: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= value), None)


class CudaGraphRunner:
    """Replays the model forward of a decode step from a captured graph.

    Padding rows decode a dummy token at a scratch slot (`scratch_block`, a KV block the cache
    manager never hands out) with a context of one token, so they cannot touch real sequences.
    The decode attention always goes through the SDPA path, whose only host-side inputs (context
    width) are fixed per bucket; the real lengths live in device buffers read at replay.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int,
        scratch_block: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        widths, width = [], 16
        while width < max_blocks_per_seq:
            widths.append(width)
            width *= 4
        self.width_buckets = [*widths, max_blocks_per_seq]  # context width in blocks
        device = kv_caches[0].device
        n, w = max(self.batch_buckets), max_blocks_per_seq
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, w), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # one memory pool shared by every graph

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            meta.num_decode_seqs == meta.num_seqs
            and meta.num_seqs <= self.batch_buckets[-1]
            and -(-meta.max_seq_len // self.block_size) <= self.width_buckets[-1]
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a pure decode step (check `can_run` first)."""
        batch = meta.num_seqs
        padded = _bucket(batch, self.batch_buckets)
        width = _bucket(-(-meta.max_seq_len // self.block_size), self.width_buckets)
        assert padded is not None and width is not None
        self._fill(input_ids, positions, meta, padded)
        key = (padded, width)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded, width)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:batch]

    def _fill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        padded: int,
    ) -> None:
        batch, cols = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.block_tables[:batch, :cols].copy_(meta.block_tables)
        if padded > batch:  # padding rows: one-token context at the scratch slot
            self.input_ids[batch:padded].zero_()
            self.positions[batch:padded].zero_()
            self.slot_mapping[batch:padded].fill_(self.scratch_slot)
            self.seq_lens[batch:padded].fill_(1)
            self.block_tables[batch:padded, 0].fill_(self.scratch_block)

    def _meta(self, padded: int, width: int) -> AttentionMetadata:
        ctx = width * self.block_size
        return AttentionMetadata(
            num_decode_seqs=padded,
            query_start_loc=self.query_start_loc[: padded + 1],
            seq_lens=self.seq_lens[:padded],
            block_tables=self.block_tables[:padded],
            slot_mapping=self.slot_mapping[:padded],
            query_lens_cpu=[1] * padded,
            seq_lens_cpu=[ctx] * padded,  # fixes the gathered context width of this bucket
            max_query_len=1,
            max_seq_len=ctx,
            block_size=self.block_size,
            backend="sdpa",
        )

    def _capture(self, padded: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos = self.input_ids[:padded], self.positions[:padded]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, lazy init)
            self.model(ids, pos, self.kv_caches, self._meta(padded, width))
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(ids, pos, self.kv_caches, self._meta(padded, width))
        logger.info("captured a CUDA graph for decode batch %d, context %d blocks", padded, width)
        return graph, hidden
