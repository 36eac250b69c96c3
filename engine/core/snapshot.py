"""Immutable views of engine state (no torch): the core builds one at the end of every step, in the
thread that ran the step, and swaps it in whole, so readers on other threads (metrics, /health, the
stats endpoint, the /engine page) never touch the scheduler's live lists. Cheap by default: counts
(built from the running sequences, so a step of 256 decodes does not pay for 256 request records);
one progress row per request, the per-block detail and the recent-step timeline are built only when
a caller asks for them (the /engine page, while someone watches it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.core.config import Task

from engine.core.kv_events import KVEventsState
from engine.core.kv_offload import KVOffloadStats

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
    lora: str | None = None  # the LoRA adapter it runs on (None: the base model)


@dataclass(frozen=True, slots=True)
class BlockHolders:
    """A KV block referenced by live sequences."""

    block_id: int
    ref_count: int
    seq_ids: tuple[str, ...]  # "<request id>/<sample index>"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the timeline shows it: how its token budget split, how long it took."""

    step: int  # 1-based step number (EngineSnapshot.num_steps after it)
    time: float  # time.monotonic() at its end
    duration: float  # seconds
    num_prefill_tokens: int  # prompt (prefill-chunk) tokens computed
    num_decode_tokens: int  # one per decoding sequence
    num_preemptions: int
    num_running: int  # sequences running after it
    num_waiting: int
    # Speculative decoding: draft tokens verified in it (part of num_prefill_tokens), and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotDetail:
    """The costly part, built on request (engine.detailed_snapshot()): who holds which KV block, which
    free blocks still hold reusable prefix content, the last steps, and the limits they run against."""

    blocks: tuple[BlockHolders, ...]
    num_cached_free_blocks: int  # free blocks still holding reusable prefix-cache content
    cached_free_block_ids: tuple[int, ...] = ()
    steps: tuple[StepRecord, ...] = ()  # the most recent steps, oldest first
    block_size: int = 0  # tokens per KV block
    token_budget: int = 0  # max tokens one step computes (decodes + prefill chunks)
    max_num_seqs: int = 0  # sequences one step runs at most


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state after step `num_steps`. `num_running`/`num_waiting` count sequences (an n > 1
    request has n); `num_requests_*` count requests. Counters since start-up are monotonic."""

    task: Task
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
    # Speculative decoding since start-up: verifications, tokens proposed, tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    kv_events: KVEventsState | None = None  # the KV events publisher, when events are on
    # Requests the async front holds (admitted, not yet ended), filled in when the snapshot is read.
    num_unfinished_requests: int = 0
    kv_offload: KVOffloadStats | None = None  # the KV offload tiers' counters and fill (a copy)
    # LoRA adapters (names) of running and of waiting requests, and the distinct adapters one step
    # runs at most (vLLM's lora_requests_info gauge).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    requests: tuple[RequestProgress, ...] = ()  # one row per request: detailed snapshots only
    detail: SnapshotDetail | None = None


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """Whether the engine takes requests: starting (loop not running yet), ready, or dead."""

    state: Literal["starting", "ready", "dead"]
    error: str | None = None  # why it died

    @property
    def ready(self) -> bool:
        return self.state == "ready"


def plain_snapshot(snapshot: EngineSnapshot) -> EngineSnapshot:
    """`snapshot` without what only detailed snapshots carry (the request rows, the block detail):
    what a core publishes, so a reader of the published snapshot never gets a detailed one."""
    if not snapshot.requests and snapshot.detail is None:
        return snapshot
    return dataclasses.replace(snapshot, requests=(), detail=None)
