"""Structured outputs after reasoning, compiled by llguidance for the bundled tokenizer (no model):
the reasoning before `</think>` is free, the constraint applies to what follows; the tags work as
text and as added tokens (Qwen3's, which llguidance treats as special); a forced Hermes call takes
Qwen3's `<tool_call>` token."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine.core.sampling_params import ReasoningFormat, SamplingParams, StructuredOutputs
from engine.text.structured import GrammarCompiler
from engine.text.tool_use import plan_tool_use

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
MAYBE, INSIDE = ReasoningFormat(), ReasoningFormat(starts_inside=True)


@pytest.fixture(scope="module", params=["text tags", "added tokens"])
def compiler(request: pytest.FixtureRequest, smollm2_dir: Path) -> GrammarCompiler:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    if request.param == "added tokens":
        hf.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    return GrammarCompiler(hf, len(hf), frozenset([hf.eos_token_id]))


def _accepts(compiler: GrammarCompiler, constraint: StructuredOutputs, text: str) -> bool:
    matcher = compiler.new_matcher(constraint)
    ids = compiler._hf.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("fmt", "text", "accepted"),
    [
        (MAYBE, '<think>free text, {not json} a < b <tool_call></think>\n\n{"a": 1}', True),
        (MAYBE, '{"a": 2}', True),  # no block: the answer at once
        (MAYBE, "<think>x</think>not json", False),
        (MAYBE, '<think>x</think>\r\n\r\n{"a": 1}', True),
        (MAYBE, "<think>x</think>" + "\n" * 5 + '{"a": 1}', False),  # no whitespace run-on
        (MAYBE, "<think>x</think>" + " \t" * 20 + '{"a": 1}', False),
        (MAYBE, '<think>never closed {"a": 1}', False),
        (INSIDE, 'reasoning the prompt opened</think>{"a": 3}', True),
        (INSIDE, '<think>R1-0528 writes the tag</think>{"a": 4}', True),
        (INSIDE, '{"a": 5}', False),  # the block must close first
    ],
)
def test_a_schema_constrains_only_what_follows_the_reasoning(
    compiler: GrammarCompiler, fmt: ReasoningFormat, text: str, accepted: bool
) -> None:
    constraint = StructuredOutputs(json=SCHEMA, reasoning=fmt)
    assert _accepts(compiler, constraint, text) is accepted


def test_sampling_params_carry_the_reasoning_into_the_constraint() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]+"), reasoning=INSIDE)
    assert params.structured_outputs == StructuredOutputs(regex="[0-9]+", reasoning=INSIDE)


def test_a_forced_hermes_call_after_reasoning_takes_the_added_tokens(
    compiler: GrammarCompiler,
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plan = plan_tool_use(
        tools, "required", None, "<tool_call>", token_ids=compiler._hf.added_tokens_encoder
    )
    assert plan.constraint is not None
    constraint = dataclasses.replace(plan.constraint, reasoning=MAYBE)
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert _accepts(compiler, constraint, f"<think>hmm</think>{call}")
    assert not _accepts(compiler, constraint, "<think>hmm</think>no call")
