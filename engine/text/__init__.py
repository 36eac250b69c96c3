"""Text in and out: the tokenizer with its chat template, the incremental detokenizer, structured-output
grammars (llguidance), tool-call formats and parsers, tool-use planning over chat templates, and a
score request's token ids (lm-evaluation-harness's context/continuation split).

Its face is what an API front end shares with the engine's text handling (tool plans and parsers,
schema pattern checks, reasoning parsers, score inputs); none of it needs torch."""

from __future__ import annotations

from engine.text.reasoning import REASONING_PARSER_NAMES, ReasoningParser, get_reasoning_parser
from engine.text.schema_regex import ecma_pattern_error
from engine.text.score_inputs import ScoreInputs, build_score_inputs
from engine.text.tool_parsers import TOOL_PARSERS, ToolCallStreamer, ToolParser, ToolStreamDelta
from engine.text.tool_use import ToolPlan, plan_tool_use, render_messages

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_PARSERS",
    "ReasoningParser",
    "ScoreInputs",
    "ToolCallStreamer",
    "ToolParser",
    "ToolPlan",
    "ToolStreamDelta",
    "build_score_inputs",
    "ecma_pattern_error",
    "get_reasoning_parser",
    "plan_tool_use",
    "render_messages",
]
