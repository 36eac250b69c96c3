"""The metadata of one step's attention: where each sequence's new tokens sit in the batch, its
context length, its block table and the KV-cache slot of every new token, plus the per-step masks
and tables every layer shares. The backends (engine.kernels.sdpa_attention, flash_attention,
triton_attention, the C++ kernels) and their dispatcher (engine.kernels.attention) read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    # The step's new tokens are laid out sequence by sequence: the first `num_decode_seqs` sequences
    # have exactly one new token each (decodes), the rest are prefill chunks of any length >= 1.
    num_decode_seqs: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (computed + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset per new token
    query_lens_cpu: list[int]  # host copies, to avoid device syncs
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    backend: str | None = (
        None  # force a backend (attention.BACKENDS) this step; None -> attention_backend()
    )
    # Per-step values every layer shares, built on first use (see decode_context).
    _shared: dict[object, Any] = field(default_factory=dict, init=False, repr=False)
    # Per model layer, the metadata of its KV cache group (its block tables and slot mapping); empty
    # when every layer shares this one. Set by the runner's input batch.
    layer_metas: tuple[AttentionMetadata, ...] = field(default=(), init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_layer(self, layer_index: int) -> AttentionMetadata:
        """The metadata layer `layer_index` attends with (its KV-cache group's block tables and
        slot mapping); with one group, this metadata itself. Models always go through it."""
        return self.layer_metas[layer_index] if self.layer_metas else self

    def decode_context(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table [B, num_blocks], key mask [B, 1, 1, ctx_len]) of the decode sequences,
        computed once per step (and window) and reused by every layer."""
        cached = self._shared.get(("decode", window))
        if cached is None:
            batch = self.num_decode_seqs
            num_blocks = -(-max(self.seq_lens_cpu[:batch]) // self.block_size)
            table = self.block_tables[:batch, :num_blocks]
            positions = torch.arange(num_blocks * self.block_size, device=table.device)
            lens = self.seq_lens[:batch, None]
            mask = positions[None, :] < lens  # [B, ctx_len]
            if window is not None:  # the one query sits at lens - 1: keys > lens - 1 - window
                mask &= positions[None, :] >= lens - window
            cached = self._shared[("decode", window)] = (table, mask[:, None, None, :])
        return cached

    def prefill_context(
        self, seq_index: int, query_len: int, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(block table [num_blocks], causal mask [query_len, num_keys], first key position) of a
        prefill chunk that follows cached context; computed once per step (and window). With a
        window the table starts at the block holding the first query's first visible key."""
        key = (seq_index, window)
        cached = self._shared.get(key)
        if cached is None:
            seq_len = self.seq_lens_cpu[seq_index]
            first_query = seq_len - query_len
            first_block = (
                0 if window is None else max(0, first_query - window + 1) // self.block_size
            )
            table = self.block_tables[seq_index, first_block : -(-seq_len // self.block_size)]
            first_key = first_block * self.block_size
            # Query j sits at absolute position first_query + j and sees keys up to there.
            key_pos = torch.arange(first_key, seq_len, device=table.device)
            query_pos = torch.arange(first_query, seq_len, device=table.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - window
            cached = self._shared[key] = (table, mask, first_key)
        return cached

    def token_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table [num_tokens, width] int32, context length [num_tokens] int32) of every new
        token: each query's own causal context (its position + 1), computed once per step."""
        cached = self._shared.get("tokens")
        if cached is None:
            device = self.block_tables.device
            counts = torch.tensor(self.query_lens_cpu, device=device)
            tables = self.block_tables.repeat_interleave(counts, dim=0)
            lens = torch.cat(
                [
                    torch.arange(s - n + 1, s + 1, dtype=torch.int32, device=device)
                    for n, s in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True)
                ]
            )
            cached = self._shared["tokens"] = (tables, lens)
        return cached

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """The one builder (runner, embedding adapter, tests): host lists, decodes first; each
        sequence's new tokens are the last query_len positions of its seq_len context."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            slots.extend(slots_of(table, seq_len - query_len, seq_len, block_size))
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        return cls(
            num_decode_seqs=num_decodes,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
        )


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV-cache slots of positions [start, end): one range per block touched, not per token."""
    if end - start == 1:
        return [block_table[start // block_size] * block_size + start % block_size]
    slots: list[int] = []
    pos = start
    while pos < end:
        base = block_table[pos // block_size] * block_size
        stop = min(end, (pos // block_size + 1) * block_size)
        slots.extend(range(base + pos % block_size, base + pos % block_size + stop - pos))
        pos = stop
    return slots
