"""Contract types the engine hands to its callers: per-request outputs and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.core.errors import InvalidRequestError

FinishReason = Literal["stop", "length", "abort", "error"]  # why a sample ended


@dataclass
class TokenLogprob:
    """Logprob information for one position (a sampled token or a prompt token)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of token_id in the distribution
    # The top-N (token_id, logprob), best first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative, or only the new part when SamplingParams.output_kind == "delta"
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None  # None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float = 0.0
    # Total generated so far, also in delta mode (the engine always sets it; 0 for a score choice).
    num_output_tokens: int = 0
    # With SamplingParams.reasoning: the reasoning (cumulative or delta like `text`; None when the
    # output opened no reasoning block), apart from `text`, which is then the answer only.
    reasoning: str | None = None
    num_reasoning_tokens: int = 0  # of num_output_tokens, those up to the end of the reasoning

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Costs accumulated by the engine (the per-request cost sheet reads them when the request ends).
    num_generation_tokens: int = 0  # tokens sampled, all samples together
    num_token_gaps: int = 0  # inter-token latencies observed (non-first tokens of sample 0)
    num_preemptions: int = 0  # times one of its samples lost its KV blocks
    num_recomputed_tokens: int = 0  # tokens computed again after a preemption (minus cache hits)
    kv_block_seconds: float = 0.0  # sum over steps of the KV blocks its samples held x step time
    num_draft_tokens: int = 0  # speculative tokens proposed for its samples
    num_accepted_tokens: int = 0  # of those, accepted by verification
    # Prompt tokens the KV offload tiers supplied (part of the request's cached tokens).
    num_memory_tier_tokens: int = 0
    num_disk_tier_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first entry is None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed inside the engine
    fault: InvalidRequestError | None = None  # set when that failure is the request's own fault
    lora: str | None = None  # the LoRA adapter it ran on (None: the base model)

    @property
    def error_param(self) -> str | None:
        """The request field a failure blames (a constraint the decoder gave up on), if it does."""
        return self.fault.param if self.fault is not None else None


@dataclass
class EmbeddingOutput:
    request_id: str
    embedding: list[float]
    num_prompt_tokens: int
    error: str | None = None  # set when the request failed inside the engine
    finished: bool = True
