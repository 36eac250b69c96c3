"""POST /v1/responses (and GET/DELETE /v1/responses/{id}): OpenAI's Responses API over the turn pipeline.
Input items become turn messages, the output an assistant turn as `message` and `function_call`
items; streams are typed events with sequence numbers; `store` keeps responses for `previous_response_id`."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import RequestOutput
from server.cost_sheet import cost_sheet, wants_metrics
from server.errors import APIError
from server.field_map import FieldMap
from server.plan import GenerationPlan
from server.protocol_responses import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    ToolChoiceFunction,
)
from server.response_store import StoredResponse
from server.serving_chat import effort_kwargs, plan_turn
from server.sse import sse_event
from server.state import ServerState
from server.structured_outputs import JSON_OBJECT, json_schema_constraint
from server.turn import (
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallStart,
    Turn,
    TurnDelta,
    TurnEnd,
)
from server.turn_events import TurnEvents
from server.turn_request import NamedTool, Sampling, ToolSpec, TurnMessage, TurnRequest

CHAT_FIELD_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(
        f"{what} with id {response_id!r} not found.",
        status=404,
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


def _parts(content: str | list[Any]) -> str | tuple[str, ...]:
    if isinstance(content, str):
        return content
    return tuple(p.refusal if isinstance(p, Refusal) else p.text for p in content)


def input_messages(items: str | list[InputItem]) -> tuple[list[TurnMessage], list[str]]:
    """Input items -> turn messages, with the `input[...]` path each message came from."""
    if isinstance(items, str):
        return [TurnMessage("user", items)], ["input"]
    messages: list[TurnMessage] = []
    sources: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            continue  # earlier reasoning: templates leave it out of the prompt
        if isinstance(item, MessageItem):
            messages.append(TurnMessage(item.role, _parts(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, item.name, item.arguments)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                # One assistant turn: its text and the calls that followed it.
                messages[-1] = dataclasses.replace(last, tool_calls=(*last.tool_calls, call))
                continue
            messages.append(TurnMessage("assistant", "", tool_calls=(call,)))
        else:
            assert isinstance(item, FunctionCallOutputItem)
            messages.append(TurnMessage("tool", _parts(item.output), tool_call_id=item.call_id))
        sources.append(f"input[{i}]")
    return messages, sources


def responses_turn(
    req: ResponsesRequest, messages: list[TurnMessage], fields: FieldMap
) -> TurnRequest:
    """The turn this Responses request asks for (tools and text.format included)."""
    choice = req.tool_choice
    text_format = req.text.format if req.text is not None else None
    constraint = None
    if isinstance(text_format, FormatJsonObject):
        constraint = JSON_OBJECT
    elif isinstance(text_format, FormatJsonSchema):
        constraint = json_schema_constraint(text_format.schema_, fields)
    return TurnRequest(
        model=req.model,
        messages=messages,
        sampling=Sampling(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
            min_tokens=req.min_tokens,
        ),
        stream=bool(req.stream),
        max_tokens=req.max_output_tokens,
        constraint=constraint,
        tools=[ToolSpec(t.name, t.description, t.parameters, t.strict) for t in req.tools or ()],
        tool_choice=NamedTool(choice.name) if isinstance(choice, ToolChoiceFunction) else choice,
        parallel_tool_calls=req.parallel_tool_calls,
        template_kwargs=effort_kwargs(req.reasoning.effort if req.reasoning is not None else None),
        cache_salt=req.cache_salt,
    )


class _Context:
    """One Responses request: its plan, and the response object around its output."""

    def __init__(self, req: ResponsesRequest, state: ServerState) -> None:
        self.req = req
        self.state = state
        history: list[TurnMessage] = []
        if req.previous_response_id is not None:
            entry = state.responses.get(req.previous_response_id)
            if entry is None:
                raise not_found(req.previous_response_id, "previous_response_id")
            history = entry.conversation
        new, sources = input_messages(req.input)
        system = [TurnMessage("system", req.instructions)] if req.instructions else []
        self.conversation = [*history, *new]  # what a continuation starts from (no instructions)
        names = FieldMap(
            "input",
            CHAT_FIELD_NAMES,
            (*["instructions"] * len(system), *["previous_response_id"] * len(history), *sources),
            {},  # function tools are flat: tools[i].parameters
            "{where} is a function_call_output item whose call_id {id!r} matches no earlier "
            "function_call item",
            "call_id",
        )
        self.id = f"resp_{uuid.uuid4().hex}"
        turn = responses_turn(req, [*system, *self.conversation], names)
        self.plan: GenerationPlan = plan_turn(turn, state, self.id, names)
        self.created_at = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        turn: Turn | None = None,
        cached: int = 0,
    ) -> dict[str, Any]:
        req = self.req
        usage = None
        if turn is not None:
            prompt = self.plan.num_prompt_tokens
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": turn.output_tokens,
                "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
                "total_tokens": prompt + turn.output_tokens,
            }
        text_format = req.text.format if req.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.plan.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {
                "effort": req.reasoning.effort if req.reasoning is not None else None,
                "summary": _summary(req),
            },
            "safety_identifier": req.safety_identifier,
            "service_tier": "default",
            "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format is not None
                else {"type": "text"},
                "verbosity": "medium",
            },
            "tool_choice": (
                req.tool_choice.model_dump()
                if req.tool_choice is not None and not isinstance(req.tool_choice, str)
                else req.tool_choice or "auto"
            ),
            "tools": [
                {"type": "function", "description": None, "parameters": None, "strict": None}
                | t.model_dump(exclude_none=True)
                for t in req.tools or []
            ],
            "top_logprobs": 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": dict(req.metadata or {}),
        }

    def finish(self, turn: Turn, output: list[dict[str, Any]], cached: int) -> dict[str, Any]:
        """The finished response object; stored (with its conversation) unless `store` is false."""
        body = self.response(status_of(turn), output, turn, cached)
        if self.req.store is not False:
            calls = tuple(turn.tool_calls)
            assistant = TurnMessage("assistant", turn.text, None, calls, None, turn.reasoning)
            conversation = [*self.conversation, assistant]
            self.state.responses.put(StoredResponse(body, conversation))
        return body


def _summary(req: ResponsesRequest) -> str | None:
    reasoning = req.reasoning
    if reasoning is None:
        return None
    return reasoning.summary if reasoning.summary is not None else reasoning.generate_summary


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content if status != "in_progress" else [],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The reasoning before the answer: no summary, the text itself as `reasoning_text` content."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(turn: Turn) -> str:
    """A turn cut off by max_output_tokens is an incomplete response (and its last item too)."""
    return "incomplete" if turn.end == TurnEnd.LENGTH else "completed"


def output_items(turn: Turn) -> list[dict[str, Any]]:
    """A turn as output items: a message (unless the turn is only tool calls), then its function calls."""
    last = status_of(turn)
    items = []
    if turn.reasoning is not None:
        answered = bool(turn.text or turn.tool_calls)
        status = "completed" if answered else last
        items.append(_reasoning_item(_new_item_id("rs"), turn.reasoning, status))
    if turn.text or not turn.tool_calls:
        status = last if not turn.tool_calls else "completed"
        items.append(_message_item(_new_item_id("msg"), turn.text, status))
    for i, call in enumerate(turn.tool_calls):
        status = last if i == len(turn.tool_calls) - 1 else "completed"
        items.append(_call_item(_new_item_id("fc"), call.id, call.name, call.arguments, status))
    return items


async def create_response(req: ResponsesRequest, raw: Request, state: ServerState) -> Response:
    ctx = _Context(req, state)

    def finish(finals: list[RequestOutput]) -> Response:
        final = finals[0]
        turn = ctx.plan.final_turn(final.outputs[0])
        body = ctx.finish(turn, output_items(turn), final.num_cached_tokens)
        if wants_metrics(req.return_metrics, raw):
            body = {**body, "metrics": cost_sheet(finals)}  # not kept in the response store
        return JSONResponse(body)

    stream = _ResponseStream(ctx).frames if req.stream else None
    return await ctx.plan.respond(raw, stream, finish)


def retrieve_response(response_id: str, state: ServerState) -> JSONResponse:
    entry = state.responses.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return JSONResponse(entry.response)


def delete_response(response_id: str, state: ServerState) -> JSONResponse:
    if not state.responses.delete(response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class _ResponseStream(TurnEvents):
    """Turn events -> the Responses API's typed events, numbered by `sequence_number`."""

    def __init__(self, ctx: _Context) -> None:
        super().__init__(ctx.plan)
        self.ctx = ctx
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items, finished or open (the last one)
        self.open_text: list[str] | None = None  # text of the open message item
        self.open_reasoning: list[str] | None = None  # text of the open reasoning item
        self.open_args: list[str] | None = None  # arguments of the open function_call item

    def _event(self, kind: str, **fields: Any) -> str:
        frame = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return frame

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open_message(self) -> list[str]:
        self.items.append(_message_item(_new_item_id("msg"), "", "in_progress"))
        self.open_text = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event(
                "response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1]
            ),
            self._event("response.content_part.added", **self._where(), content_index=0, part=part),
        ]

    def _open_reasoning(self) -> list[str]:
        self.items.append(_reasoning_item(_new_item_id("rs"), "", "in_progress"))
        self.open_reasoning = []
        part = {"type": "reasoning_text", "text": ""}
        return [
            self._event(
                "response.output_item.added", output_index=len(self.items) - 1, item=self.items[-1]
            ),
            self._event("response.content_part.added", **self._where(), content_index=0, part=part),
        ]

    def _close_open_item(self, status: str) -> list[str]:
        frames = []
        if self.open_reasoning is not None:
            text = "".join(self.open_reasoning)
            item = _reasoning_item(self.items[-1]["id"], text, status)
            part = item["content"][0]
            frames += [
                self._event(
                    "response.reasoning_text.done", **self._where(), content_index=0, text=text
                ),
                self._event(
                    "response.content_part.done", **self._where(), content_index=0, part=part
                ),
            ]
            self.open_reasoning = None
        elif self.open_text is not None:
            text = "".join(self.open_text)
            item = _message_item(self.items[-1]["id"], text, status)
            part = item["content"][0]
            frames += [
                self._event(
                    "response.output_text.done",
                    **self._where(),
                    content_index=0,
                    text=text,
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", **self._where(), content_index=0, part=part
                ),
            ]
            self.open_text = None
        elif self.open_args is not None:
            item = dict(self.items[-1], arguments="".join(self.open_args), status=status)
            frames.append(
                self._event(
                    "response.function_call_arguments.done",
                    **self._where(),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            self.open_args = None
        else:
            return []
        self.items[-1] = item
        frames.append(
            self._event("response.output_item.done", output_index=len(self.items) - 1, item=item)
        )
        return frames

    def _delta_frames(self, delta: TurnDelta) -> list[str]:
        if isinstance(delta, ReasoningDelta):
            frames = []
            if self.open_reasoning is None:
                frames += self._close_open_item("completed") + self._open_reasoning()
            assert self.open_reasoning is not None
            self.open_reasoning.append(delta.text)
            frames.append(
                self._event(
                    "response.reasoning_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=delta.text,
                )
            )
            return frames
        if isinstance(delta, TextDelta):
            frames = []
            if self.open_text is None:
                frames += self._close_open_item("completed") + self._open_message()
            assert self.open_text is not None
            self.open_text.append(delta.text)
            frames.append(
                self._event(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=delta.text,
                    logprobs=[],
                )
            )
            return frames
        if isinstance(delta, ToolCallStart):  # a new call begins
            frames = self._close_open_item("completed")
            item = _call_item(_new_item_id("fc"), delta.id, delta.name, "", "in_progress")
            self.items.append(item)
            self.open_args = []
            frames.append(
                self._event(
                    "response.output_item.added", output_index=len(self.items) - 1, item=item
                )
            )
            return frames
        if self.open_args is None:
            return []
        self.open_args.append(delta.text)
        return [
            self._event("response.function_call_arguments.delta", **self._where(), delta=delta.text)
        ]

    def _opening_frames(self, first: RequestOutput | None) -> list[str]:
        started = self.ctx.response("in_progress", [])
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def _error_frame(self, error: APIError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def _turn_frames(self, turn: Turn) -> list[str]:
        status = status_of(turn)
        frames = []
        if all(item["type"] == "reasoning" for item in self.items):
            # No text and no calls: still one (empty) message, as when not streamed.
            frames += self._close_open_item(status) + self._open_message()
        frames += self._close_open_item(status)
        body = self.ctx.finish(turn, self.items, self.cached)
        return [*frames, self._event(f"response.{body['status']}", response=body)]
