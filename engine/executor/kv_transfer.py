"""The runner's half of the KV offload tiers: one step's block copies between the paged KV cache and
the store (engine.executor.kv_store), batched per KV cache group, before the forward.

Saves are read out of the pool first (a load may target a block evicted this very step), then loads
are written in, then the saved copies enter the store. On CUDA a save is one gather on the compute
stream (the pool may be overwritten right after it) and a device-to-host copy into pinned memory on a
side stream, so the forward never waits for the host; a load is a non-blocking host-to-device copy."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from engine.core.kv_cache_groups import KVCacheSpec
from engine.core.kv_offload import KVTransfers, TierKey
from engine.executor.kv_store import Entry, TieredKVStore


class KVTransferRunner:
    def __init__(
        self,
        store: TieredKVStore,
        tensors: list[torch.Tensor],  # the group_size cache tensors [2, blocks, bs, kv_heads, d]
        spec: KVCacheSpec,
        device: torch.device,
    ) -> None:
        self.store = store
        self.tensors = tensors
        self.layers = [len(g.layers) for g in spec.groups]  # cache tensors each group uses
        self.device = device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, transfers: KVTransfers) -> None:
        saved = self._gather(transfers.saves) if transfers.saves else []
        if transfers.loads:
            t0 = time.perf_counter()
            self._load(transfers.loads)
            self.store.stats.load_seconds += time.perf_counter() - t0
        for key, entry in saved:
            self.store.put(key, entry)
        self.store.end_step()

    def _by_group(self, items: list[tuple[int, TierKey]]) -> dict[int, list[tuple[int, TierKey]]]:
        groups: dict[int, list[tuple[int, TierKey]]] = defaultdict(list)
        for block_id, key in items:
            groups[key.group].append((block_id, key))
        return groups

    def _gather(self, saves: list[tuple[int, TierKey]]) -> list[tuple[TierKey, Entry]]:
        out: list[tuple[TierKey, Entry]] = []
        for g, items in self._by_group(saves).items():
            idx = torch.tensor([b for b, _ in items], device=self.device)
            # [layers, 2, n, bs, kv_heads, d]: a fresh tensor, so the pool may change after this
            stacked = torch.stack([t.index_select(1, idx) for t in self.tensors[: self.layers[g]]])
            if self.side_stream is None:
                for k, (_, key) in enumerate(items):
                    out.append((key, Entry(stacked[:, :, k].contiguous())))
                continue
            self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side_stream):
                stacked.record_stream(self.side_stream)
                hosts = []
                for k in range(len(items)):
                    host = torch.empty(stacked[:, :, k].shape, dtype=stacked.dtype, pin_memory=True)
                    host.copy_(stacked[:, :, k], non_blocking=True)
                    hosts.append(host)
                event = torch.cuda.Event()
                event.record(self.side_stream)
            for (_, key), host in zip(items, hosts, strict=True):
                out.append((key, Entry(host, event)))
        return out

    def _load(self, loads: list[tuple[int, TierKey]]) -> None:
        stream = torch.cuda.current_stream(self.device) if self.side_stream is not None else None
        for g, items in self._by_group(loads).items():
            entries = [self.store.take(key) for _, key in items]
            n, shape = len(entries), entries[0].tensor.shape
            buf = torch.empty((n, *shape), dtype=entries[0].tensor.dtype, device=self.device)
            for k, entry in enumerate(entries):
                if entry.ready is not None and stream is not None:
                    stream.wait_event(entry.ready)  # saved this step or the last: still in flight
                buf[k].copy_(entry.tensor, non_blocking=True)
                self.store.stats.loaded_bytes += entry.nbytes
            idx = torch.tensor([b for b, _ in items], device=self.device)
            for j, t in enumerate(self.tensors[: self.layers[g]]):
                t.index_copy_(1, idx, buf[:, j].transpose(0, 1))  # [2, n, bs, kv_heads, d]
