"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the turn pipeline.
Blocks become turn messages (tool_use -> tool calls, tool_result -> tool messages), the output an
assistant turn as text and tool_use blocks; streams are Anthropic's typed events; errors its envelope."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pydantic_core
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import RequestOutput
from server.cost_sheet import cost_sheet, wants_metrics
from server.errors import APIError, invalid_request
from server.field_map import FieldMap
from server.plan import GenerationPlan
from server.protocol_messages import (
    CountTokensRequest,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.serving_chat import effort_kwargs, plan_turn
from server.sse import sse_event
from server.state import ServerState
from server.structured_outputs import json_schema_constraint
from server.turn import (
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStart,
    Turn,
    TurnDelta,
    TurnEnd,
)
from server.turn_events import TurnEvents
from server.turn_request import (
    NamedTool,
    Sampling,
    ToolChoice,
    ToolSpec,
    TurnMessage,
    TurnRequest,
)

CHAT_FIELD_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
}
TOOL_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


def _text(blocks: list[TextBlock]) -> tuple[str, ...]:
    return tuple(b.text for b in blocks)


def chat_messages(req: MessagesInput) -> tuple[list[TurnMessage], list[str]]:
    """system + messages -> turn messages, with the request path each one came from."""
    messages: list[TurnMessage] = []
    sources: list[str] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text(req.system)
        messages.append(TurnMessage("system", system))
        sources.append("system")
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            messages.append(TurnMessage(message.role, message.content))
            sources.append(where)
            continue
        blocks = message.content
        if message.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise invalid_request(
                    f"{where}.content: tool_result blocks belong in user messages", where
                )
            text = _text([b for b in blocks if isinstance(b, TextBlock)])
            calls = tuple(
                ToolCall(b.id, b.name, json.dumps(b.input))
                for b in blocks
                if isinstance(b, ToolUseBlock)
            )
            messages.append(TurnMessage("assistant", text, tool_calls=calls))
            sources.append(where)
            continue
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise invalid_request(
                f"{where}.content: tool_use blocks belong in assistant messages", where
            )
        run: list[TextBlock] = []
        for j, block in enumerate([*blocks, None]):
            if isinstance(block, TextBlock):
                run.append(block)
                continue
            if run:  # a run of text blocks is one user message
                messages.append(TurnMessage("user", _text(run)))
                sources.append(where)
                run = []
            if isinstance(block, ToolResultBlock):
                content = block.content if block.content is not None else ""
                result = content if isinstance(content, str) else _text(content)
                messages.append(TurnMessage("tool", result, tool_call_id=block.tool_use_id))
                sources.append(f"{where}.content[{j}]")  # the block: errors name it
    if req.messages[-1].role == "assistant":
        last = f"messages[{len(req.messages) - 1}]"
        raise invalid_request(
            f"{last}: continuing a final assistant message (prefill) is not supported; "
            "end the conversation with a user message",
            last,
        )
    return messages, sources


def messages_turn(req: MessagesInput, messages: list[TurnMessage], fields: FieldMap) -> TurnRequest:
    """The turn these Messages fields ask for (tools, tool_choice and the output format included)."""
    effort = req.output_config.effort if req.output_config is not None else None
    template: dict[str, Any] = effort_kwargs(effort)
    if req.thinking is not None:
        template["enable_thinking"] = req.thinking.type != "disabled"
    sampling = Sampling()
    max_tokens: int | None = None
    cache_salt: str | None = None
    stream = False
    if isinstance(req, MessagesRequest):
        sampling = Sampling(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=list(req.stop_sequences or ()),
        )
        max_tokens, stream, cache_salt = req.max_tokens, bool(req.stream), req.cache_salt
    schema = req.json_schema()
    choice = req.tool_choice
    tool_choice: ToolChoice | None = None
    parallel = None
    if choice is not None:
        if choice.type == "tool":
            tool_choice = NamedTool(choice.name)
        else:
            tool_choice = TOOL_CHOICES[choice.type]
        if getattr(choice, "disable_parallel_tool_use", None):
            parallel = False
    return TurnRequest(
        model=req.model,
        messages=messages,
        sampling=sampling,
        stream=stream,
        max_tokens=max_tokens,
        constraint=json_schema_constraint(schema, fields) if schema is not None else None,
        tools=[ToolSpec(t.name, t.description, t.input_schema) for t in req.tools or ()],
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        template_kwargs=template,
        cache_salt=cache_salt,
    )


def field_map(sources: list[str]) -> FieldMap:
    """Chat's names -> Messages' (`messages[i]` of the chat request came from `sources[i]`)."""
    return FieldMap(
        "messages",
        CHAT_FIELD_NAMES,
        tuple(sources),
        {"parameters": "input_schema"},
        "{where}.tool_use_id: this tool_result block answers {id!r}, but no earlier tool_use "
        "block has that id",
        "tool_use_id",
        over_length="max_tokens",
    )


def _prepare(req: MessagesInput, state: ServerState, request_id: str) -> GenerationPlan:
    messages, sources = chat_messages(req)
    fields = field_map(sources)
    return plan_turn(messages_turn(req, messages, fields), state, request_id, fields)


