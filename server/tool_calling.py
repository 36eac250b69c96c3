"""Tool calling for the chat-shaped plan of every API surface (chat completions, Responses,
Messages): request checks (400s naming the surface's field), the tool plan, and chat history ->
template messages. Engine text -> tool calls is server/turn.py's."""

from __future__ import annotations

from typing import Any

from engine import StructuredOutputs
from engine.text import ToolPlan, plan_tool_use, render_messages
from server.errors import invalid_request
from server.field_map import FieldMap
from server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from server.structured_outputs import check_json_schema


def check_tool_messages(messages: list[ChatMessage], fields: FieldMap) -> None:
    """Each tool message answers a call of an earlier assistant message (OpenAI's rule)."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.tool_calls or []:
            call_ids.add(call.id)
        if m.role == "tool" and m.tool_call_id not in call_ids:
            where = fields.name(f"messages[{i}]")
            param = fields.name(f"messages[{i}].tool_call_id")
            raise invalid_request(
                f"{where} is a tool message answering tool_call_id {m.tool_call_id!r}, but no "
                "earlier assistant message has a tool call with that id",
                param,
            )


def tool_plan(
    req: ChatCompletionRequest,
    chat_template: str | None,
    parser_name: str,
    answer: StructuredOutputs | None,
    fields: FieldMap,
    token_ids: dict[str, int] | None = None,
) -> ToolPlan | None:
    """Validate tools/tool_choice and plan them; None when the request uses no tools. `answer`: the
    request's response_format/structured_outputs constraint, which a reply that calls no tool
    follows (the plan's constraint then covers both)."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is not None and not tools and choice != "none":
        raise invalid_request("tool_choice is only allowed when tools are given", "tool_choice")
    if not tools:
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in names:
            raise invalid_request(
                f"tools has two functions named {fn.name!r}",
                fields.name(f"tools[{i}].function.name"),
            )
        names.add(fn.name)
        if fn.parameters is not None:
            check_json_schema(fn.parameters, fields.name(f"tools[{i}].function.parameters"))
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise invalid_request(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools",
            "tool_choice",
        )
    tool_dicts = [
        {"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools
    ]
    choice_value: Any = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
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


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """API messages -> OpenAI-shaped dicts with text content."""
    out = []
    for m in messages:
        if m.content is None:
            content = None
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "\n".join(p.text for p in m.content)
        entry: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and m.role == "assistant":
            entry["reasoning_content"] = reasoning
        out.append(entry)
    return out


def template_messages(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """What the chat template renders: tool history in the template's or the prompt format."""
    rendered = render_messages(message_dicts(messages), plan)
    for m in rendered:
        if m.get("content") is None:
            m["content"] = ""
    return rendered
