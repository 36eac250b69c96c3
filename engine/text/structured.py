"""Structured outputs with llguidance: constraint -> grammar compile cache (a grammar with an `answer`
constraint becomes one llguidance grammar of two), a matcher per sequence, and the per-step token
bitmask (one 32-bit word per 32 vocabulary ids, bit set = token allowed)."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.core.sampling_params import (
    ANSWER_GRAMMAR,
    ReasoningFormat,
    SamplingParamsError,
    StructuredOutputs,
)
from engine.text.schema_regex import ecma_patterns, ecma_regex

logger = logging.getLogger(__name__)

_AFTER_REASONING = "after_reasoning"  # the name by which a reasoning prefix reaches the constraint
_CACHE_SIZE = 256  # compiled constraints kept (a template matcher each, a few hundred KiB at most)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles constraints for one tokenizer, once each (LRU cache keyed by the constraint).

    Thread-safe: the async engine compiles in a worker thread while the step thread runs; each
    sequence gets a deep copy of the cached template matcher, which it then owns.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, Any] = OrderedDict()
        self.compile_seconds: dict[str, float] = {}  # kind -> total seconds (for logs/benchmarks)

    # -- compile ---------------------------------------------------------------------------------
    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
            self._executor = llguidance.LLExecutor()
        return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputs) -> Any:
        """The template matcher of `constraint`; a constraint that does not compile raises
        SamplingParamsError naming `constraint.source` (or its answer's source) and saying why."""
        if constraint.answer is not None:
            self.compile(constraint.answer)  # a bad answer constraint names its own field
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                return cached
            tokenizer = self._tokenizer()
        import llguidance

        started = time.perf_counter()
        grammar = grammar_text(constraint, self._added_tokens(constraint), self._eos)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise SamplingParamsError(
                f"the {_noun(constraint)} cannot be used: {_first(messages)}", constraint.source
            )
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SamplingParamsError(
                f"the {_noun(constraint)} cannot be used: {_first([matcher.get_error()])}",
                constraint.source,
            )
        elapsed = time.perf_counter() - started
        with self._lock:
            self.compile_seconds[constraint.kind] = (
                self.compile_seconds.get(constraint.kind, 0.0) + elapsed
            )
            self._cache[constraint] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        logger.debug("compiled a %s constraint in %.1f ms", constraint.kind, elapsed * 1e3)
        return matcher

    def _added_tokens(self, constraint: StructuredOutputs) -> dict[str, int]:
        """The reasoning tags that are added tokens of this tokenizer (Qwen3's `<think>`):
        llguidance treats added tokens as special, so a grammar names them by id."""
        if constraint.reasoning is None:
            return {}
        added = {t.content: i for i, t in self._hf.added_tokens_decoder.items()}
        tags = (constraint.reasoning.start, constraint.reasoning.end)
        return {tag: added[tag] for tag in tags if tag in added}

    def new_matcher(self, constraint: StructuredOutputs) -> Any:
        """A fresh matcher at the start of `constraint`, owned by one sequence."""
        return self.compile(constraint).deep_copy()

    # -- per step ----------------------------------------------------------------------------------
    def fill_bitmask(self, matchers: list[tuple[Any, int]], bitmask: Any) -> None:
        """Write the allowed tokens of each (matcher, row) into row `row` of `bitmask`
        ([rows, words] int32, CPU, contiguous), all matchers in one parallel call."""
        from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0][0], bitmask, matchers[0][1])
        else:
            fill_next_token_bitmask_par(self._executor, matchers, bitmask)


def grammar_text(
    constraint: StructuredOutputs,
    tag_ids: dict[str, int] | None = None,
    eos_ids: list[int] | tuple[int, ...] = (),
) -> str:
    """The llguidance grammar of a constraint; `tag_ids`: the reasoning tags that are added
    (to llguidance, special) tokens; `eos_ids`: tokens that may not appear inside reasoning."""
    if constraint.reasoning is None and constraint.answer is None:
        return _single_grammar_text(constraint)
    return json.dumps({"grammars": _all_entries(constraint, tag_ids or {}, eos_ids)})


