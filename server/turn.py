"""One sample's assistant turn as typed events: engine outputs in, reasoning, text, tool-call and
logprob deltas and the finish out, whole or streamed. Every API surface renders these, so why a turn ended, how many
tokens it took and what its tool calls were are worked out here once."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine import CompletionOutput, TokenLogprob
from engine.text import ToolCallStreamer, ToolPlan


class TurnEnd(enum.StrEnum):
    """Why a turn ended, as every surface words it from there."""

    STOP = "stop"  # EOS, a stop token or string, a finished constraint (or an abort/error)
    LENGTH = "length"  # max tokens or the model's length
    TOOL_CALLS = "tool_calls"  # stopped after calling tools


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments (a prefix when the turn was cut off)

    def chat_dict(self) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry: what a chat message carries, and what history replays."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# The events are named tuples: immutable and typed, and cheap enough to make one per token.
class TextDelta(NamedTuple):
    text: str


class ReasoningDelta(NamedTuple):
    """A piece of the reasoning; all of them come before the answer's deltas."""

    text: str


class ToolCallStart(NamedTuple):
    """Call number `call` begins: its id and function name (its arguments follow as
    ToolCallArguments)."""

    call: int
    id: str
    name: str


class ToolCallArguments(NamedTuple):
    call: int
    text: str  # the next piece of the call's arguments


TurnDelta = ReasoningDelta | TextDelta | ToolCallStart | ToolCallArguments


class Finish(NamedTuple):
    end: TurnEnd
    stop_reason: str | int | None  # the engine's: the stop string or stop token id, if one ended it

    @property
    def stop_string(self) -> str | None:
        """The stop sequence that ended the turn (not a stop token; never for calls or length)."""
        if self.end == TurnEnd.STOP and isinstance(self.stop_reason, str):
            return self.stop_reason
        return None


class TurnStep(NamedTuple):
    """What one engine output moved in a turn: deltas in order, the logprobs of its tokens, and its
    finish when it is the last."""

    deltas: list[TurnDelta]
    logprobs: list[TokenLogprob] | None  # None: none asked for
    finish: Finish | None
    output_tokens: int  # generated so far
    reasoning_tokens: int  # of those, the reasoning's


@dataclass
class Turn:
    """A finished assistant turn."""

    content: str | None  # None: no text (a turn of only tool calls, or empty when tools are parsed)
    tool_calls: list[ToolCall] = field(default_factory=list)
    end: TurnEnd = TurnEnd.STOP
    stop_string: str | None = None
    output_tokens: int = 0
    stop_reason: str | int | None = None  # the engine's, as chat and completions report it
    reasoning: str | None = None  # the reasoning before the answer (None: none given)
    reasoning_tokens: int = 0  # of output_tokens, those that reasoned

    @property
    def text(self) -> str:
        return self.content or ""


def finish_of(out: CompletionOutput, called: bool) -> Finish | None:
    """The one mapping of an engine finish ("stop" | "length" | "abort" | "error") to a turn's end."""
    if out.finish_reason is None:
        return None
    if out.finish_reason == "length":
        return Finish(TurnEnd.LENGTH, out.stop_reason)
    return Finish(TurnEnd.TOOL_CALLS if called else TurnEnd.STOP, out.stop_reason)


def final_turn(
    out: CompletionOutput, plan: ToolPlan | None = None, parallel: bool | None = None
) -> Turn:
    """A finished (final-kind) engine output as a turn; with a tool plan, its calls are parsed out."""
    content: str | None = out.text
    calls: list[ToolCall] = []
    if plan is not None and plan.parse_calls:
        parsed = plan.parser.parse(out.text, final=True)
        content = parsed.content
        found = parsed.tool_calls if parallel is not False else parsed.tool_calls[:1]
        calls = [ToolCall(new_call_id(), c.name, c.arguments) for c in found if c.name is not None]
    finish = finish_of(out, bool(calls)) or Finish(TurnEnd.LENGTH, None)
    return Turn(
        content,
        calls,
        finish.end,
        finish.stop_string,
        out.num_output_tokens,
        out.stop_reason,
        out.reasoning or None,
        out.num_reasoning_tokens,
    )


class TurnStream:
    """Delta engine outputs of one sample -> TurnSteps; `turn` is the whole turn once it finished.
    With a tool plan, the streaming tool-call parser splits text from calls (joined, the deltas equal
    `final_turn` of the whole text)."""

    def __init__(self, plan: ToolPlan | None = None, parallel: bool | None = None) -> None:
        self.streamer = (
            ToolCallStreamer(plan.parser) if plan is not None and plan.parse_calls else None
        )
        self.max_calls = 1 if parallel is False else None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, list[str]] = {}  # call index -> [id, name, arguments...]
        self.turn: Turn | None = None

    @property
    def parses_tools(self) -> bool:
        return self.streamer is not None

    def _split(self, text: str, final: bool) -> list[TurnDelta]:
        assert self.streamer is not None
        step = self.streamer.feed(text, final=final)
        deltas: list[TurnDelta] = [TextDelta(step.content)] if step.content else []
        for index, name, arguments in step.calls:
            if self.max_calls is not None and index >= self.max_calls:
                continue
            if name is not None:
                deltas.append(ToolCallStart(index, new_call_id(), name))
            if arguments:
                deltas.append(ToolCallArguments(index, arguments))
        return deltas

    def feed(self, out: CompletionOutput) -> TurnStep:
        if self.streamer is None:  # the common case, once per token: text only
            deltas: list[TurnDelta] = [TextDelta(out.text)] if out.text else []
            if out.text:
                self.text.append(out.text)
        else:
            deltas = self._split(out.text, final=out.finish_reason is not None)
            for d in deltas:
                if isinstance(d, TextDelta):
                    self.text.append(d.text)
                elif isinstance(d, ToolCallStart):
                    self.calls[d.call] = [d.id, d.name]
                elif isinstance(d, ToolCallArguments):
                    self.calls[d.call].append(d.text)
        if out.reasoning:  # before the answer's deltas
            self.reasoning.append(out.reasoning)
            deltas.insert(0, ReasoningDelta(out.reasoning))
        if out.finish_reason is None:
            return TurnStep(
                deltas, out.logprobs, None, out.num_output_tokens, out.num_reasoning_tokens
            )
        finish = finish_of(out, bool(self.calls))
        if finish is not None:
            tool_calls = [
                ToolCall(parts[0], parts[1], "".join(parts[2:]))
                for _, parts in sorted(self.calls.items())
            ]
            self.turn = Turn(
                "".join(self.text),
                tool_calls,
                finish.end,
                finish.stop_string,
                out.num_output_tokens,
                out.stop_reason,
                "".join(self.reasoning) or None,
                out.num_reasoning_tokens,
            )
        return TurnStep(
            deltas, out.logprobs, finish, out.num_output_tokens, out.num_reasoning_tokens
        )
