"""Publishes KV event batches over ZeroMQ off the step thread, in vLLM's wire format: a PUB socket
sends each batch as the multipart message [topic, sequence number (8 bytes, big-endian), msgpack
payload], the sequence number rising by one per batch from 0; an optional ROUTER replay socket
takes a start sequence number (8 bytes, big-endian) and re-sends every buffered batch from there as
[sequence, payload] frames, then the end marker [-1 as 8 signed bytes, b""]."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Protocol

import msgpack
import zmq

from engine.core.errors import StartupError
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_event_recorder import KVEventRecorder
from engine.core.kv_events import KVEventBatch, KVEventsConfig, KVEventsState
from engine.core.kv_offload import TierEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.02  # how long the thread waits for a batch before it looks at replay requests


def binds(endpoint: str) -> bool:
    """vLLM's convention: bind a stable (wildcard or local) address, connect to anything else."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.startswith("tcp://0.0.0.0")
    )


class ZmqEventPublisher:
    """A queue and a publisher thread; `publish` never blocks the caller (a full queue drops)."""

    def __init__(
        self,
        config: KVEventsConfig,
        block_size: int,
        hash_seed: str,
        data_parallel_rank: int = 0,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self.num_batches = self.num_events = self.num_dropped = self.num_replays = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._opening = config.endpoint  # the endpoint being opened (named if that fails)
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise StartupError(f"kv events: cannot open {self._opening}: {self._error}")
        logger.info(
            "publishing KV events on %s (replay: %s, topic %r)",
            self.endpoint,
            self.replay_endpoint or "off",
            config.topic,
        )

    # -- the step thread's side ---------------------------------------------------------------------
    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("kv events queue full: a batch of %d events dropped", len(batch.events))

    def state(self) -> KVEventsState:
        return KVEventsState(
            self.endpoint,
            self.replay_endpoint,
            self.config.topic,
            self.block_size,
            self.hash_seed,
            self.num_batches,
            self.num_events,
            self.num_dropped,
            self.num_replays,
            self._thread.is_alive(),
        )

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    # -- the publisher thread -----------------------------------------------------------------------
    def _open(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 1000)
        try:
            if binds(self.endpoint):
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port of ':*'
            else:
                pub.connect(self.endpoint)
        except zmq.ZMQError:
            pub.close(0)
            raise
        replay = None
        if self.replay_endpoint is not None:
            self._opening = self.replay_endpoint
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            try:
                replay.bind(self.replay_endpoint)
            except zmq.ZMQError:
                replay.close()
                pub.close(0)
                raise
            self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._open(ctx)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            running = True
            while running:
                if replay is not None and replay.poll(0):
                    # Batches queued before the request are sent (and buffered) first, so a
                    # replay never misses one the engine published before it was asked.
                    running = self._send_queued(pub)
                    while replay.poll(0):
                        self._serve_replay(replay)
                    continue
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                self._send(pub, batch)
        except Exception:  # noqa: BLE001 - the engine goes on without events
            logger.exception("the KV events publisher stopped")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _send_queued(self, pub: zmq.Socket) -> bool:
        """Send every batch queued now; False when the queue said stop."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            self._send(pub, batch)

    def _send(self, pub: zmq.Socket, batch: KVEventBatch) -> None:
        seq = self.num_batches
        payload = msgpack.packb(batch.wire(), use_bin_type=True)
        pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_batches = seq + 1
        self.num_events += len(batch.events)

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning(
                "kv events: ignoring a malformed replay request (%d frames)", len(frames)
            )
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
        self.num_replays += 1


class TierEventSource(Protocol):
    def take_events(self) -> list[TierEvent]: ...


class KVEventStream:
    """The engine's KV events: a recorder listening to the pool and the publisher it feeds once
    per step (`flush`, on the step thread; the sending happens on the publisher's thread)."""

    def __init__(self, recorder: KVEventRecorder, publisher: ZmqEventPublisher) -> None:
        self.recorder = recorder
        self.publisher = publisher
        self.tiers: TierEventSource | None = None  # the KV offload store, when there is one

    @classmethod
    def start(cls, config: KVEventsConfig, kv: KVCacheManager, seed: str) -> KVEventStream:
        if not kv.enable_prefix_caching:
            logger.warning("kv events are on but prefix caching is off: no block events follow")
        recorder = KVEventRecorder(kv.pool.trie, kv.block_size, kv.windows, seed)
        publisher = ZmqEventPublisher(config, kv.block_size, seed)
        kv.pool.listener = recorder
        recorder.cleared()  # batch 0: a subscriber drops what it knew of an engine at this address
        stream = cls(recorder, publisher)
        stream.flush()
        return stream

    def flush(self) -> None:
        if self.tiers is not None:
            self.recorder.tier_events(self.tiers.take_events())
        events = self.recorder.take()
        if events:
            self.publisher.publish(KVEventBatch(time.time(), events))

    def close(self) -> None:
        self.flush()
        self.publisher.close()