def _all_entries(
    constraint: StructuredOutputs, tag_ids: dict[str, int], eos_ids: Sequence[int]
) -> list[dict[str, Any]]:
    if constraint.reasoning is not None:
        inner = _all_entries(dataclasses.replace(constraint, reasoning=None), tag_ids, eos_ids)
        inner[0]["name"] = _AFTER_REASONING
        prefix = _reasoning_prefix(constraint.reasoning, tag_ids, eos_ids)
        return [{"lark_grammar": prefix}, *inner]
    if constraint.answer is not None:
        # One llguidance grammar of two: the first (a Lark grammar) reaches the second as @answer.
        main = _grammar_entries(dataclasses.replace(constraint, answer=None))
        answer = _grammar_entries(constraint.answer)
        answer[0]["name"] = ANSWER_GRAMMAR
        return [*main, *answer]
    return _grammar_entries(constraint)


def _reasoning_prefix(fmt: ReasoningFormat, tag_ids: dict[str, int], eos_ids: Sequence[int]) -> str:
    """Lark: free reasoning up to the block's end, then at most four blanks, then the constraint (a
    second grammar). The reasoning is a lazy lexeme that ends at the first closing tag written as text;
    where the closing tag is a token of its own, also any text and added tokens (but EOS) before
    that token."""
    start_id, end_id = tag_ids.get(fmt.start), tag_ids.get(fmt.end)
    # A few blanks only ("\n\n" is what the templates write): unbounded, a model could fill
    # max_tokens with whitespace and leave no answer.
    after = f"think /[ \\t\\r\\n]{{0,4}}/ @{_AFTER_REASONING}"
    opening = (
        json.dumps(fmt.start) if start_id is None else f"({json.dumps(fmt.start)} | <[{start_id}]>)"
    )
    if fmt.starts_inside:  # a leading opening tag is allowed (as text, `.*` takes it)
        start = f"start: {after}" if start_id is None else f"start: <[{start_id}]>? {after}"
    else:  # the output opens the block, or skips it and answers at once
        start = f"start: {opening} {after} | @{_AFTER_REASONING}"
    lines = [start, "think: think_text" + (" | think_token" if end_id is not None else "")]
    lines.append(f"think_text[lazy]: /(?s:.*){_regex_literal(fmt.end)}/")
    if end_id is not None:
        others = ",".join(str(i) for i in (end_id, *eos_ids))
        lines.append(f"think_token: (THINK_TEXT | <[^{others}]>)* <[{end_id}]>")
        lines.append("THINK_TEXT: /(?s:.+)/")
    return "\n".join(lines) + "\n"


def _regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (regex metacharacters and the slash escaped)."""
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|-" else c for c in text)


def _grammar_entries(constraint: StructuredOutputs) -> list[dict[str, Any]]:
    """The constraint's grammar as the entries of an llguidance grammar list (its start first)."""
    text = _single_grammar_text(constraint)
    if constraint.kind in ("json", "json_object", "regex"):
        # The JSON grammar list llguidance builds for them.
        return list(json.loads(text)["grammars"])
    return [{"lark_grammar": text}]  # Lark text (choice, grammar)


def _single_grammar_text(constraint: StructuredOutputs) -> str:
    try:
        return _build_grammar_text(constraint)
    except SamplingParamsError:
        raise
    except (ValueError, RecursionError) as e:  # llguidance refuses it (e.g. nested too deeply)
        raise SamplingParamsError(
            f"the {_noun(constraint)} cannot be used: {e}", constraint.source
        ) from None


def _build_grammar_text(constraint: StructuredOutputs) -> str:
    from llguidance import LLMatcher, grammar_from

    if constraint.json is not None or constraint.json_object:
        schema = constraint.json if constraint.json is not None else '{"type": "object"}'
        schema = json.dumps(ecma_patterns(json.loads(schema)))
        return LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(constraint))  # type: ignore[arg-type]
    if constraint.regex is not None:
        return LLMatcher.grammar_from_regex(ecma_regex(constraint.regex))
    if constraint.choice is not None:
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in constraint.choice)
        )
    assert constraint.grammar is not None
    try:
        return grammar_from("grammar", constraint.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise SamplingParamsError(f"the grammar cannot be used: {e}", constraint.source) from None


def _json_options(constraint: StructuredOutputs) -> dict[str, Any]:
    if constraint.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": constraint.whitespace_pattern}
    # Compact JSON as json.dumps writes it: a small model given free whitespace can pad forever.
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _noun(constraint: StructuredOutputs) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object constraint",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar",
    }[constraint.kind]


def _first(messages: list[str]) -> str:
    text = messages[0] if messages else "unknown error"
    return text.strip().splitlines()[0] if len(text) > 400 else text.strip()
