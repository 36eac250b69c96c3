"""Tool calling for the turn of every chat-like API surface (chat completions, Responses,
Messages): request checks (400s naming the surface's field), the tool plan, and chat history ->
template messages. Engine text -> tool calls is server/turn.py's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import StructuredOutputs
from engine.text import ToolPlan, plan_tool_use, render_messages
from server.errors import invalid_request
from server.field_map import FieldMap
from server.structured_outputs import check_json_schema
from server.turn_request import NamedTool, ToolSpec, TurnMessage, TurnRequest


def check_tool_messages(messages: Sequence[TurnMessage], fields: FieldMap) -> None:
    """Each tool message answers a call of an earlier assistant message (OpenAI's rule)."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.tool_calls:
            call_ids.add(call.id)
        if m.role == "tool" and m.tool_call_id not in call_ids:
            where = fields.name(f"messages[{i}]")
            message = fields.tool_answer.format(where=where, id=m.tool_call_id)
            raise invalid_request(message, f"{where}.{fields.tool_answer_id}")


def tool_plan(
    req: TurnRequest,
    chat_template: str | None,
    parser_name: str,
    answer: StructuredOutputs | None,
    fields: FieldMap,
    token_ids: dict[str, int] | None = None,
) -> ToolPlan | None:
    """Validate tools/tool_choice and plan them; None when the request uses no tools. `answer`: the
    request's response_format/structured_outputs constraint, which a reply that calls no tool
    follows (the plan's constraint then covers both)."""
    tools = req.tools
    choice = req.tool_choice
    if choice is not None and not tools and choice != "none":
        raise invalid_request("tool_choice is only allowed when tools are given", "tool_choice")
    if not tools:
        return None
    names: set[str] = set()
    for i, fn in enumerate(tools):
        if fn.name in names:
            raise invalid_request(
                f"tools has two functions named {fn.name!r}",
                fields.name(f"tools[{i}].function.name"),
            )
        names.add(fn.name)
        if fn.parameters is not None:
            check_json_schema(fn.parameters, fields.name(f"tools[{i}].function.parameters"))
    if isinstance(choice, NamedTool) and choice.name not in names:
        raise invalid_request(
            f"tool_choice names the function {choice.name!r}, which is not in tools",
            "tool_choice",
        )
    tool_dicts = [{"type": "function", "function": _function_dict(t)} for t in tools]
    choice_value: Any = choice
    if isinstance(choice, NamedTool):
        choice_value = {"type": "function", "function": {"name": choice.name}}
    try:
        return plan_tool_use(
            tool_dicts,
            choice_value,
            req.parallel_tool_calls,
            chat_template,
            parser_name,
            answer=answer,
            token_ids=token_ids,
        )
    except ValueError as e:
        raise invalid_request(str(e), "tools") from None


def _function_dict(tool: ToolSpec) -> dict[str, Any]:
    """A tool as the `function` of OpenAI's tool entry (what templates and tool plans read)."""
    fn: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        fn["description"] = tool.description
    if tool.parameters is not None:
        fn["parameters"] = dict(tool.parameters)
    if tool.strict is not None:
        fn["strict"] = tool.strict
    return fn


def message_dicts(messages: Sequence[TurnMessage]) -> list[dict[str, Any]]:
    """Turn messages -> the OpenAI-shaped dicts chat templates render, with text content."""
    out = []
    for m in messages:
        entry: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text,
        }
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [c.chat_dict() for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.reasoning is not None and m.role == "assistant":
            entry["reasoning_content"] = m.reasoning
        out.append(entry)
    return out


def template_messages(
    messages: Sequence[TurnMessage], plan: ToolPlan | None
) -> list[dict[str, Any]]:
    """What the chat template renders: tool history in the template's or the prompt format."""
    rendered = render_messages(message_dicts(messages), plan)
    for m in rendered:
        if m.get("content") is None:
            m["content"] = ""
    return rendered
