"""What the Responses and Messages surfaces share over the chat path: building a chat completions request
from their fields (errors renamed to their own field names), an engine output as an assistant turn
(text, tool calls, why it ended), whole or as a stream of deltas, and the skeleton of their event streams."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from engine import CompletionOutput, RequestOutput, ToolPlan
from server.errors import APIError, validation_error
from server.protocol import ChatCompletionRequest
from server.streaming import FrameStream
from server.tool_calling import ToolCallDeltas, parse_tool_calls

TurnEnd = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments


@dataclass
class ChatTurn:
    """An assistant turn as every surface reports it."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    end: TurnEnd = "stop"
    stop_string: str | None = None  # the stop sequence that ended it, if one did
    output_tokens: int = 0
    reasoning: str | None = None  # the reasoning before the answer (None: none given)
    reasoning_tokens: int = 0  # of output_tokens, those that reasoned


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """A streamed piece of the reasoning; all of them come before the answer's deltas."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call `index`: the first carries its id and name, later ones argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


TurnDelta = ReasoningDelta | TextDelta | ToolCallDelta


def _turn_end(out: CompletionOutput, has_tool_calls: bool) -> tuple[TurnEnd, str | None]:
    if out.finish_reason == "length":
        return "length", None
    if has_tool_calls:
        return "tool_calls", None
    stop = out.stop_reason if isinstance(out.stop_reason, str) else None
    return "stop", stop


def final_turn(
    out: CompletionOutput, plan: ToolPlan | None = None, parallel: bool | None = None
) -> ChatTurn:
    """A finished (final-kind) engine output as a turn; with a tool plan, its calls are parsed out."""
    content, calls = parse_tool_calls(out.text, plan, parallel)
    tool_calls = [
        ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    end, stop = _turn_end(out, bool(tool_calls))
    tokens = out.num_output_tokens or len(out.token_ids)
    reasoning = out.reasoning or None
    return ChatTurn(
        content or "", tool_calls, end, stop, tokens, reasoning, out.num_reasoning_tokens
    )


class TurnStream:
    """Delta engine outputs of one sample -> TurnDeltas; `turn` is the whole turn once it finished.
    With a tool plan, the streaming tool-call parser splits text from calls (joined, the deltas equal
    `final_turn` of the whole text)."""

    def __init__(self, plan: ToolPlan | None = None, parallel: bool | None = None) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, list[str]] = {}  # call index -> [id, name, arguments...]
        self.output_tokens = 0
        self.turn: ChatTurn | None = None
        self.parser = (
            ToolCallDeltas(plan, parallel) if plan is not None and plan.parse_calls else None
        )

    def _split(self, text: str, final: bool) -> list[TurnDelta]:
        if self.parser is None:
            return [TextDelta(text)] if text else []
        deltas: list[TurnDelta] = []
        for chunk in self.parser.deltas(text, final=final):
            if chunk.get("content"):
                deltas.append(TextDelta(chunk["content"]))
            for call in chunk.get("tool_calls", []):
                fn = call.get("function", {})
                deltas.append(
                    ToolCallDelta(
                        call["index"], fn.get("arguments", ""), call.get("id"), fn.get("name")
                    )
                )
        return deltas

    def feed(self, out: CompletionOutput) -> list[TurnDelta]:
        self.output_tokens = out.num_output_tokens or self.output_tokens + len(out.token_ids)
        deltas = self._split(out.text, final=out.finish_reason is not None)
        if out.reasoning:
            deltas.insert(0, ReasoningDelta(out.reasoning))
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                self.reasoning.append(d.text)
            elif isinstance(d, TextDelta):
                self.text.append(d.text)
            elif d.id is not None:
                self.calls[d.index] = [d.id, d.name or "", d.arguments]
            elif d.index in self.calls:
                self.calls[d.index].append(d.arguments)
        if out.finish_reason is not None:
            tool_calls = [
                ToolCall(parts[0], parts[1], "".join(parts[2:]))
                for _, parts in sorted(self.calls.items())
            ]
            end, stop = _turn_end(out, bool(tool_calls))
            self.turn = ChatTurn(
                "".join(self.text),
                tool_calls,
                end,
                stop,
                self.output_tokens,
                "".join(self.reasoning) or None,
                out.num_reasoning_tokens,
            )
        return deltas


class TurnEvents(FrameStream):
    """Base of the Responses and Messages event streams: delta engine outputs -> turn deltas -> the
    subclass's frames, then the frames that close the finished turn."""

    error_param = "messages"

    def __init__(self, plan: ToolPlan | None, parallel: bool | None) -> None:
        self.turns = TurnStream(plan, parallel)

    def _frames_for(self, output: RequestOutput) -> list[str]:
        raise NotImplementedError

    def _output_frames(self, index: int, output: RequestOutput) -> list[str]:
        return self._frames_for(output)

    def _turn_frames(self, turn: ChatTurn) -> list[str]:
        """The frames that end the stream of the finished `turn`."""
        raise NotImplementedError

    def _closing_frames(self) -> list[str]:
        turn = self.turns.turn
        assert turn is not None, "the engine ended a request without a finished output"
        return self._turn_frames(turn)


def chat_request(fields: dict[str, Any], names: FieldNames) -> ChatCompletionRequest:
    """Validate translated fields as a chat completions request; a 400 names the caller's field."""
    with names.renamed():
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise validation_error([dict(err) for err in e.errors()]) from None


class FieldNames:
    """Chat request field names -> the surface's (`messages[3]` -> `input[2]`), for error messages."""

    def __init__(
        self,
        fields: dict[str, str],
        message_sources: list[str],
        messages: str,
        tool_fields: dict[str, str] | None = None,
    ) -> None:
        self.fields = fields
        self.message_sources = message_sources  # chat message index -> the surface's path
        self.messages = messages  # the surface's name for the whole conversation
        # A chat tool's `function.<field>` -> the surface's flat tool field (None: chat's own).
        self.tool_fields = tool_fields

    def rename(self, param: str) -> str:
        head, sep, rest = param.partition(".")
        if head.startswith("messages["):
            index = head[len("messages[") : head.find("]")]
            if index.isdigit() and int(index) < len(self.message_sources):
                return self.message_sources[int(index)]
            return self.messages
        if head == "messages":
            return self.messages
        if (
            head.startswith("tools[")
            and self.tool_fields is not None
            and rest.startswith("function")
        ):
            field = rest.removeprefix("function").removeprefix(".")
            name, dot, deeper = field.partition(".")
            return head + ("." + self.tool_fields.get(name, name) + dot + deeper if name else "")
        return self.fields.get(head, head) + (sep + rest if head not in self.fields else "")

    @contextlib.contextmanager
    def renamed(self) -> Iterator[None]:
        try:
            yield
        except APIError as e:
            if e.param is not None:
                old, new = e.param, self.rename(e.param)
                e.param = new
                e.message = e.message.replace(old, new, 1) if old != new else e.message
            raise
