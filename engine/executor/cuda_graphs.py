"""CUDA graphs for pure decode steps, captured at start-up: one graph per padded batch size (buckets
up to --max-num-seqs) over the Triton decode kernel, which reads lengths and block tables from static
device buffers, so one graph serves every context length. Other steps run eagerly."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from engine.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # above 8 sequences, a graph every 16: at most 15 padding rows per step


def batch_buckets(max_batch: int) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then every 16, and max_batch itself."""
    buckets = [b for b in SMALL_BUCKETS if b < max_batch]
    buckets += range(BUCKET_STEP, max_batch, BUCKET_STEP)
    return [*buckets, max_batch]


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest captured batch size that holds `batch` rows, or None (run eagerly)."""
    return next((b for b in buckets if b >= batch), None)


class CudaGraphRunner:
    """Replays the model forward of a decode step from a graph captured at start-up.

    Padding rows decode a dummy token at a scratch slot (`scratch_block`, a KV block the cache
    manager never hands out) with a context of one token, so they cannot touch real sequences.
    The decode attention is the in-place Triton kernel (`decode_backend`): its launch depends only
    on the batch size, and the real lengths and block tables live in device buffers read at replay.
    """

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks_per_seq: int,
        max_batch: int,
        scratch_block: int,
        decode_backend: str = "triton",
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.batch_buckets = batch_buckets(max_batch)
        self.decode_backend = decode_backend
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
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # padded batch -> (graph, hidden)
        self.pool: Any = None  # one memory pool shared by every graph

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A pure decode step whose batch has a captured graph and whose tables fit the buffers."""
        if meta.num_decode_seqs != meta.num_seqs:
            return False
        padded = bucket_for(meta.num_seqs, self.batch_buckets)
        return (
            padded is not None
            and padded in self.graphs
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
            and -(-meta.max_seq_len // self.block_size) <= self.max_blocks_per_seq
        )

    def capture_all(self) -> float:
        """Capture every bucket, largest first (smaller graphs reuse its pool memory); returns the
        seconds spent. On a capture error, logs it and leaves decode eager (no graphs)."""
        start = time.perf_counter()
        try:
            for padded in sorted(self.batch_buckets, reverse=True):
                self.graphs[padded] = self._capture(padded)
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            self.graphs.clear()
        seconds = time.perf_counter() - start
        if self.graphs:
            logger.info(
                "captured %d CUDA graphs (decode batch %s) in %.2f s",
                len(self.graphs),
                ", ".join(map(str, self.batch_buckets)),
                seconds,
            )
        return seconds

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a pure decode step (check `can_run` first)."""
        batch = meta.num_seqs
        padded = bucket_for(batch, self.batch_buckets)
        assert padded is not None and padded in self.graphs
        self._fill(input_ids, positions, meta, padded)
        graph, hidden = self.graphs[padded]
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
        # Columns past a row's context may hold an older sequence's blocks: never read.
        self.block_tables[:batch, :cols].copy_(meta.block_tables)
        if padded > batch:  # padding rows: one-token context at the scratch slot
            self.input_ids[batch:padded].zero_()
            self.positions[batch:padded].zero_()
            self.slot_mapping[batch:padded].fill_(self.scratch_slot)
            self.seq_lens[batch:padded].fill_(1)
            self.block_tables[batch:padded, 0].fill_(self.scratch_block)

    def _meta(self, padded: int) -> AttentionMetadata:
        max_len = self.max_blocks_per_seq * self.block_size
        return AttentionMetadata(
            num_decode_seqs=padded,
            query_start_loc=self.query_start_loc[: padded + 1],
            seq_lens=self.seq_lens[:padded],
            block_tables=self.block_tables[:padded],
            slot_mapping=self.slot_mapping[:padded],
            query_lens_cpu=[1] * padded,
            # Host lengths at their maximum: the only host-side input of the Triton decode (its
            # split count) then depends on the batch size alone; the SDPA reference, used by CPU
            # tests, gathers the whole width and masks by the device lengths.
            seq_lens_cpu=[max_len] * padded,
            max_query_len=1,
            max_seq_len=max_len,
            block_size=self.block_size,
            backend=self.decode_backend,
        )

    def _forward(self, padded: int) -> torch.Tensor:
        ids, pos = self.input_ids[:padded], self.positions[:padded]
        return self.model(ids, pos, self.kv_caches, self._meta(padded))

    def _capture(self, padded: int) -> tuple[Any, torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, kernel compiles)
            self._forward(padded)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(padded)
        return graph, hidden
