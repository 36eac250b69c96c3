"""Per-request sampling and stopping parameters, validated on construction, and the request checks every
engine and API share: prompt tokens, context length, seeds (no torch). Each rule is written here once."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal

from engine.core.errors import ContextLengthError, PromptError, SamplingParamsError

OutputKind = Literal["cumulative", "delta", "final"]
_EPS = 1e-5
# torch.Generator.manual_seed takes any 64-bit value, signed or not; samples after the first get seeds
# mixed from (seed, index) (see engine.llm_engine.sample_seed), always inside this range too.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1

_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The name by which a grammar refers to its `answer` constraint (Lark: `@answer`).
ANSWER_GRAMMAR = "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    """Where a reasoning block stands in the generated text: from `start` to `end`, first. With
    `starts_inside` the prompt opened it (the output starts in reasoning; a leading `start` is
    skipped); else the output opens one only by starting with `start`, and is otherwise all answer.
    Stop strings and the structured-output constraint apply to the answer, after the block."""

    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the generated text: exactly one of a JSON schema (as JSON text), any JSON
    object, a regex, a choice of strings or a Lark/GBNF grammar. Hashable: it keys the compile cache.

    `source` names the API field it came from, so that a compile error names it too. A grammar may
    embed a second constraint, `answer`, which it reaches as `@answer`: tool calls or a reply in the
    requested response format.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # Regex of the whitespace allowed between JSON tokens; None -> none (compact JSON, ", " and ": ").
    whitespace_pattern: str | None = None
    answer: StructuredOutputs | None = None  # only with `grammar`; itself without an answer
    # The output reasons first (freely, up to the block's end); the constraint applies after it.
    reasoning: ReasoningFormat | None = None
    source: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise SamplingParamsError(
                f"give exactly one constraint of {', '.join(_CONSTRAINT_KINDS)} (found: {found})",
                self.source,
            )
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError(
                    "choice must be a non-empty list of non-empty strings", self.source
                )
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise SamplingParamsError(
                    f"the JSON schema is not JSON: {e}", self.source
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise SamplingParamsError("a JSON schema must be an object", self.source)
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise SamplingParamsError(
                "whitespace_pattern applies only to json and json_object constraints", self.source
            )
        if self.answer is not None and (
            self.grammar is None
            or self.answer.answer is not None
            or self.answer.reasoning is not None
        ):
            raise SamplingParamsError(
                "an answer constraint goes only in a grammar, and only one level deep", self.source
            )

    @property
    def kind(self) -> str:
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1  # samples returned per prompt
    # Samples drawn; the n with the highest cumulative logprob are returned.
    best_of: int | None = None
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 -> disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None -> until the model's maximum length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N logprobs per sampled token (0 -> only the sampled token's)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    # What each RequestOutput carries: all so far, the new part, or only the end.
    output_kind: OutputKind = "final"
    # Constrained decoding: every sampled token keeps the output inside this constraint.
    structured_outputs: StructuredOutputs | None = None
    # The output's reasoning block (chat requests of a thinking model): outputs carry it apart from
    # the answer, and stop strings and `structured_outputs` apply only to the answer.
    reasoning: ReasoningFormat | None = None

    def __post_init__(self) -> None:
        so = self.structured_outputs
        if self.reasoning is not None and so is not None and so.reasoning != self.reasoning:
            self.structured_outputs = dataclasses.replace(so, reasoning=self.reasoning)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise SamplingParamsError(message, param)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"n must be at least 1, got {self.n}")
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or self.best_of < self.n
        ):
            fail("best_of", f"best_of must be an integer >= n ({self.n}), got {self.best_of}")
        if self.output_kind == "delta" and self.num_samples > self.n:
            # Ranking by cumulative logprob needs every sample finished: nothing can be streamed.
            fail("best_of", "best_of greater than n cannot be streamed; set stream to false")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            fail("seed", f"seed must be an integer in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        if not 0.0 <= self.temperature <= 2.0 + _EPS:
            fail("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            fail(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            )
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 0
        ):
            fail("max_tokens", f"max_tokens must be a non-negative integer, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"min_tokens must be a non-negative integer, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            fail("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            fail(
                "prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"
            )
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    fail("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
                if not -100.0 <= bias <= 100.0:
                    fail("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "stop_token_ids must be non-negative token ids")
        if self.output_kind not in ("cumulative", "delta", "final"):
            fail("output_kind", f"unknown output_kind {self.output_kind!r}")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for token_id in self.logit_bias or {}:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"token id {token_id} is outside the vocabulary (size {vocab_size})",
                    "logit_bias",
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise SamplingParamsError(
                    f"token id {token_id} is outside the vocabulary (size {vocab_size})",
                    "stop_token_ids",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def num_samples(self) -> int:
        """Sequences actually generated (best_of >= n)."""
        return self.best_of or self.n


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """A request's input tokens: at least one, each inside the vocabulary."""
    if not token_ids:
        raise PromptError(f"the {param} is empty: give at least one token", param)
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(
            f"{param} token id {bad} is outside the vocabulary (size {vocab_size})", param
        )


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The completion's token budget (None: up to the model length); a ContextLengthError when prompt
    plus completion do not fit the model."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_model_len} tokens. However, the prompt "
                f"has {num_prompt_tokens} tokens, which leaves none to generate. Please reduce the "
                "length of the prompt.",
                limit=max_model_len,
                needed=num_prompt_tokens + 1,
            )
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            "for the completion). Please reduce the length of the prompt or the completion.",
            limit=max_model_len,
            needed=num_prompt_tokens + max_tokens,
        )
    return max_tokens


def check_input_length(num_tokens: int, max_model_len: int, param: str = "input") -> None:
    """An input that is only encoded (an embedding) must fit the model whole."""
    if num_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your input has "
            f"{num_tokens} tokens. Shorten it or ask for truncation (truncate_prompt_tokens).",
            param,
            limit=max_model_len,
            needed=num_tokens,
        )


__all__ = [
    "MAX_SEED",
    "MIN_SEED",
    "ContextLengthError",
    "OutputKind",
    "PromptError",
    "SamplingParams",
    "SamplingParamsError",
    "check_input_length",
    "check_token_ids",
    "resolve_max_tokens",
]
