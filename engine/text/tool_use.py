"""Tool use over any chat template: tools + tool_choice (+ the answer format a reply without calls must
follow) -> a plan (tools for the template or a prompt description, the grammar of calls or that answer,
the parser), and tool-call history rendered as the template (or the prompt format) expects. Plain
dicts in OpenAI's shapes; no API types.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import ANSWER_GRAMMAR, StructuredOutputs
from engine.text.tool_parsers import ToolParser, detect_tool_parser, get_tool_parser

ToolChoice = str | dict[str, Any]  # "none" | "auto" | "required" | {"type": "function", ...}


@dataclass
class ToolPlan:
    parser: ToolParser
    native: bool  # the chat template renders `tools` (else they are described in a system message)
    template_tools: list[dict[str, Any]] | None  # for the template's `tools` variable
    system_prompt: str | None  # the tools' description when the template cannot render them
    constraint: StructuredOutputs | None  # the grammar of the reply, None when unconstrained
    parse_calls: bool  # parse the output into tool calls (False for tool_choice "none")


def plan_tool_use(
    tools: list[dict[str, Any]],
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    chat_template: str | None,
    parser_name: str = "auto",
    source: str = "tools",
    answer: StructuredOutputs | None = None,
    token_ids: Mapping[str, int] | None = None,
) -> ToolPlan:
    """`tools` are OpenAI function tools ({"type": "function", "function": {...}}), already
    validated. `parser_name` "auto" picks the format from the chat template. `answer` constrains a
    reply that is not a call (response_format): under "auto" the grammar allows calls or that
    answer, under "none" only the answer; "required" and a named tool allow only calls.
    `token_ids`: the tokenizer's added tokens, which the format's tags may be."""
    detected, native = detect_tool_parser(chat_template)
    functions = [t["function"] for t in tools]
    names = frozenset(f["name"] for f in functions)
    parser = get_tool_parser(detected if parser_name == "auto" else parser_name, names, token_ids)
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    parallel = parallel_tool_calls is not False
    if choice == "none" or not tools:
        return ToolPlan(parser, native, None, None, answer, False)
    forced: list[dict[str, Any]] = functions
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        forced = [f for f in functions if f["name"] == name]
        assert forced, "tool_choice names a tool that is not in tools (validated by the caller)"
    system_prompt = None if native else describe_tools(functions, choice, parallel, answer)
    plan = ToolPlan(parser, native, tools if native else None, system_prompt, None, True)
    if choice != "auto":
        plan.constraint = StructuredOutputs(
            grammar=parser.grammar(forced, parallel, None), source=source
        )
    elif answer is not None:
        grammar = parser.grammar(forced, parallel, f"@{ANSWER_GRAMMAR}")
        plan.constraint = StructuredOutputs(grammar=grammar, answer=answer, source=source)
    elif not native:
        # Native formats are left free under "auto" (the model was trained on them); the prompt
        # format is constrained so that a call, when the model makes one, always parses.
        grammar = parser.grammar(forced, parallel, parser.free_text)
        plan.constraint = StructuredOutputs(grammar=grammar, source=source)
    return plan


def describe_tools(
    functions: list[dict[str, Any]],
    choice: ToolChoice,
    parallel: bool,
    answer: StructuredOutputs | None = None,
) -> str:
    """A Hermes-style system prompt listing the functions, for templates without tool support; under
    "auto" it says what an answer that calls no function looks like."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    if isinstance(choice, dict):
        rule = f"You must call the function {choice['function']['name']}."
    elif choice == "required":
        rule = "You must call one of these functions."
    elif answer is None:
        rule = "Call a function only when it helps; otherwise answer the user directly in text."
    else:
        rule = (
            "Call a function only when you need its result; otherwise, or once the function results "
            f"you need are in the conversation, answer the user directly {_answer_form(answer)}."
        )
    many = "one <tool_call></tool_call> block per call" if parallel else "one block"
    return (
        "You may call functions. Their signatures, with JSON schemas of their parameters:\n"
        f"<tools>\n{listed}\n</tools>\n"
        f"To call a function, reply with {many}, each holding a JSON object with the function's "
        'name and arguments:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
        f"</tool_call>\n{rule}"
    )


def _answer_form(answer: StructuredOutputs) -> str:
    if answer.json is not None:
        return f"with a JSON value matching this JSON schema: {answer.json}"
    if answer.json_object:
        return "with a JSON object"
    return "in the required format"


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Chat messages (OpenAI dicts, content already text) for the template: tool-call history as
    the template expects it, or in the prompt format when it cannot render tools."""
    native = plan.native if plan is not None else False
    out: list[dict[str, Any]] = []
    for m in messages:
        if native:
            out.append(_native_message(m))
        else:
            _append_prompt_format(out, m)
    if plan is not None and plan.system_prompt:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{plan.system_prompt}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_prompt})
    return [{k: v for k, v in m.items() if not k.startswith("_")} for m in out]


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return m
    calls = []
    for call in m["tool_calls"]:
        fn = call["function"]
        calls.append(
            {
                "id": call.get("id"),
                "type": "function",
                # Templates read arguments as a mapping (`| tojson`, `.items()`).
                "function": {"name": fn["name"], "arguments": _arguments_value(fn["arguments"])},
            }
        )
    return {**m, "content": m.get("content") or "", "tool_calls": calls}


def _append_prompt_format(out: list[dict[str, Any]], m: dict[str, Any]) -> None:
    role = m["role"]
    if role == "assistant" and m.get("tool_calls"):
        blocks = [
            "<tool_call>\n"
            + json.dumps(
                {
                    "name": c["function"]["name"],
                    "arguments": _arguments_value(c["function"]["arguments"]),
                }
            )
            + "\n</tool_call>"
            for c in m["tool_calls"]
        ]
        calls = "".join(blocks)  # adjacent blocks, as the forcing grammar writes them
        text = f"{m['content']}\n{calls}" if m.get("content") else calls
        out.append({"role": "assistant", "content": text})
        return
    if role == "tool":
        response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        if out and out[-1]["role"] == "user" and out[-1].get("_tool_responses"):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
        else:
            out.append({"role": "user", "content": response, "_tool_responses": True})
        return
    out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
