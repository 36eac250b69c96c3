"""Request state (no torch): a request group of one or more sampled sequences and their progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.core.outputs import RequestMetrics, TokenLogprob
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.text.detokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Sequence:
    """One sampled stream: the unit the scheduler and KV cache manager work with."""

    seq_id: str
    group: RequestGroup
    index: int  # sample index within the group
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    # A torch.Generator seeded from the request's seed (None: unseeded). LLMEngine.add_request
    # creates it, the sampler draws from it; typed Any so this module stays torch-free.
    generator: Any = None
    # Grammar matcher (structured outputs): it has consumed exactly the output tokens, so it
    # follows the tokens through preemption and recompute.
    matcher: Any = None
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None
    error: str | None = None
    # Output bookkeeping for delta outputs.
    num_emitted_tokens: int = 0
    final_emitted: bool = False  # its finish_reason has been sent (delta outputs)
    num_preemptions: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass(eq=False)
class RequestGroup:
    """A client request: one prompt, `params.num_samples` sequences. Sequence 0 leads: the others start
    after it has prefilled the prompt, so they find the prompt's KV blocks in the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # what the sampler uses (best_of adds logprobs=0 to rank samples)
    max_output_tokens: int  # max_tokens resolved against the model length
    user_params: SamplingParams | None = None  # as the caller asked; None means the same as params
    metrics: RequestMetrics = field(
        default_factory=lambda: RequestMetrics(arrival_time=time.monotonic())
    )
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_emitted: bool = False
    followers_released: bool = False
    error: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.seqs) and all(s.status.finished for s in self.seqs)

    @property
    def requested(self) -> SamplingParams:
        """The caller's own parameters (what outputs must honour)."""
        return self.user_params or self.params

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens if self.seqs else 0
