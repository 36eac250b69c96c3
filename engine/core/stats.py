"""Engine statistics handed to observers after every step (no torch, no prometheus here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.core.outputs import FinishReason
    from engine.core.request import RequestKind

StepKind = Literal["prefill", "decode", "mixed"]


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    kind: RequestKind = "generate"
    lora: str | None = None  # the LoRA adapter it ran on (None: the base model)


@dataclass
class StepStats:
    kind: StepKind
    duration: float = 0.0  # seconds spent in the step (schedule + forward + sample + outputs)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # in this step
    num_new_prompt_tokens: int = 0  # prompt tokens of requests first scheduled in this step
    num_generation_tokens: int = 0  # tokens sampled in this step
    prefix_cache_queries: int = 0  # tokens looked up in this step
    prefix_cache_hits: int = 0
    # Speculative decoding in this step (vLLM's spec_decode_* counters).
    spec_num_drafts: int = 0  # sequences verified
    spec_num_draft_tokens: int = 0  # tokens proposed
    spec_num_accepted_tokens: int = 0  # of those accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted at draft j
    # Seconds since the previous token of sample 0, for every request that got a non-first token.
    inter_token_latencies: list[float] = field(default_factory=list)
    # (request_id, seconds to its first token) for every request that got its first token.
    first_tokens: list[tuple[str, float]] = field(default_factory=list)
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
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
