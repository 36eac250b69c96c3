"""Forcing grammars of tool use with a response format, compiled by llguidance for the bundled tokenizer
(no model): under "auto" a reply is a call in the parser's format or an answer in the requested format,
never free text; "required" and a named tool allow only calls; "none" only the answer. What the grammar
accepts parses back as the calls or the content it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.core.sampling_params import SamplingParamsError, StructuredOutputs
from engine.text.schema_regex import ecma_pattern_error, ecma_patterns, ecma_regex
from engine.text.structured import GrammarCompiler
from engine.text.tool_parsers import ToolCallStreamer
from engine.text.tool_use import ToolPlan, plan_tool_use

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
# An answer whose keys include "name": a Llama 3 call is a bare JSON object with a "name" too.
REPORT = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "temperature": {"type": "integer"}},
    "required": ["name", "temperature"],
    "additionalProperties": False,
}
REPORT_ANSWER = StructuredOutputs(
    json=json.dumps(REPORT), source="response_format.json_schema.schema"
)
ANSWER_TEXT = '{"name": "Paris", "temperature": 21}'
CALLS = {
    "hermes": {
        "get_weather": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        "add": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "bad_args": '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 2}}\n</tool_call>',
        "unknown": '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    },
    "llama3_json": {
        "get_weather": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "add": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
        "bad_args": '{"name": "add", "parameters": {"a": "x", "b": 2}}',
        "unknown": '{"name": "nope", "parameters": {}}',
    },
}
PARSERS = list(CALLS)


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    return GrammarCompiler(hf, len(hf), frozenset([hf.eos_token_id]))


def _accepts(compiler: GrammarCompiler, constraint: StructuredOutputs, text: str) -> bool:
    """Whether `text` (tokenized as the model would write it) is a whole reply of the grammar."""
    matcher = compiler.new_matcher(constraint)
    ids = compiler._hf.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


def _plan(parser: str, choice: Any, answer: StructuredOutputs | None = REPORT_ANSWER) -> ToolPlan:
    return plan_tool_use(TOOLS, choice, None, None, parser, answer=answer)


def _parsed(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str | None, Any]]]:
    parsed = plan.parser.parse(text, final=True)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("parser", PARSERS)
def test_auto_allows_a_call_or_the_schema_answer_and_nothing_else(
    compiler: GrammarCompiler, parser: str
) -> None:
    plan = _plan(parser, "auto")
    assert plan.constraint is not None and plan.constraint.answer == REPORT_ANSWER
    calls = CALLS[parser]
    assert _accepts(compiler, plan.constraint, calls["get_weather"])
    assert _accepts(compiler, plan.constraint, calls["add"])
    assert _accepts(compiler, plan.constraint, ANSWER_TEXT)
    for wrong in (
        "It is sunny in Paris.",  # free text is no longer a reply
        '{"name": "Paris"}',  # the answer misses a required key
        '{"name": "Paris", "temperature": 21, "sky": "clear"}',  # a key the schema forbids
        calls["bad_args"],  # arguments against the function's schema
        calls["unknown"],  # a function that is not in tools
        ANSWER_TEXT + "\n" + calls["add"],  # an answer, then a call
    ):
        assert not _accepts(compiler, plan.constraint, wrong), wrong
    # What the grammar allows parses back as what it is: calls, or the answer as content.
    assert _parsed(plan, calls["get_weather"]) == (None, [("get_weather", {"city": "Paris"})])
    assert _parsed(plan, ANSWER_TEXT) == (ANSWER_TEXT, [])


@pytest.mark.parametrize("parser", PARSERS)
def test_required_and_named_allow_only_calls_and_none_only_the_answer(
    compiler: GrammarCompiler, parser: str
) -> None:
    calls = CALLS[parser]
    required = _plan(parser, "required")
    assert required.constraint is not None and required.constraint.answer is None
    assert _accepts(compiler, required.constraint, calls["add"])
    assert not _accepts(compiler, required.constraint, ANSWER_TEXT)
    named = _plan(parser, {"type": "function", "function": {"name": "add"}})
    assert named.constraint is not None
    assert _accepts(compiler, named.constraint, calls["add"])
    assert not _accepts(compiler, named.constraint, calls["get_weather"])
    assert not _accepts(compiler, named.constraint, ANSWER_TEXT)
    none = _plan(parser, "none")
    assert none.constraint == REPORT_ANSWER and not none.parse_calls
    assert _accepts(compiler, none.constraint, ANSWER_TEXT)
    assert not _accepts(compiler, none.constraint, calls["add"])


@pytest.mark.parametrize(
    ("answer", "good", "bad"),
    [
        (StructuredOutputs(json_object=True), '{"anything": [1, 2]}', "[1, 2]"),
        (StructuredOutputs(regex=r"(yes|no), \d+"), "no, 42", "maybe"),
        (StructuredOutputs(choice=("sunny", "rainy")), "rainy", "cloudy"),
        (StructuredOutputs(grammar='start: "temp=" NUM\nNUM: /[0-9]+/'), "temp=21", "temp=x"),
        (StructuredOutputs(grammar='root ::= "ok" [0-9]'), "ok7", "ok"),  # GBNF
    ],
)
def test_every_kind_of_answer_constraint_combines_with_calls(
    compiler: GrammarCompiler, answer: StructuredOutputs, good: str, bad: str
) -> None:
    plan = _plan("hermes", "auto", answer)
    assert plan.constraint is not None
    assert _accepts(compiler, plan.constraint, good)
    assert _accepts(compiler, plan.constraint, CALLS["hermes"]["add"])
    assert not _accepts(compiler, plan.constraint, bad)


def test_parallel_calls_follow_parallel_tool_calls(compiler: GrammarCompiler) -> None:
    two = CALLS["hermes"]["add"] + CALLS["hermes"]["get_weather"]
    parallel = plan_tool_use(TOOLS, "auto", None, None, answer=REPORT_ANSWER)
    single = plan_tool_use(TOOLS, "auto", False, None, answer=REPORT_ANSWER)
    assert parallel.constraint is not None and single.constraint is not None
    assert _accepts(compiler, parallel.constraint, two)
    assert not _accepts(compiler, single.constraint, two)
    assert _accepts(compiler, single.constraint, ANSWER_TEXT)


def test_native_auto_is_constrained_only_with_an_answer() -> None:
    qwen = "{% if tools %}{{ tools }}{% endif %}<tool_call>"
    free = plan_tool_use(TOOLS, "auto", None, qwen)
    assert free.constraint is None  # the model's own format, left free
    constrained = plan_tool_use(TOOLS, "auto", None, qwen, answer=REPORT_ANSWER)
    assert constrained.native and constrained.constraint is not None
    assert constrained.constraint.answer == REPORT_ANSWER


def test_a_bad_answer_schema_names_its_own_field(compiler: GrammarCompiler) -> None:
    bad = StructuredOutputs(
        # A lookahead: not a regular language.
        json=json.dumps({"type": "string", "pattern": "(?=a)"}),
        source="response_format.json_schema.schema",
    )
    plan = _plan("hermes", "auto", bad)
    assert plan.constraint is not None
    with pytest.raises(SamplingParamsError) as e:
        compiler.compile(plan.constraint)
    assert e.value.param == "response_format.json_schema.schema"


def test_llama3_answer_with_a_name_key_streams_as_content_not_a_call() -> None:
    plan = _plan("llama3_json", "auto")
    streamer = ToolCallStreamer(plan.parser)
    content = ""
    for k, char in enumerate(ANSWER_TEXT):
        step = streamer.feed(char, final=k == len(ANSWER_TEXT) - 1)
        assert not step.calls
        content += step.content
    assert content == ANSWER_TEXT and not streamer.has_calls
    jsonschema.validate(json.loads(content), REPORT)


# ----------------------------------------------------------------- patterns mean what ECMA-262 says


@pytest.mark.parametrize(
    ("pattern", "ecma"),
    [
        (r"^\d{3}-\d{4}$", r"^[0-9]{3}-[0-9]{4}$"),
        (r"[\d.]+", r"[0-9.]+"),
        (r"\w+@\W", r"[0-9A-Za-z_]+@[^0-9A-Za-z_]"),
        (r"[^\D]", r"[^[:^digit:]]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then a letter d
        (r"[]\d]", r"[]0-9]"),  # a leading ] is a literal one
        (r"[[:alpha:]\d]\p{L}\u{41}", r"[[:alpha:]0-9]\p{L}\u{41}"),
        (r"x.y[.]\.", r"x[^\n\r\x{2028}\x{2029}]y[.]\."),  # ECMA's dot skips 4 line ends
        (r"\cJ?a", r"\x{0A}?a"),  # a control escape llguidance does not have
    ],
)
def test_ecma_regex_rewrites_only_the_class_escapes(pattern: str, ecma: str) -> None:
    assert ecma_regex(pattern) == ecma


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"^\d{3}$", None),
        (r"(?<year>\d{4})-\k<year>", None),  # ECMA named groups (Python spells them (?P<..>))
        (r"\p{Lu}[\p{L}\d]\u{41}\x41\/\.", None),
        (r"(?:a)(?=b)(?!c)(?<=d)(?<!e)\1", None),
        (r"^\A\d$", r"\A"),
        (r"abc\z", r"\z"),
        (r"^\a$", r"\a"),
        (r"(?P<n>\d)", "(?P<"),
        (r"(?i)abc", "(?i)"),
        ("abc\\", "lone backslash"),
        (r"^[[:alpha:]]$", "POSIX"),
        (r"^a++$", "possessive"),
        (r"^a+?b\++[+]+$", None),  # lazy, an escaped plus repeated, a class of plus: all ECMA
    ],
)
def test_ecma_pattern_error_names_other_dialects_syntax(pattern: str, why: str | None) -> None:
    found = ecma_pattern_error(pattern)
    assert (found is None) if why is None else (found is not None and why in found), found


def test_ecma_patterns_leaves_data_and_property_names_alone() -> None:
    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "string", "pattern": r"\d+"}},  # a property so named
        "patternProperties": {r"^\w+$": {"type": "string"}},
        "$defs": {"id": {"type": "string", "pattern": r"\w{2}"}},
        "enum": [{"pattern": r"\d"}],
    }
    out = ecma_patterns(schema)
    assert out["properties"]["pattern"]["pattern"] == "[0-9]+"
    assert list(out["patternProperties"]) == ["^[0-9A-Za-z_]+$"]
    assert out["$defs"]["id"]["pattern"] == "[0-9A-Za-z_]{2}"
    assert out["enum"] == [{"pattern": r"\d"}]
    assert schema["properties"]["pattern"]["pattern"] == r"\d+", "the input was modified"


NON_ASCII_DIGITS = "\u0663\u0664\u0665"  # Arabic-Indic 345: Unicode \d, not ECMA's


def test_json_schema_regex_and_tool_patterns_allow_only_ascii_digits(
    compiler: GrammarCompiler,
) -> None:
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": r"^\d{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    }
    as_json = StructuredOutputs(json=json.dumps(schema), source="response_format")
    assert _accepts(compiler, as_json, '{"code": "345"}')
    assert not _accepts(compiler, as_json, f'{{"code": "{NON_ASCII_DIGITS}"}}')
    as_regex = StructuredOutputs(regex=r"\d{3}", source="structured_outputs.regex")
    assert _accepts(compiler, as_regex, "345")
    assert not _accepts(compiler, as_regex, NON_ASCII_DIGITS)
    # ECMA's \s has U+FEFF and not U+0085 (NEL); Unicode's White_Space is the other way round.
    spaces = StructuredOutputs(regex=r"a\sb", source="structured_outputs.regex")
    assert _accepts(compiler, spaces, "a\ufeffb") and _accepts(compiler, spaces, "a\u3000b")
    assert not _accepts(compiler, spaces, "a\u0085b")
    dot = StructuredOutputs(regex=r"x.y", source="structured_outputs.regex")
    assert _accepts(compiler, dot, "x y") and not _accepts(compiler, dot, "x\u2028y")
    assert not _accepts(compiler, dot, "x\ry")
    non_space = StructuredOutputs(regex=r"a[\Sx]b", source="structured_outputs.regex")
    assert _accepts(compiler, non_space, "a\u0085b") and not _accepts(
        compiler, non_space, "a\ufeffb"
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    plan = plan_tool_use([tool], "required", None, None, "hermes")
    assert plan.constraint is not None
    for code, allowed in (("345", True), (NON_ASCII_DIGITS, False)):
        call = f'<tool_call>\n{{"name": "f", "arguments": {{"code": "{code}"}}}}\n</tool_call>'
        assert _accepts(compiler, plan.constraint, call) == allowed, code
