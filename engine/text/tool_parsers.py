"""Tool-call formats: per format, the grammar that forces calls and the parser that turns generated
text (whole, or a growing prefix while streaming) into content plus tool calls.

Formats: `hermes` (Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks)
and `llama3_json` (Llama 3: the reply is `{"name": ..., "parameters": {...}}`, calls joined by ";").
A parse of a prefix only ever grows (content, call names, argument text), so streamed deltas joined
equal the parse of the whole text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.text.schema_regex import ecma_patterns

_WS = " \t\r\n"
# Compact JSON for forced calls, as json.dumps writes it (a small model given free whitespace pads).
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCallDraft:
    name: str | None  # None until the name string is complete
    # Raw JSON text of the arguments so far: "{}" once final if a whole call gave none, and a
    # prefix (maybe "") if the output was cut off inside the call.
    arguments: str


@dataclass
class ParsedToolOutput:
    content: str | None  # None when the model only called tools (or said nothing)
    tool_calls: list[ToolCallDraft] = field(default_factory=list)


# -- JSON scanning (tolerant of a cut-off prefix) -------------------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at text[i] == '"', or None if cut off."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _scan_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if cut off."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


@dataclass
class _ObjectScan:
    fields: dict[str, tuple[int, int | None]]  # key -> (value start, value end or None)
    end: int | None  # end of the object, None if cut off
    ok: bool  # False: not a JSON object at all


def _scan_object(text: str, i: int) -> _ObjectScan:
    """The top-level fields of the JSON object at text[i] (possibly a cut-off prefix)."""
    fields: dict[str, tuple[int, int | None]] = {}
    if i >= len(text) or text[i] != "{":
        return _ObjectScan(fields, None, i >= len(text))
    i = _skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return _ObjectScan(fields, i + 1, True)
        if text[i] != '"':
            return _ObjectScan(fields, None, False)
        key_end = _scan_string(text, i)
        if key_end is None:
            break
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return _ObjectScan(fields, None, False)
        i = _skip_ws(text, key_end)
        if i >= len(text):
            break
        if text[i] != ":":
            return _ObjectScan(fields, None, False)
        start = _skip_ws(text, i + 1)
        end = _scan_value(text, start)
        if start < len(text):
            fields[key] = (start, end)
        if end is None:
            break
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "}":
            return _ObjectScan(fields, None, False)
    return _ObjectScan(fields, None, True)


def _draft_from_object(
    text: str, start: int, args_keys: tuple[str, ...], final: bool
) -> tuple[ToolCallDraft | None, int | None, bool]:
    """(call, end of the object, looks like a call) for the object at text[start]."""
    scan = _scan_object(text, start)
    if not scan.ok:
        return None, None, False
    name = None
    if "name" in scan.fields:
        s, e = scan.fields["name"]
        if e is not None and text[s] == '"':
            try:
                name = json.loads(text[s:e])
            except ValueError:
                return None, scan.end, False
    arguments = ""
    for key in args_keys:
        if key in scan.fields:
            s, e = scan.fields[key]
            arguments = text[s : e if e is not None else len(text)]
            break
    if final and not arguments and scan.end is not None:
        arguments = "{}"  # a whole call that gave no arguments; a cut-off one keeps what it has
    return ToolCallDraft(name, arguments), scan.end, True


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _content(text: str, has_calls: bool) -> str | None:
    if has_calls and not text.strip():
        return None
    return text or None


# -- formats -----------------------------------------------------------------------------------------
class ToolParser:
    """One tool-call format: `parse` for output, `grammar` to force calls in that format.

    `tool_names`, when given, are the only function names a call may have: other JSON that merely
    looks like a call is content (it matters where a call has no markup around it).
    """

    name = ""
    args_key = "arguments"
    free_text = ""  # Lark regex of a text reply that cannot start a call
    many_calls = "call+"  # Lark of several calls in a row

    def __init__(
        self, tool_names: frozenset[str] | None = None, token_ids: Mapping[str, int] | None = None
    ) -> None:
        self.tool_names = tool_names
        # The tokenizer's added tokens (text -> id): a tag that is one (Qwen3's `<tool_call>`) is
        # special to llguidance, so a grammar takes it as that token or as text.
        self.token_ids = dict(token_ids or {})

    def literal(self, text: str) -> str:
        """Lark for `text` written out, or as its added token when it is one."""
        token = self.token_ids.get(text)
        return json.dumps(text) if token is None else f"({json.dumps(text)} | <[{token}]>)"

    def parse(self, text: str, final: bool = True) -> ParsedToolOutput:
        raise NotImplementedError

    def call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        """JSON schema of one call object of `tool` ({"name", "description", "parameters"})."""
        return call_object_schema(tool, self.args_key)

    def call_rule(self, tool: dict[str, Any]) -> str:
        """Lark of one call of `tool`."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], parallel: bool, text: str | None) -> str:
        """Lark grammar (llguidance dialect) of replies: calls of `tools` (at most one unless
        `parallel`), or, when `text` (a Lark expression: `self.free_text`, a sub-grammar) is
        given, a reply that matches it instead."""
        rules = [f"call_{i}: {self.call_rule(t)}" for i, t in enumerate(tools)]
        call = "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))
        calls = "calls: " + (self.many_calls if parallel else "call")
        start = "start: text | calls" if text is not None else "start: calls"
        lines = [start, calls, call, *rules]
        if text is not None:
            lines.append(f"text: {text}")
        return "\n".join(lines) + "\n"


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, one block per call."""

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    free_text = r"/[^<\s][\s\S]*/"

    def parse(self, text: str, final: bool = True) -> ParsedToolOutput:
        pos = text.find(self.start)
        if pos < 0:
            if final:
                return ParsedToolOutput(text or None)
            safe = text[: len(text) - _held_back(text, self.start)]
            return ParsedToolOutput(safe if safe.strip() else None)
        calls: list[ToolCallDraft] = []
        i = pos
        while i >= 0:
            body = _skip_ws(text, i + len(self.start))
            draft, end, is_call = _draft_from_object(text, body, ("arguments", "parameters"), final)
            if not is_call or draft is None:
                break
            if draft.name is None:
                if not calls and final:  # the first block never became a call: it is text
                    return ParsedToolOutput(text or None)
                break
            calls.append(draft)
            if end is None:
                break
            i = text.find(self.start, end)
        if not calls and final:
            return ParsedToolOutput(text or None)
        return ParsedToolOutput(_content(text[:pos], True), calls)

    def call_rule(self, tool: dict[str, Any]) -> str:
        schema = json.dumps(self.call_schema(tool))
        return f'{self.literal(self.start)} "\\n" %json {schema} "\\n" {self.literal(self.end)}'


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}` (an optional
    `<|python_tag|>` first), several calls joined by ";"."""

    name = "llama3_json"
    args_key = "parameters"
    tag = "<|python_tag|>"
    free_text = r"/[^{<\s][\s\S]*/"
    many_calls = 'call ("; " call)*'

    def parse(self, text: str, final: bool = True) -> ParsedToolOutput:
        i = _skip_ws(text, 0)
        if text.startswith(self.tag, i):
            i = _skip_ws(text, i + len(self.tag))
        elif not final and self.tag.startswith(text[i:]) and i < len(text):
            return ParsedToolOutput(None)  # maybe the tag: hold back
        if i >= len(text):
            return ParsedToolOutput(text if final and text.strip() else None)
        if text[i] != "{":
            return ParsedToolOutput(text or None)
        calls: list[ToolCallDraft] = []
        while i < len(text):
            draft, end, is_call = _draft_from_object(text, i, ("parameters", "arguments"), final)
            if not is_call or draft is None or draft.name is None:
                break
            if self.tool_names is not None and draft.name not in self.tool_names:
                break  # JSON with a "name" that no tool has: an answer, not a call
            calls.append(draft)
            if end is None:
                break
            i = _skip_ws(text, end)
            if i >= len(text) or text[i] != ";":
                break
            i = _skip_ws(text, i + 1)
        if not calls:
            return ParsedToolOutput(text if final and text else None)
        return ParsedToolOutput(None, calls)

    def call_rule(self, tool: dict[str, Any]) -> str:
        return f"%json {json.dumps(self.call_schema(tool))}"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(
    name: str,
    tool_names: frozenset[str] | None = None,
    token_ids: Mapping[str, int] | None = None,
) -> ToolParser:
    try:
        return TOOL_PARSERS[name](tool_names, token_ids)
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}"
        ) from None


