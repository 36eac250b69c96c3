"""The KV offload store: a bounded host-memory tier (LRU) over an optional disk tier
(engine.executor.kv_disk_tier), holding evicted prefix blocks as [layers, 2, block_size, kv_heads,
head_dim] tensors per KV cache group, and the model fingerprint that keys it (model files, weight
format, KV dtype, block size and layout). Implements engine.core.kv_offload.TierStore."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.config import CacheConfig
from engine.core.errors import StartupError
from engine.core.kv_cache_groups import KVCacheSpec
from engine.core.kv_offload import KVOffloadStats, Tier, TierEvent, TierKey
from engine.executor.kv_disk_tier import DiskTier

logger = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 10 << 30


@dataclass(slots=True)
class Entry:
    """One block's K/V on the host; `ready` is set while a device-to-host copy is in flight."""

    tensor: torch.Tensor  # [layers, 2, block_size, kv_heads, head_dim]
    ready: Any = None  # a torch.cuda.Event, or None

    def ready_tensor(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class HostTier:
    """Entries in host memory, least recently used out past `capacity` bytes."""

    def __init__(
        self, capacity: int, stats: KVOffloadStats, events: list[TierEvent] | None = None
    ) -> None:
        self.capacity = capacity
        self.stats = stats
        self.entries: OrderedDict[TierKey, Entry] = OrderedDict()
        self.used = 0
        self.events = events  # entries in and out, for KV events (None: not recorded)
        stats.memory_capacity = capacity

    def get(self, key: TierKey) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: TierKey, entry: Entry) -> None:
        if entry.nbytes > self.capacity or key in self.entries:
            return
        while self.used + entry.nbytes > self.capacity:
            old_key, old = self.entries.popitem(last=False)
            self.used -= old.nbytes
            if self.events is not None:
                self.events.append(TierEvent("memory", old_key.name))
        self.entries[key] = entry
        self.used += entry.nbytes
        if self.events is not None:
            self.events.append(TierEvent("memory", key.name, key))
        self.stats.memory_bytes = self.used
        self.stats.memory_entries = len(self.entries)


class TieredKVStore:
    def __init__(
        self,
        memory_bytes: int,
        disk: DiskTier | None,
        stats: KVOffloadStats,
        pin_memory: bool = False,
    ) -> None:
        self.stats = stats
        self.host_events: list[TierEvent] | None = None  # set by record_events()
        self.host = HostTier(memory_bytes, stats)
        self.disk = disk
        self.pin_memory = pin_memory
        self.staged: dict[TierKey, Entry] = {}  # prepared for this step's loads

    # -- the core's view (engine.core.kv_offload.TierStore) -------------------------------------
    def contains(self, key: TierKey) -> bool:
        if key in self.staged or key in self.host.entries:
            return True
        return self.disk is not None and self.disk.contains(key)

    def prepare(self, key: TierKey) -> Tier | None:
        entry = self.staged.get(key) or self.host.get(key)
        if entry is not None:
            self.staged[key] = entry
            return "memory"
        if self.disk is None or not self.disk.contains(key):
            return None
        t0 = time.perf_counter()
        tensor = self.disk.read(key)
        self.stats.load_seconds += time.perf_counter() - t0
        if tensor is None:
            return None
        if self.pin_memory:
            tensor = tensor.pin_memory()
        entry = self.staged[key] = Entry(tensor)
        self.host.put(key, entry)  # promoted: the next hit needs no read
        return "disk"

    def touch(self, key: TierKey) -> None:
        if self.host.get(key) is None and self.disk is not None:
            self.disk.touch(key)

    # -- the runner's view ----------------------------------------------------------------------
    def take(self, key: TierKey) -> Entry:
        return self.staged[key]

    def accepts(self) -> bool:
        return self.host.capacity > 0 or (self.disk is not None and self.disk.enabled)

    def put(self, key: TierKey, entry: Entry) -> None:
        if not self.accepts():
            return  # the disk tier turned off since the save was queued
        self.stats.saved_blocks += 1
        self.stats.saved_bytes += entry.nbytes
        self.host.put(key, entry)
        if self.disk is not None:
            self.disk.write(key, entry)

    def end_step(self) -> None:
        self.staged.clear()

    # -- KV events ------------------------------------------------------------------------------
    def record_events(self) -> None:
        """From now on, note every entry that enters or leaves a tier (for take_events)."""
        self.host_events = self.host.events = []
        if self.disk is not None:
            self.disk.events = []

    def take_events(self) -> list[TierEvent]:
        """The tiers' entries in and out since the last call (the host tier's, then the disk's)."""
        events: list[TierEvent] = []
        if self.host_events is not None:
            events, self.host_events[:] = list(self.host_events), []
        if self.disk is not None:
            events += self.disk.take_events()
        return events

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def model_fingerprint(
    model_dir: Path,
    weight_format: str | None,
    dtype: torch.dtype,
    block_size: int,
    spec: KVCacheSpec,
    num_kv_heads: int,
    head_dim: int,
) -> bytes:
    """16 bytes that change whenever stored K/V could differ: the model's files (names, sizes,
    modification times; the config's text), the weight format, the KV dtype and the block layout."""
    h = hashlib.blake2b(digest_size=16, person=b"kvserve-kvmodel")
    files = [model_dir] if model_dir.is_file() else sorted(model_dir.iterdir())
    for path in files:
        if path.is_file():
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
            if path.name == "config.json":
                h.update(path.read_bytes())
    layout = {
        "format": weight_format,
        "dtype": str(dtype),
        "block_size": block_size,
        "groups": [[g.window, list(g.layers)] for g in spec.groups],
        "group_size": spec.group_size,
        "kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "byteorder": "little",
    }
    h.update(json.dumps(layout, sort_keys=True).encode())
    return h.digest()


