"""The runner's persistent input batch: each running sequence keeps a row of block-table and sampling
state across steps, updated incrementally (new blocks only), so a step never re-copies every
sequence's token list or block table. With several KV cache groups each group has its own tables
and slot mapping, handed to the layers through `AttentionMetadata.for_layer`."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from engine.core.request import Sequence
from engine.core.scheduler import ScheduledSeq
from engine.executor.sampler import SamplingRow
from engine.kernels.metadata import AttentionMetadata, slots_of


class _Row:
    """One sequence's persistent state: its row in the block-table tensors and its sampling row."""

    __slots__ = ("index", "tables", "num_written", "sampling")

    def __init__(self, index: int, num_groups: int) -> None:
        self.index = index
        # Per group: the KV manager's live list these entries mirror, and how many are copied.
        # Entries a sliding window released later keep their old id here: attention never reads them.
        self.tables: list[list[int] | None] = [None] * num_groups
        self.num_written = [0] * num_groups
        self.sampling: SamplingRow | None = None


class InputBatch:
    def __init__(
        self,
        block_size: int,
        device: torch.device,
        rows: int = 64,
        width: int = 64,
        layer_groups: list[int] | None = None,
    ):
        self.block_size = block_size
        self.device = device
        # Per model layer, its KV cache group (None: one group for every layer).
        self.layer_groups = tuple(layer_groups) if layer_groups else ()
        self.num_groups = max(self.layer_groups, default=0) + 1
        # Per group, [rows, width] int32 on the host: row r holds that group's block table of the
        # sequence owning r.
        self.group_tables = [
            torch.zeros((rows, width), dtype=torch.int32) for _ in range(self.num_groups)
        ]
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
            row = self._rows[seq] = _Row(self._free.pop(), self.num_groups)
        return row

    @property
    def block_tables(self) -> torch.Tensor:
        """The first group's tables (the only ones of a one-group model)."""
        return self.group_tables[0]

    def _reclaim(self) -> None:
        """Free the rows of finished sequences and of those already garbage-collected."""
        for seq in [s for s in self._rows if s.status.finished]:
            del self._rows[seq]
        used = {row.index for row in self._rows.values()}
        self._free = [i for i in range(self.block_tables.shape[0] - 1, -1, -1) if i not in used]

    def _grow_rows(self) -> None:
        rows, width = self.block_tables.shape
        for g, tables in enumerate(self.group_tables):
            grown = torch.zeros((2 * rows, width), dtype=torch.int32)
            grown[:rows] = tables
            self.group_tables[g] = grown
        self._free.extend(range(2 * rows - 1, rows - 1, -1))

    def _sync_table(self, row: _Row, group: int, table: list[int]) -> None:
        """Copy the entries of `table` this row does not hold yet (all, if the list was replaced)."""
        if row.tables[group] is not table:  # new sequence, or its blocks were freed and reallocated
            row.tables[group], row.num_written[group] = table, 0
        start = row.num_written[group]
        if len(table) == start:
            return
        tables = self.group_tables[group]
        if len(table) > tables.shape[1]:
            width = max(len(table), 2 * tables.shape[1])
            grown = torch.zeros((tables.shape[0], width), dtype=torch.int32)
            grown[:, : tables.shape[1]] = tables
            self.group_tables[group] = tables = grown
        tables[row.index, start : len(table)] = torch.tensor(table[start:], dtype=torch.int32)
        row.num_written[group] = len(table)

    # -- one step --------------------------------------------------------------------------------
    def prepare(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input ids [num_tokens], positions [num_tokens] and the step's attention metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        groups = range(self.num_groups)
        group_slots: list[list[int]] = [[] for _ in groups]
        query_lens: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        bs = self.block_size
        one_group = self.num_groups == 1
        slots0 = group_slots[0]
        for s in scheduled:
            row = self._row(s.seq)
            table = s.block_tables[0]
            self._sync_table(row, 0, table)
            if not one_group:
                for g in groups[1:]:
                    self._sync_table(row, g, s.block_tables[g])
            rows.append(row.index)
            start, n = s.start_pos, s.num_new_tokens
            end = start + n
            query_lens.append(n)
            seq_lens.append(end)
            if n == 1:  # a decode: one token, one slot
                input_ids.append(s.seq.token_ids[start])
                positions.append(start)
                slots0.append(table[start // bs] * bs + start % bs)
                if not one_group:
                    for g in groups[1:]:
                        group_slots[g].append(s.block_tables[g][start // bs] * bs + start % bs)
            else:  # a prefill chunk, or the last token and the drafts to verify
                input_ids.extend(s.seq.token_ids[start:end])
                input_ids.extend(s.draft_token_ids)
                positions.extend(range(start, end))
                slots0.extend(slots_of(table, start, end, bs))
                if not one_group:
                    for g in groups[1:]:
                        group_slots[g].extend(slots_of(s.block_tables[g], start, end, bs))
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        width = -(-max(seq_lens) // bs)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        # One host tensor holds every per-step list (each torch.tensor() is several dispatched
        # ops, and a cache-cold op costs tens of microseconds after a forward); the fields are
        # views of it: [ids | positions | slots of each group | rows | query starts, seq lens].
        num_tokens, num_seqs = len(input_ids), len(seq_lens)
        slots = slots0 if one_group else sum(group_slots, [])
        packed = torch.tensor(input_ids + positions + slots + rows + starts + seq_lens)
        at = (2 + self.num_groups) * num_tokens
        # [num_seqs, width] per group: one sequence on the host reads its row in place (a view, no
        # gather: the step ends before the next prepare writes the tables again)
        dev = self.device
        if num_seqs == 1 and dev.type == "cpu":
            r = rows[0]
            tables = [group[r : r + 1, :width] for group in self.group_tables]
        else:
            picked = packed[at : at + num_seqs]
            tables = [group[picked, :width] for group in self.group_tables]
        ints = packed[at + num_seqs :].to(torch.int32)  # [num_seqs + 1 | num_seqs]
        if dev.type != "cpu":
            packed = packed.to(dev, non_blocking=True)
            ints = ints.to(dev, non_blocking=True)
            tables = [t.to(dev, non_blocking=True) for t in tables]
        meta = AttentionMetadata(
            num_decode_seqs=num_decodes,
            query_start_loc=ints[: num_seqs + 1],
            seq_lens=ints[num_seqs + 1 :],
            block_tables=tables[0],
            slot_mapping=packed[2 * num_tokens : 3 * num_tokens],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        if self.num_groups > 1:
            per_group = [meta] + [
                dataclasses.replace(
                    meta,
                    block_tables=tables[g],
                    slot_mapping=packed[(2 + g) * num_tokens : (3 + g) * num_tokens],
                )
                for g in range(1, self.num_groups)
            ]
            meta.layer_metas = tuple(per_group[g] for g in self.layer_groups)
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
