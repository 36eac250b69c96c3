"""Request state (no torch): a request group of one or more sequences and their progress. A generation
group samples `n` sequences of one prompt; a score group holds one prompt-only sequence per choice
(context + choice), scored over the choice's tokens and never sampled."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine.core.errors import InvalidRequestError
from engine.core.outputs import FinishReason, RequestMetrics, TokenLogprob
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
        return self._value_ in _FINISHED_VALUES  # str hash: members hash in Python code

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self._value_)


_FINISHED_VALUES = frozenset(
    s.value
    for s in (
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    )
)
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
}  # finished statuses' values -> the reason outputs report


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
    # Output bookkeeping for delta outputs.
    num_emitted_tokens: int = 0
    final_emitted: bool = False  # its finish_reason has been sent (delta outputs)
    # Score groups: the first scored position (the choice's first token); its logprobs go to `logprobs`.
    score_start: int | None = None
    num_lost_tokens: int = 0  # computed tokens whose KV the last preemption dropped

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
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def prompt_logprobs_from(self) -> int | None:
        """The first prompt position whose next-token logprobs are wanted (None: none): a score
        sequence's last context token, or the start of an echoed prompt (sample 0 only)."""
        if self.score_start is not None:
            return self.score_start - 1
        if self.params.prompt_logprobs is not None and self.index == 0:
            return 0
        return None

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens whose KV may come from other sequences' blocks: all but the last token, and
        none from where prompt logprobs are wanted (those positions must be computed)."""
        limit = self.num_tokens - 1
        logprobs_from = self.prompt_logprobs_from
        return limit if logprobs_from is None else min(limit, logprobs_from)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


RequestKind = Literal["generate", "score"]


@dataclass(eq=False)
class RequestGroup:
    """A client request: one prompt, `params.num_samples` sequences (a score group: one per choice).
    Sequence 0 leads: the others start after it has prefilled the prompt, so they reuse the prompt's KV
    blocks (from the prefix cache, or by reference to the leader's blocks)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the prefix every sequence of the group shares (a score's context)
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
    # Set when the error is the request's own fault (a constraint the decoder gave up on): a 400,
    # not the engine's.
    fault: InvalidRequestError | None = None
    kind: RequestKind = "generate"
    # The prefix-cache namespace of the request's KV (None: the plain model): a LoRA adapter's content
    # hash and/or a cache salt. Blocks are shared only between requests of the same namespace.
    cache_namespace: str | None = None
    # The LoRA adapter the request runs on (None: the base model): its served name, and the id of
    # the loaded weights (unique per load, so a reloaded name is a different adapter).
    lora_name: str | None = None
    lora_id: int | None = None

    @classmethod
    def for_scoring(
        cls,
        request_id: str,
        context: list[int],
        choices: list[list[int]],
        num_top_logprobs: int = 0,
        prompt: str | None = None,
    ) -> RequestGroup:
        """A score group: per choice a prompt-only sequence (context + choice) whose prompt logprobs
        cover the choice, max_tokens 0 so nothing is sampled; choice 0 leads and prefills the context."""
        params = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=num_top_logprobs)
        group = cls(request_id, prompt, list(context), params, 0, kind="score")
        for i, choice in enumerate(choices):
            tokens = list(context) + list(choice)
            seq = Sequence(
                f"{request_id}/{i}", group, i, tokens, len(tokens), score_start=len(context)
            )
            group.seqs.append(seq)
        return group

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

    @property
    def num_prompt_tokens(self) -> int:
        """Input tokens of the request: the prompt, plus every scored choice of a score group."""
        shared = len(self.prompt_token_ids)
        return shared + sum(
            s.num_prompt_tokens - shared for s in self.seqs if s.score_start is not None
        )
