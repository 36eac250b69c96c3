"""TurnRequest: one chat-shaped turn, what chat completions, Responses and Messages each parse their
own (already validated) request into before it is planned (serving_chat.plan_turn): the conversation
as typed messages, the sampling fields, the constraint, the tools. Built field by field from the
surface's typed request, never through a dict; its field paths are chat's, which each surface's
FieldMap renames in its errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine import StructuredOutputs
from server.protocol import ChatMessage, SamplingFields
from server.turn import ToolCall

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(frozen=True)
class TurnMessage:
    """A message of the conversation: text (one string, or text parts joined by newlines), the
    tool calls of an assistant message, the call a tool message answers, an earlier reply's
    reasoning."""

    role: Role
    content: str | tuple[str, ...] | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning: str | None = None

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(self.content)


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its JSON schema `parameters` (None: no arguments)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    strict: bool | None = None


@dataclass(frozen=True)
class NamedTool:
    """tool_choice that forces the function `name`."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass(frozen=True)
class Sampling:
    """The sampling and stopping fields of a request (None: the default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None
    seed: int | None = None
    min_tokens: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def of(cls, req: SamplingFields) -> Sampling:
        """The sampling fields of a completions or chat request."""
        return cls(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=req.logit_bias,
            seed=req.seed,
            min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            skip_special_tokens=req.skip_special_tokens is not False,
        )


@dataclass(frozen=True)
class TurnRequest:
    model: str | None
    messages: Sequence[TurnMessage]
    sampling: Sampling
    stream: bool
    max_tokens: int | None = None
    max_tokens_field: str = "max_completion_tokens"  # the chat field `max_tokens` came from
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    constraint: StructuredOutputs | None = None  # response_format / structured_outputs
    tools: Sequence[ToolSpec] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS (and such) over the template's
    # The request's chat template variables (over the server's --chat-template-kwargs).
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only with the same salt
    prompt_logprobs: int | None = None  # vLLM's: top-N logprobs of each prompt token
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last N tokens


def turn_message(m: ChatMessage) -> TurnMessage:
    """A chat API message as a turn message."""
    content: str | tuple[str, ...] | None
    if m.content is None or isinstance(m.content, str):
        content = m.content
    else:
        content = tuple(p.text for p in m.content)
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    return TurnMessage(m.role, content, m.name, calls, m.tool_call_id, reasoning)


def turn_messages(messages: Sequence[ChatMessage]) -> list[TurnMessage]:
    return [turn_message(m) for m in messages]
