"""KV cache events (no torch): the config (vLLM's `--kv-events-config` fields), the event types and
their wire form, vLLM's msgspec `array_like` tagged structs as plain msgpack arrays:

    batch        [ts, [event, ...], data_parallel_rank]
    BlockStored  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                  medium, lora_name, extra_keys?, group_idx?, kv_cache_spec_kind?,
                  kv_cache_spec_sliding_window?]
    BlockRemoved ["BlockRemoved", block_hashes, medium, group_idx?]
    AllBlocksCleared ["AllBlocksCleared"]

Trailing optional fields are left out when unset, as msgspec's omit_defaults does; consumers
(llm-d's kv-cache manager, NVIDIA Dynamo, vLLM's own structs) read them by position."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from engine.core.json_config import config_mapping

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool, whatever the device
MEDIUM_CPU = "CPU"  # vLLM's offloading connector: the host-memory tier
MEDIUM_STORAGE = "STORAGE"  # vLLM's offloading connector: a storage tier (kvserve's disk tier)
PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig: where and how the engine publishes KV cache events."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"  # bind when it has '*', '::', ipc:// or inproc://, else connect
    replay_endpoint: str | None = None  # a ROUTER socket re-sending buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events publisher must be one of {', '.join(PUBLISHERS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            low = 0 if name == "hwm" else 1  # ZMQ's high-water mark 0 means no limit
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a non-negative" if low == 0 else "a positive"
                raise ValueError(f"kv events config: {name} must be {kind} integer")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv events config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv events config: replay_endpoint must be a string or null")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv events config: enable_kv_cache_events must be true or false")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        """From vLLM's JSON text or a dict (None, '' or 'null': no events)."""
        if isinstance(value, KVEventsConfig):
            return value
        data = config_mapping(
            value,
            "kv events config",
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}',
        )
        if data is None:
            return None
        known = [f.name for f in fields(cls)]
        unknown = [k for k in data if k not in known]
        if unknown:
            raise ValueError(
                f"kv events config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"kvserve accepts {', '.join(known)}"
            )
        return cls(**dict(data))


@dataclass(frozen=True, slots=True)
class KVEventsState:
    """The publisher as snapshots, metrics and the /engine page show it."""

    endpoint: str  # as bound (a wildcard port resolved)
    replay_endpoint: str | None
    topic: str
    block_size: int  # tokens per block: a router hashes prompts in blocks of this size
    hash_seed: str  # the seed of the block hashes' NONE_HASH (engine.core.block_hashes)
    num_batches: int  # published so far: the next batch's sequence number
    num_events: int
    num_dropped: int  # batches refused because the publisher's queue was full
    num_replays: int  # replay requests served
    alive: bool


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks of one chain entered the cache: `token_ids` are all their tokens."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first one; None at a chain's start
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[str, ...] | None] | None = None  # per block, as hashed
    medium: str = MEDIUM_GPU
    group_idx: int | None = None  # set for models with more than one KV cache group
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None

    def wire(self) -> list[Any]:
        head: list[Any] = ["BlockStored", self.block_hashes, self.parent_block_hash]
        head += [self.token_ids, self.block_size, self.lora_id, self.medium, self.lora_name]
        tail = [
            None
            if self.extra_keys is None
            else [None if k is None else list(k) for k in self.extra_keys],
            self.group_idx,
            self.kv_cache_spec_kind,
            self.kv_cache_spec_sliding_window,
        ]
        return head + _trim(tail)


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks left the cache (evicted for reuse)."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU
    group_idx: int | None = None

    def wire(self) -> list[Any]:
        return ["BlockRemoved", self.block_hashes, self.medium, *_trim([self.group_idx])]


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached block is gone (start-up, a cache reset): a subscriber drops this engine's state."""

    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """The events of one engine step, published as one message with one sequence number."""

    ts: float  # time.time()
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = 0

    def wire(self) -> list[Any]:
        return [self.ts, [e.wire() for e in self.events], *_trim([self.data_parallel_rank])]


def _trim(values: list[Any]) -> list[Any]:
    """Optional trailing fields without the unset (None) ones at the end."""
    while values and values[-1] is None:
        values.pop()
    return values