def open_kv_store(
    cache: CacheConfig,
    fingerprint: bytes,
    spec: KVCacheSpec,
    block_size: int,
    head_shape: tuple[int, int],  # (kv_heads, head_dim)
    dtype: torch.dtype,
    device: torch.device,
) -> TieredKVStore | None:
    """The store the cache config asks for (None: no tiers). Sizes that cannot work (a tier smaller
    than one block, host memory past what the machine has free) and a directory that cannot be used raise StartupError."""
    if not cache.kv_offload_memory and cache.kv_offload_dir is None:
        return None
    stats = KVOffloadStats()
    shapes: dict[int, tuple[int, ...]] = {
        g: (len(group.layers), 2, block_size, *head_shape) for g, group in enumerate(spec.groups)
    }
    block_bytes = max(math.prod(shape) for shape in shapes.values()) * dtype.itemsize
    memory = cache.kv_offload_memory or 0
    if memory:
        _check_holds_a_block("host-memory", memory, block_bytes)
        available = available_memory()
        if available is not None and memory > available:
            raise StartupError(
                f"KV offload: the host-memory tier ({_size(memory)}) is larger than the memory "
                f"available on this machine ({_size(available)})"
            )
    disk = None
    if cache.kv_offload_dir is not None:
        capacity = (
            cache.kv_offload_disk if cache.kv_offload_disk is not None else DEFAULT_DISK_BYTES
        )
        _check_holds_a_block("disk", capacity, block_bytes)
        directory = Path(cache.kv_offload_dir)
        check_directory(directory)
        disk = DiskTier(directory, capacity, fingerprint, stats, shapes, dtype)
    store = TieredKVStore(memory, disk, stats, pin_memory=device.type == "cuda")
    where = ", no disk"  # the line never claims a disk tier that is off
    if disk is not None and disk.enabled:
        where = f", disk {disk.capacity / (1 << 30):.1f} GiB in {disk.root}"
    logger.info("KV offload tiers: host memory %.0f MiB%s", store.host.capacity / (1 << 20), where)
    return store


def _size(num_bytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"


def _check_holds_a_block(tier: str, capacity: int, block_bytes: int) -> None:
    if capacity < block_bytes:
        raise StartupError(
            f"KV offload: the {tier} tier ({capacity} bytes) cannot hold one KV block "
            f"({block_bytes} bytes, {_size(block_bytes)})"
        )


def available_memory() -> int | None:
    """Bytes of memory the machine can still give (Linux's MemAvailable; None where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_directory(directory: Path) -> None:
    """The disk tier's directory exists or can be made, and takes a file (else StartupError)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        if directory.exists() and not directory.is_dir():
            reason = "not a directory"
        raise StartupError(f"KV offload: cannot use {directory} as the disk tier: {reason}") from e
