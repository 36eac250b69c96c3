"""Engine statistics handed to observers after every step (no torch, no prometheus here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float


@dataclass
class StepStats:
    kind: str  # "prefill" | "decode" | "mixed"
    duration: float  # seconds spent in the step (schedule + forward + sample + outputs)
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # in this step
    num_new_prompt_tokens: int  # prompt tokens of requests first scheduled in this step
    num_generation_tokens: int  # tokens sampled in this step
    prefix_cache_queries: int  # tokens looked up in this step
    prefix_cache_hits: int
    # (request_id, seconds since its previous token) for every sequence that got a token after its first
    inter_token_latencies: list[float] = field(default_factory=list)
    first_tokens: list[tuple[str, float]] = field(
        default_factory=list
    )  # (request_id, ttft seconds)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class EngineTotals:
    """Monotonic counters since start-up."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_finished: int = 0
    num_steps: int = 0
