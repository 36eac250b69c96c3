"""The runner's persistent input batch: each running sequence keeps a row of block-table and sampling
state across steps, updated incrementally (new blocks only), so a step never re-copies every
sequence's token list or block table."""

from __future__ import annotations

import weakref

import torch

from engine.core.request import Sequence
from engine.core.scheduler import ScheduledSeq
from engine.executor.sampler import SamplingRow
from engine.kernels.attention import AttentionMetadata, slots_of


class _Row:
    """One sequence's persistent state: its row in the block-table tensor and its sampling row."""

    __slots__ = ("index", "table", "num_written", "sampling")

    def __init__(self, index: int) -> None:
        self.index = index
        self.table: list[int] | None = None  # the KV manager's live list these entries mirror
        self.num_written = 0  # entries of `table` already copied into the tensor
        self.sampling: SamplingRow | None = None


class InputBatch:
    def __init__(self, block_size: int, device: torch.device, rows: int = 64, width: int = 64):
        self.block_size = block_size
        self.device = device
        # [rows, width] int32 on the host: row r holds the block table of the sequence owning r.
        self.block_tables = torch.zeros((rows, width), dtype=torch.int32)
        self._rows: weakref.WeakKeyDictionary[Sequence, _Row] = weakref.WeakKeyDictionary()
        self._free = list(range(rows - 1, -1, -1))

    # -- rows ------------------------------------------------------------------------------------
    def _row(self, seq: Sequence) -> _Row:
        row = self._rows.get(seq)
        if row is None:
            if not self._free:
                self._reclaim()
            if not self._free:
                self._grow_rows()
            row = self._rows[seq] = _Row(self._free.pop())
        return row

    def _reclaim(self) -> None:
        """Free the rows of finished sequences and of those already garbage-collected."""
        for seq in [s for s in self._rows if s.status.finished]:
            del self._rows[seq]
        used = {row.index for row in self._rows.values()}
        self._free = [i for i in range(self.block_tables.shape[0] - 1, -1, -1) if i not in used]

    def _grow_rows(self) -> None:
        rows, width = self.block_tables.shape
        grown = torch.zeros((2 * rows, width), dtype=torch.int32)
        grown[:rows] = self.block_tables
        self.block_tables = grown
        self._free.extend(range(2 * rows - 1, rows - 1, -1))

    def _sync_table(self, row: _Row, table: list[int]) -> None:
        """Copy the entries of `table` this row does not hold yet (all, if the list was replaced)."""
        if row.table is not table:  # new sequence, or its blocks were freed and reallocated
            row.table, row.num_written = table, 0
        if len(table) == row.num_written:
            return
        if len(table) > self.block_tables.shape[1]:
            width = max(len(table), 2 * self.block_tables.shape[1])
            grown = torch.zeros((self.block_tables.shape[0], width), dtype=torch.int32)
            grown[:, : self.block_tables.shape[1]] = self.block_tables
            self.block_tables = grown
        start = row.num_written
        new = torch.tensor(table[start:], dtype=torch.int32)
        self.block_tables[row.index, start : len(table)] = new
        row.num_written = len(table)

    # -- one step --------------------------------------------------------------------------------
    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input ids [num_tokens], positions [num_tokens] and the step's attention metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        bs = self.block_size
        for s in scheduled:
            row = self._row(s.seq)
            self._sync_table(row, s.block_table)
            rows.append(row.index)
            start, n = s.start_pos, s.num_new_tokens
            end = start + n
            query_lens.append(n)
            seq_lens.append(end)
            if n == 1:  # a decode: one token, one slot
                input_ids.append(s.seq.token_ids[start])
                positions.append(start)
                slots.append(s.block_table[start // bs] * bs + start % bs)
            else:  # a prefill chunk, or the last token and the drafts to verify
                input_ids.extend(s.seq.token_ids[start:end])
                input_ids.extend(s.draft_token_ids)
                positions.extend(range(start, end))
                slots.extend(slots_of(s.block_table, start, end, bs))
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        width = -(-max(seq_lens) // bs)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        # One host tensor holds every per-step list (each torch.tensor() is several dispatched
        # ops, and a cache-cold op costs tens of microseconds after a forward); the fields are
        # views of it: [ids | positions | slots | rows | query starts, seq lens].
        num_tokens, num_seqs = len(input_ids), len(seq_lens)
        packed = torch.tensor(input_ids + positions + slots + rows + starts + seq_lens)
        at = 3 * num_tokens
        tables = self.block_tables[packed[at : at + num_seqs], :width]  # [num_seqs, width]
        ints = packed[at + num_seqs :].to(torch.int32)  # [num_seqs + 1 | num_seqs]
        dev = self.device
        if dev.type != "cpu":
            packed = packed.to(dev, non_blocking=True)
            ints = ints.to(dev, non_blocking=True)
            tables = tables.to(dev, non_blocking=True)
        meta = AttentionMetadata(
            num_decode_seqs=num_decodes,
            query_start_loc=ints[: num_seqs + 1],
            seq_lens=ints[num_seqs + 1 :],
            block_tables=tables,
            slot_mapping=packed[2 * num_tokens : at],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        return packed[:num_tokens], packed[num_tokens : 2 * num_tokens], meta

    def sampling_row(self, seq: Sequence, eos_token_ids: frozenset[int]) -> SamplingRow:
        """The sequence's sampling row, built once: it reads the live token list, never a copy."""
        row = self._row(seq)
        if row.sampling is None or row.sampling.eos_token_ids is not eos_token_ids:
            row.sampling = SamplingRow(
                params=seq.params,
                token_ids=seq.token_ids,
                num_prompt_tokens=seq.num_prompt_tokens,
                generator=seq.generator,
                eos_token_ids=eos_token_ids,
            )
        row.sampling.constrained = seq.matcher is not None  # structured outputs
        return row.sampling
