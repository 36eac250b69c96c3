"""Immutable views of engine state (no torch): the core builds one at the end of every step, in the
thread that ran the step, and swaps it in whole, so readers on other threads (metrics, /health, the
stats endpoint) never touch the scheduler's live lists. Cheap by default: counts and one progress row
per request; the per-block detail is built only when a caller asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RequestState = Literal["waiting", "running", "preempted"]


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """One unfinished request as of the snapshot (counts of its first sample for n > 1)."""

    request_id: str
    state: RequestState  # running if any of its samples runs; preempted if one waits to recompute
    num_samples: int
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the cache
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    arrival_time: float  # time.monotonic() when the request arrived


@dataclass(frozen=True, slots=True)
class BlockHolders:
    """A KV block referenced by live sequences."""

    block_id: int
    ref_count: int
    seq_ids: tuple[str, ...]  # "<request id>/<sample index>"


@dataclass(frozen=True, slots=True)
class SnapshotDetail:
    """The costly part, built on request (engine.detailed_snapshot()): who holds which KV block."""

    blocks: tuple[BlockHolders, ...]
    num_cached_free_blocks: int  # free blocks still holding reusable prefix-cache content


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state after step `num_steps`. `num_running`/`num_waiting` count sequences (an n > 1
    request has n); `num_requests_*` count requests. Counters since start-up are monotonic."""

    task: str
    num_steps: int
    time: float  # time.monotonic() when it was built
    num_running: int = 0
    num_waiting: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_waiting_tokens: int = 0  # prompt tokens still to compute for the waiting sequences
    kv_cache_usage: float = 0.0  # fraction of KV blocks referenced by live sequences
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_finished: int = 0
    # Requests the async front holds (admitted, not yet ended), filled in when the snapshot is read.
    num_unfinished_requests: int = 0
    requests: tuple[RequestProgress, ...] = ()
    detail: SnapshotDetail | None = None


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Whether the engine takes requests: starting (loop not running yet), ready, or dead."""

    state: Literal["starting", "ready", "dead"]
    error: str | None = None  # why it died

    @property
    def ready(self) -> bool:
        return self.state == "ready"
