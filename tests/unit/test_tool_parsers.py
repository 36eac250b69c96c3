"""Tool-call formats and tool-use planning (no model): whole-text parses, streamed deltas joined at every
split equal the whole parse, forcing grammars, schema $ref hoisting, history rendering."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.text.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCallStreamer,
    ToolParser,
    call_object_schema,
    detect_tool_parser,
)
from engine.text.tool_use import plan_tool_use, render_messages

HERMES = HermesToolParser()
LLAMA = Llama3JsonToolParser()
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _joined(parser: ToolParser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    streamer = ToolCallStreamer(parser)
    content = ""
    calls: dict[int, list[str]] = {}
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for k, piece in enumerate(pieces):
        step = streamer.feed(piece, final=k == len(pieces) - 1)
        if step.content:
            assert not calls, "content after a call started"
        content += step.content
        for index, name, args in step.calls:
            if name is not None:
                assert index not in calls
                calls[index] = [name, ""]
            calls[index][1] += args
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


HERMES_TEXTS = [
    "Just text, no calls.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}\n'
    '</tool_call><tool_call>{"name": "add", "arguments": {"a": [1, {"b": 2}]}}</tool_call>',
    '<tool_call>\n{"arguments": {"x": 1}, "name": "late_name"}\n</tool_call>',
    "<tool_call>not json at all",
    '<tool_call>\n{"name": "cut", "arguments": {"city": "Pa',  # cut off by max_tokens
    '<tool_call>\n{"name": "cut", "argu',  # cut off after the name
    '<tool_call>\n{"name": "no_args"}\n</tool_call>',
    "a < b and <tool but no call",
    "",
]
LLAMA_TEXTS = [
    "Plain answer.",
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "}"}}',
    '{"not": "a call"}',
    "  <b>html</b>",
]


@pytest.mark.parametrize(
    ("parser", "text"),
    [(HERMES, t) for t in HERMES_TEXTS] + [(LLAMA, t) for t in LLAMA_TEXTS],
)
def test_streamed_deltas_join_to_the_whole_parse_at_every_split(
    parser: ToolParser, text: str
) -> None:
    whole = parser.parse(text, final=True)
    expected = (whole.content or "", [(c.name, c.arguments) for c in whole.tool_calls])
    assert _joined(parser, text, []) == expected
    for cut in range(1, len(text)):
        assert _joined(parser, text, [cut]) == expected, cut
    assert _joined(parser, text, list(range(1, len(text)))) == expected  # char by char


def test_hermes_parses_content_and_calls() -> None:
    parsed = HERMES.parse(HERMES_TEXTS[2])
    assert parsed.content == "Let me check.\n"
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "add"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"city": 'Pa"ris}'}
    assert json.loads(parsed.tool_calls[1].arguments) == {"a": [1, {"b": 2}]}
    only_call = HERMES.parse(HERMES_TEXTS[1])
    assert only_call.content is None and len(only_call.tool_calls) == 1
    assert HERMES.parse("<tool_call>not json at all").content == "<tool_call>not json at all"
    assert HERMES.parse(HERMES_TEXTS[3]).tool_calls[0].arguments == '{"x": 1}'


def test_a_call_cut_off_keeps_what_it_has_and_a_whole_one_without_arguments_gets_braces() -> None:
    def calls(text: str) -> list[tuple[str | None, str]]:
        return [(c.name, c.arguments) for c in HERMES.parse(text).tool_calls]

    assert calls(HERMES_TEXTS[5]) == [("cut", '{"city": "Pa')]
    assert calls(HERMES_TEXTS[6]) == [("cut", "")]  # no invented "{}" for a call cut off
    assert calls(HERMES_TEXTS[7]) == [("no_args", "{}")]
    assert [(c.name, c.arguments) for c in LLAMA.parse('{"name": "f", "param').tool_calls] == [
        ("f", "")
    ]


def test_llama3_json_parses_calls_and_leaves_other_json_as_content() -> None:
    parsed = LLAMA.parse(LLAMA_TEXTS[2])
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("a", "{}"),
        ("b", '{"x": "}"}'),
    ]
    assert LLAMA.parse('{"not": "a call"}').content == '{"not": "a call"}'
    assert LLAMA.parse("Plain answer.").tool_calls == []


def test_call_schema_hoists_defs_and_repoints_local_refs() -> None:
    tool = {
        "name": "f",
        "parameters": {
            "type": "object",
            "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}}},
            "properties": {
                "item": {"$ref": "#/$defs/Item"},
                "again": {"$ref": "#/properties/item"},
            },
            "required": ["item"],
        },
    }
    schema = call_object_schema(tool, "arguments")
    assert "$defs" in schema and schema["properties"]["arguments"]["properties"]["again"] == {
        "$ref": "#/properties/arguments/properties/item"
    }
    good = {"name": "f", "arguments": {"item": {"n": 1}, "again": {"n": 2}}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"item": {"n": "x"}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "g", "arguments": {"item": {"n": 1}}}, schema)


def test_detect_parser_from_the_template() -> None:
    assert detect_tool_parser(None) == ("hermes", False)
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") == (
        "hermes",
        False,
    )
    qwen = "{% if tools %}<tools>{{ tools }}</tools> <tool_call>{% endif %}"
    assert detect_tool_parser(qwen) == ("hermes", True)
    llama = "{% if tools %}{{ tools }}{% endif %}<|python_tag|>ipython"
    assert detect_tool_parser(llama) == ("llama3_json", True)


def test_plan_constrains_required_named_and_prompt_auto() -> None:
    none = plan_tool_use([TOOL], "none", None, None)
    assert none.constraint is None and not none.parse_calls and none.system_prompt is None
    required = plan_tool_use([TOOL], "required", False, None)
    assert required.constraint is not None and required.constraint.grammar is not None
    assert "text" not in required.constraint.grammar.split("\n")[0]
    assert "call+" not in required.constraint.grammar  # parallel_tool_calls false: one call
    assert required.system_prompt and "get_weather" in required.system_prompt
    auto = plan_tool_use([TOOL], None, None, None)
    assert auto.constraint is not None and auto.constraint.grammar.startswith("start: text | calls")
    native_auto = plan_tool_use([TOOL], "auto", None, "{{ tools }} <tool_call>")
    assert native_auto.constraint is None and native_auto.template_tools == [TOOL]
    named = plan_tool_use(
        [TOOL, {"type": "function", "function": {"name": "other"}}],
        {"type": "function", "function": {"name": "other"}},
        None,
        None,
    )
    assert named.constraint is not None and "get_weather" not in named.constraint.grammar


def test_history_renders_in_the_prompt_format_without_native_tools() -> None:
    plan = plan_tool_use([TOOL], "auto", None, None)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    messages = [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "warm"},
    ]
    out = render_messages(messages, plan)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be nice.") and "<tools>" in out[0]["content"]
    assert HERMES.parse(out[2]["content"]).tool_calls[0].name == "get_weather"
    assert out[3]["content"].count("<tool_response>") == 2
    native = plan_tool_use([TOOL], "auto", None, "{{ tools }}<tool_call>")
    rendered = render_messages(messages, native)
    assert rendered[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert rendered[3]["role"] == "tool"
