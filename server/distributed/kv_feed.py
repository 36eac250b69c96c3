"""Subscribes to each replica's KV events (ZMQ SUB, vLLM's wire format) on one background thread and
keeps a KVIndex current: batches are applied in sequence order; a gap, and a replica first seen,
are filled from the replica's replay socket; a gap replay can no longer fill clears that replica
(its state is unknown until new events arrive)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

import msgpack
import zmq

from server.distributed.kv_index import KVIndex, ReplicaEvents

logger = logging.getLogger(__name__)

END_SEQ = -1
POLL_MS = 50
REPLAY_TIMEOUT_MS = 2000


class _Stream:
    def __init__(self, source: ReplicaEvents, socket: zmq.Socket) -> None:
        self.source = source
        self.socket = socket
        self.next_seq = 0


class KVEventFeed:
    def __init__(self, index: KVIndex) -> None:
        self.index = index
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wanted: dict[Hashable, ReplicaEvents] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.num_batches = 0
        self.num_replays = 0
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-feed", daemon=True)
        self._thread.start()

    def set_replicas(self, sources: list[ReplicaEvents]) -> None:
        """The replicas to follow now (others are dropped, with what the index knew of them)."""
        with self._lock:
            self._wanted = {s.replica: s for s in sources}

    def sources(self) -> dict[Hashable, ReplicaEvents]:
        with self._lock:
            return dict(self._wanted)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    # -- the feed thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        streams: dict[Hashable, _Stream] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._sync(streams, poller)
                for socket, _ in poller.poll(POLL_MS):
                    stream = next(s for s in streams.values() if s.socket is socket)
                    while socket.poll(0):
                        self._receive(stream)
        except Exception:  # noqa: BLE001 - routing falls back to load balancing
            logger.exception("the KV events feed stopped")
        finally:
            for stream in streams.values():
                stream.socket.close(0)

    def _sync(self, streams: dict[Hashable, _Stream], poller: zmq.Poller) -> None:
        wanted = self.sources()
        for key in [k for k, s in streams.items() if wanted.get(k) != s.source]:
            stream = streams.pop(key)
            poller.unregister(stream.socket)
            stream.socket.close(0)
            self.index.forget(key)
        for key, source in wanted.items():
            if key in streams:
                continue
            socket = self._ctx.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            socket.connect(source.endpoint)
            stream = streams[key] = _Stream(source, socket)
            poller.register(socket, zmq.POLLIN)
            self._replay(stream)  # what it published before we subscribed

    def _receive(self, stream: _Stream) -> None:
        frames = stream.socket.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        seq = int.from_bytes(frames[1], "big")
        if seq == 0 and stream.next_seq > 0:  # the publisher started over
            stream.next_seq = 0
        if seq < stream.next_seq:
            return  # already applied from a replay
        if seq > stream.next_seq:
            self._replay(stream)
            if seq > stream.next_seq:  # no replay, or it no longer reaches back
                self._restart(stream, seq)
            if seq < stream.next_seq:
                return
        self._apply(stream, seq, frames[2])

    def _restart(self, stream: _Stream, seq: int) -> None:
        """Batches before `seq` are lost: what is known of the replica may be stale, so drop it
        and follow from `seq` (the index then only ever holds blocks the replica still has)."""
        if stream.next_seq > 0:
            logger.warning(
                "kv events of %s: batches %d-%d lost",
                stream.source.replica,
                stream.next_seq,
                seq - 1,
            )
        self.index.clear(stream.source.replica)
        stream.next_seq = seq

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False)
        self.index.apply(stream.source.replica, batch[1])
        stream.next_seq = seq + 1
        self.num_batches += 1

    def _replay(self, stream: _Stream) -> None:
        """Apply the buffered batches from `stream.next_seq` on, in order while they are gapless."""
        if stream.source.replay_endpoint is None:
            return
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(stream.source.replay_endpoint)
        try:
            socket.send_multipart([b"", stream.next_seq.to_bytes(8, "big")])
            while socket.poll(REPLAY_TIMEOUT_MS):
                frames = socket.recv_multipart()
                if len(frames) != 3:
                    return
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    self.num_replays += 1
                    return
                if seq > stream.next_seq:  # the buffer no longer reaches back: start afresh
                    self._restart(stream, seq)
                if seq == stream.next_seq:
                    self._apply(stream, seq, frames[2])
            logger.warning("kv events of %s: the replay did not answer", stream.source)
        finally:
            socket.close()
