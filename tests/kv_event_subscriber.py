"""A KV events consumer written as llm-d's reader is: pyzmq SUB + msgpack, events decoded by
position from vLLM's array layout, hashes recomputed with hashlib + cbor2 (vLLM's sha256_cbor), and
a DEALER asking the replay socket for missed batches. It imports nothing from kvserve."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import cbor2
import msgpack
import zmq

END_SEQ = -1


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def low64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def prompt_digests(
    tokens: list[int], block_size: int, extra: Any = None, seed: str = "0"
) -> list[bytes]:
    parent = sha256_cbor(seed)
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = sha256_cbor((parent, tuple(tokens[i : i + block_size]), extra))
        out.append(parent)
    return out


@dataclass
class Event:
    kind: str
    fields: list[Any]

    @property
    def block_hashes(self) -> list[int]:
        return self.fields[1]


def decode(payload: bytes) -> tuple[float, list[Event], int | None]:
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list), "a batch is an array [ts, events, dp_rank]"
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    decoded = []
    for raw in events:
        assert isinstance(raw, list) and isinstance(raw[0], str), raw
        decoded.append(Event(raw[0], raw))
    return ts, decoded, rank


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
        self.replay_endpoint = replay_endpoint
        self.received: dict[int, bytes] = {}
        self.topics: set[bytes] = set()

    def poll(self, timeout: float = 0.2) -> int:
        """Read what arrives within `timeout` seconds of quiet; returns how many came."""
        n = 0
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert len(seq) == 8
            self.topics.add(topic)
            self.received[int.from_bytes(seq, "big")] = payload
            n += 1
        return n

    def replay(self, start: int, timeout: float = 5.0) -> dict[int, bytes]:
        assert self.replay_endpoint is not None
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint.replace("0.0.0.0", "127.0.0.1"))
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: dict[int, bytes] = {}
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not sock.poll(100):
                    continue
                empty, seq, payload = sock.recv_multipart()
                assert empty == b""
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_SEQ:
                    assert payload == b""
                    return out
                out[number] = payload
            raise AssertionError("no end-of-replay marker")
        finally:
            sock.close()

    def close(self) -> None:
        self.sub.close()


class CacheView:
    """What a router learns: the hashes each engine holds, and the digests behind them."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.digests: dict[int, bytes] = {}
        self.stored = self.removed = self.cleared = 0

    def apply(self, events: list[Event], seed: str = "0") -> None:
        for e in events:
            if e.kind == "BlockStored":
                hashes, parent, tokens, size = e.fields[1:5]
                extra_keys = e.fields[8] if len(e.fields) > 8 else None
                digest = sha256_cbor(seed) if parent is None else self.digests[parent]
                for i, h in enumerate(hashes):
                    extra = None if extra_keys is None else extra_keys[i]
                    extra = tuple(extra) if extra is not None else None
                    digest = sha256_cbor((digest, tuple(tokens[i * size : (i + 1) * size]), extra))
                    assert low64(digest) == h, "a block hash does not recompute from its tokens"
                    self.digests[h] = digest
                    self.held.add(h)
                assert len(tokens) == size * len(hashes)
                self.stored += len(hashes)
            elif e.kind == "BlockRemoved":
                for h in e.block_hashes:
                    assert h in self.held, "a removal of a block never stored"
                    self.held.discard(h)
                self.removed += len(e.block_hashes)
            else:
                assert e.kind == "AllBlocksCleared", e.kind
                self.held.clear()
                self.cleared += 1