def stop_reason(turn: Turn) -> str:
    if turn.end == TurnEnd.LENGTH:
        return "max_tokens"
    if turn.end == TurnEnd.TOOL_CALLS:
        return "tool_use"
    return "stop_sequence" if turn.stop_string is not None else "end_turn"


def _tool_input(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as an object. Arguments cut off by max_tokens read as the anthropic
    SDK reads a streamed tool_use (jiter's partial mode): an unfinished string is left out, open
    arrays and objects keep what they hold, so `create` and `stream(...).get_final_message()` agree."""
    try:
        value = pydantic_core.from_json(call.arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic spells one (`toolu_...`; the turn pipeline's are `call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(turn: Turn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.reasoning is not None:  # unsigned: the signature is empty
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.text:
        blocks.append({"type": "text", "text": turn.text})
    for call in turn.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.name,
                "input": _tool_input(call),
            }
        )
    return blocks


def _usage(plan: GenerationPlan, cached: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens is the whole prompt."""
    return {
        "input_tokens": plan.num_prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def _message(plan: GenerationPlan, content: list[dict[str, Any]], usage: dict[str, Any]) -> dict:
    return {
        "id": plan.request_id,
        "type": "message",
        "role": "assistant",
        "model": plan.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


async def create_message(req: MessagesRequest, raw: Request, state: ServerState) -> Response:
    plan = _prepare(req, state, f"msg_{uuid.uuid4().hex}")

    def finish(finals: list[RequestOutput]) -> Response:
        final = finals[0]
        turn = plan.final_turn(final.outputs[0])
        usage = _usage(plan, final.num_cached_tokens, turn.output_tokens)
        body = _message(plan, content_blocks(turn), usage)
        body |= {"stop_reason": stop_reason(turn), "stop_sequence": turn.stop_string}
        if wants_metrics(req.return_metrics, raw):
            body["metrics"] = cost_sheet(finals)
        return JSONResponse(body)

    stream = _MessageStream(plan).frames if req.stream else None
    return await plan.respond(raw, stream, finish)


def count_tokens(req: CountTokensRequest, state: ServerState) -> dict[str, int]:
    """The prompt tokens a Messages request with these fields would have."""
    plan = _prepare(req, state, f"count-{uuid.uuid4().hex}")
    return {"input_tokens": plan.num_prompt_tokens}


class _MessageStream(TurnEvents):
    """Delta engine outputs -> message_start, content blocks (start, deltas, stop), message_delta, stop."""

    def __init__(self, plan: GenerationPlan) -> None:
        super().__init__(plan)
        self.index = -1  # the last content block started, -1 before the first
        self.open = False  # whether that block is still open
        self.block_kind = "text"

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return sse_event(kind, {"type": kind, **fields})

    def _start_block(self, block: dict[str, Any]) -> list[str]:
        frames = self._stop_block()
        self.index += 1
        self.open = True
        return frames + [self._event("content_block_start", index=self.index, content_block=block)]

    def _stop_block(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        return [self._event("content_block_stop", index=self.index)]

    def _delta_frames(self, delta: TurnDelta) -> list[str]:
        frames: list[str] = []
        if isinstance(delta, ReasoningDelta):
            if not self.open or self.block_kind != "thinking":
                frames += self._start_block({"type": "thinking", "thinking": "", "signature": ""})
                self.block_kind = "thinking"
            frames.append(
                self._event(
                    "content_block_delta",
                    index=self.index,
                    delta={"type": "thinking_delta", "thinking": delta.text},
                )
            )
        elif isinstance(delta, TextDelta):
            if not self.open or self.block_kind != "text":
                frames += self._start_block({"type": "text", "text": ""})
                self.block_kind = "text"
            frames.append(
                self._event(
                    "content_block_delta",
                    index=self.index,
                    delta={"type": "text_delta", "text": delta.text},
                )
            )
        elif isinstance(delta, ToolCallStart):
            block = {
                "type": "tool_use",
                "id": tool_use_id(delta.id),
                "name": delta.name,
                "input": {},
            }
            frames += self._start_block(block)
            self.block_kind = "tool_use"
        elif isinstance(delta, ToolCallArguments) and self.open and self.block_kind == "tool_use":
            frames.append(
                self._event(
                    "content_block_delta",
                    index=self.index,
                    delta={"type": "input_json_delta", "partial_json": delta.text},
                )
            )
        return frames

    def _opening_frames(self, first: RequestOutput | None) -> list[str]:
        self.cached = first.num_cached_tokens if first is not None else 0
        start = _message(self.plan, [], _usage(self.plan, self.cached, 0))
        return [self._event("message_start", message=start), self._event("ping")]

    def _error_frame(self, error: APIError) -> str:
        return sse_event("error", error.anthropic_body())

    def _turn_frames(self, turn: Turn) -> list[str]:
        delta = {"stop_reason": stop_reason(turn), "stop_sequence": turn.stop_string}
        usage = _usage(self.plan, self.cached, turn.output_tokens)
        return [
            *self._stop_block(),
            self._event("message_delta", delta=delta, usage=usage),
            self._event("message_stop"),
        ]
