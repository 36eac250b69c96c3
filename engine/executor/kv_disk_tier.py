"""The disk tier of the KV offload store: one file per block under `<dir>/<model fingerprint>/`, written
by a background thread, least recently used out past its budget, and found again after a restart
(the index is rebuilt from the file names at start-up).

A file is `header, namespace, prefix token ids, payload, blake2b-256 of all that`. On a read the
checksum, the fingerprint, the group, the namespace and every prefix token are compared: a corrupt or
truncated file is a miss (and is deleted), a digest collision is a miss. An unwritable or vanished
directory turns the tier off with one warning; requests never fail because of it."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import torch

from engine.core.cache_namespace import stored_namespace
from engine.core.kv_offload import KVOffloadStats, TierEvent, TierKey

logger = logging.getLogger(__name__)

MAGIC = b"KVSTIER1"
_HEADER = struct.Struct(
    "<8s16sIIIQ"
)  # magic, fingerprint, group, namespace len, tokens len, payload
_NO_NAMESPACE = 0xFFFFFFFF
_CHECKSUM = 32
SUFFIX = ".kvb"


def encode_entry(fingerprint: bytes, key: TierKey, payload: bytes) -> bytes:
    stored = stored_namespace(key.namespace)  # a cache salt only as its digest
    namespace = b"" if stored is None else stored.encode()
    ns_len = _NO_NAMESPACE if stored is None else len(namespace)
    header = _HEADER.pack(MAGIC, fingerprint, key.group, ns_len, len(key.tokens), len(payload))
    body = b"".join((header, namespace, key.tokens, payload))
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM).digest()


def decode_entry(data: bytes, fingerprint: bytes, key: TierKey) -> bytes | None | Literal[False]:
    """The payload of an intact file for exactly `key`; False when the file is damaged (bad checksum,
    cut short, not ours); None when it is intact but holds another key (a collision, another model)."""
    if len(data) < _HEADER.size + _CHECKSUM:
        return False
    body, checksum = data[:-_CHECKSUM], data[-_CHECKSUM:]
    if hashlib.blake2b(body, digest_size=_CHECKSUM).digest() != checksum:
        return False
    magic, file_fp, group, ns_len, tok_len, payload_len = _HEADER.unpack_from(body)
    at = _HEADER.size
    namespace = None if ns_len == _NO_NAMESPACE else body[at : at + ns_len].decode(errors="replace")
    at += 0 if ns_len == _NO_NAMESPACE else ns_len
    tokens = body[at : at + tok_len]
    payload = body[at + tok_len :]
    if magic != MAGIC or len(payload) != payload_len:
        return False
    if file_fp != fingerprint or group != key.group or namespace != stored_namespace(key.namespace):
        return None
    return payload if tokens == key.tokens else None


class DiskTier:
    def __init__(
        self,
        directory: Path,
        capacity: int,
        fingerprint: bytes,
        stats: KVOffloadStats,
        shapes: dict[int, tuple[int, ...]],  # per group: an entry's tensor shape
        dtype: torch.dtype,
    ) -> None:
        self.root = directory / fingerprint.hex()
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.stats = stats
        self.shapes = shapes
        self.dtype = dtype
        self.enabled = True
        self.index: OrderedDict[str, int] = OrderedDict()  # entry name -> file bytes, LRU first
        self.writing: dict[str, tuple[TierKey, Any]] = {}  # queued, not yet on disk
        self.used = 0
        self.events: list[TierEvent] | None = None  # entries in and out (None: not recorded)
        self.lock = threading.Lock()
        self.queue: queue.Queue[tuple[TierKey, Any] | None] = queue.Queue()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._disable(f"cannot use {directory}: {e}")
        stats.disk_capacity = capacity
        self._update_fill()
        self.thread = threading.Thread(target=self._writer, name="kvserve-kv-disk", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # what is queued at shutdown still reaches the disk

    # -- index -------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from the files (oldest modification first: the first out)."""
        files = []
        for path in self.root.iterdir():
            if path.suffix == ".tmp":
                with contextlib.suppress(OSError):
                    path.unlink()  # a write cut off by the last shutdown
            elif path.suffix == SUFFIX:
                st = path.stat()
                files.append((st.st_mtime_ns, path.stem, st.st_size))
        for _, name, size in sorted(files):
            self.index[name] = size
            self.used += size
        self._evict_over(0)
        if self.index:
            logger.info(
                "KV disk tier: %d blocks from an earlier run in %s", len(self.index), self.root
            )

    def _evict_over(self, incoming: int) -> None:
        while self.index and self.used + incoming > self.capacity:
            name, size = self.index.popitem(last=False)
            self.used -= size
            self._removed(name)
            with contextlib.suppress(OSError):
                (self.root / (name + SUFFIX)).unlink()

    def _removed(self, name: str) -> None:
        """Note an entry's leaving (the lock held)."""
        if self.events is not None:
            self.events.append(TierEvent("disk", name))

    def take_events(self) -> list[TierEvent]:
        """Entries written and removed since the last call (from any thread)."""
        with self.lock:
            if not self.events:
                return []
            events, self.events = self.events, []
            return events

    def _update_fill(self) -> None:
        self.stats.disk_bytes = self.used
        self.stats.disk_entries = len(self.index)
        self.stats.disk_enabled = self.enabled

    def _disable(self, reason: str) -> None:
        with self.lock:
            if not self.enabled:
                return
            self.enabled = False
            for name in self.index:
                self._removed(name)
            self.index.clear()
            self.writing.clear()
            self.used = 0
            self._update_fill()
        logger.warning("KV disk tier off: %s (requests go on without it)", reason)

    def contains(self, key: TierKey) -> bool:
        return self.enabled and (key.name in self.index or key.name in self.writing)

    def touch(self, key: TierKey) -> None:
        with self.lock:
            if key.name in self.index:
                self.index.move_to_end(key.name)

    # -- reads (the step thread) -----------------------------------------------------------------
    def read(self, key: TierKey) -> torch.Tensor | None:
        with self.lock:
            pending = self.writing.get(key.name)
        if pending is not None and pending[0] == key:  # still queued: its entry's tensor
            return pending[1].ready_tensor()
        path = self.root / (key.name + SUFFIX)
        try:
            data = path.read_bytes()
        except OSError as e:
            self._forget(key.name)
            if not self.root.is_dir():
                self._disable(f"{self.root} is gone")
            else:
                logger.debug("KV disk tier: %s unreadable (%s): a miss", path.name, e)
            return None
        payload = decode_entry(data, self.fingerprint, key)
        if payload is None:
            return None  # an intact file of another prefix: a collision
        if payload is False or len(payload) != self._nbytes(key.group):  # damaged
            self.stats.corrupt_entries += 1
            logger.warning("KV disk tier: %s is damaged (checksum or length): a miss", path.name)
            self._forget(key.name)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.stats.disk_read_bytes += len(data)
        self.touch(key)
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.dtype).view(self.shapes[key.group])

    def _nbytes(self, group: int) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shapes[group]:
            n *= d
        return n

    def _forget(self, name: str) -> None:
        with self.lock:
            size = self.index.pop(name, None)
            if size is not None:
                self.used -= size
                self._removed(name)
                self._update_fill()

    # -- writes (the background thread) ----------------------------------------------------------
    def write(self, key: TierKey, entry: Any) -> None:
        """Queue `entry` (an engine.executor.kv_store.Entry) for writing."""
        if not self.enabled or key.name in self.index:
            return
        with self.lock:
            self.writing[key.name] = (key, entry)
        self.queue.put((key, entry))

    def _writer(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.enabled:
                    self._write_one(*item)
            finally:
                self.queue.task_done()

    def _write_one(self, key: TierKey, entry: Any) -> None:
        tensor = entry.ready_tensor()  # waits for an in-flight device copy
        payload = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        data = encode_entry(self.fingerprint, key, payload)
        path = self.root / (key.name + SUFFIX)
        tmp = path.with_suffix(".tmp")
        try:
            with self.lock:
                self._evict_over(len(data))
            if len(data) > self.capacity:
                return
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._disable(f"writing {path.name} failed: {e}")
            return
        finally:
            with self.lock:
                self.writing.pop(key.name, None)
        with self.lock:
            if not self.enabled:
                return
            self.index[key.name] = len(data)
            self.used += len(data)
            if self.events is not None:
                self.events.append(TierEvent("disk", key.name, key))
            self.stats.disk_written_bytes += len(data)
            self._update_fill()

    def flush(self) -> None:
        """Wait until every queued entry is on disk (or dropped)."""
        self.queue.join()

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(timeout=30)