def detect_tool_parser(chat_template: str | None) -> tuple[str, bool]:
    """(parser name, whether the template renders `tools` itself) for a chat template. Templates
    without tool support get tools described in the prompt and the Hermes format."""
    template = chat_template or ""
    native = "tools" in template
    if "<tool_call>" in template:
        return HermesToolParser.name, native
    if "<|python_tag|>" in template or ("ipython" in template and native):
        return Llama3JsonToolParser.name, native
    return HermesToolParser.name, False


def call_object_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    """{"name": <const>, args_key: <parameters>}: the parameters' own `$defs`/`definitions` move to
    the root and its other local `$ref`s are re-pointed, so references still resolve."""
    params = ecma_patterns(tool.get("parameters") or {"type": "object", "properties": {}})
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    params.pop("$schema", None)
    params.pop("$id", None)
    params = _repoint_refs(params, f"#/properties/{args_key}")
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
        "x-guidance": _COMPACT,
    }
    schema.update(defs)
    return schema


def _repoint_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        out = {k: _repoint_refs(v, prefix) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            if not ref.startswith(("#/$defs/", "#/definitions/")):
                out["$ref"] = prefix + ref[1:]
        return out
    if isinstance(node, list):
        return [_repoint_refs(v, prefix) for v in node]
    return node


# -- streaming ---------------------------------------------------------------------------------------
@dataclass
class ToolStreamDelta:
    content: str = ""
    # (call index, name when the call starts else None, new argument text)
    calls: list[tuple[int, str | None, str]] = field(default_factory=list)


class ToolCallStreamer:
    """Feeds text deltas; returns what became certain: content, new calls, argument fragments."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent_args: list[int] = []  # per started call: argument characters sent

    def feed(self, delta: str, final: bool = False) -> ToolStreamDelta:
        self.text += delta
        parsed = self.parser.parse(self.text, final=final)
        out = ToolStreamDelta()
        content = parsed.content or ""
        if len(content) > self.sent_content:
            out.content = content[self.sent_content :]
            self.sent_content = len(content)
        for index, call in enumerate(parsed.tool_calls):
            if call.name is None:
                break
            if index == len(self.sent_args):
                self.sent_args.append(0)
                out.calls.append((index, call.name, call.arguments))
            else:
                fragment = call.arguments[self.sent_args[index] :]
                if fragment:
                    out.calls.append((index, None, fragment))
            self.sent_args[index] = len(call.arguments)
        return out

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_args)
