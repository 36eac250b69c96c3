"""Reasoning output: which parser a chat template calls for, where the reasoning block stands after
the rendered prompt, and the incremental split of generated text into reasoning and answer.

Formats: `qwen3` (the output may open `<think>...</think>` first; without it, all is answer) and
`deepseek_r1` (the output starts inside the block, as R1's templates open it; a leading `<think>` the
model writes itself is skipped; without `</think>`, all is reasoning). Both read the rendered prompt:
a prompt that ends inside an open block (Qwen3-Thinking, R1) starts the output in reasoning, and one
that ends with a closed block (`enable_thinking: false`) leaves no reasoning to parse. The split of a
prefix only grows, so streamed deltas joined equal the split of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sampling_params import ReasoningFormat

_WS = " \t\r\n"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output opened no reasoning block
    content: str  # the answer (what tools, structured outputs and stop strings apply to)


class ReasoningParser:
    """A `<think>`-style format: its tags, and whether its models always start by thinking."""

    name = ""
    start = "<think>"
    end = "</think>"
    always_thinks = False  # the output starts inside the block unless the prompt closed it

    def format_for(self, prompt_text: str) -> ReasoningFormat | None:
        """The reasoning format of the output that follows `prompt_text`; None when the prompt has
        closed the block (thinking switched off), so the output is all answer."""
        last_start, last_end = prompt_text.rfind(self.start), prompt_text.rfind(self.end)
        if last_start > last_end and not prompt_text[last_start + len(self.start) :].strip(_WS):
            return ReasoningFormat(self.start, self.end, starts_inside=True)
        if last_end > last_start and not prompt_text[last_end + len(self.end) :].strip(_WS):
            return None
        return ReasoningFormat(self.start, self.end, starts_inside=self.always_thinks)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_thinks = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
REASONING_PARSER_NAMES = ("auto", *REASONING_PARSERS, "none")


def detect_reasoning_parser(chat_template: str | None) -> str:
    """The parser a chat template calls for: `deepseek_r1` for DeepSeek's templates with a thinking
    block, `qwen3` for any other that writes `<think>` tags or takes `enable_thinking`, else none."""
    template = chat_template or ""
    thinks = any(m in template for m in ("<think>", "</think>", "enable_thinking"))
    if not thinks:
        return "none"
    if "｜Assistant｜" in template:  # DeepSeek's full-width delimiters
        return DeepSeekR1ReasoningParser.name
    return Qwen3ReasoningParser.name


def get_reasoning_parser(name: str, chat_template: str | None = None) -> ReasoningParser | None:
    """The parser called `name` ("auto": from the chat template; "none": None). An unknown name
    raises ValueError listing the known ones."""
    if name == "auto":
        name = detect_reasoning_parser(chat_template)
    if name == "none":
        return None
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSER_NAMES)}"
        ) from None


def _held_back(text: str, end: int, marker: str) -> int:
    """Length of the longest suffix of text[:end] that is a proper prefix of `marker`."""
    tail = text[max(0, end - len(marker) + 1) : end]
    at = tail.find(marker[0])
    while at >= 0:  # only where the marker's first character is can a prefix start
        if marker.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(marker[0], at + 1)
    return 0


class ReasoningTracker:
    """Follows one output's text as it grows: where its reasoning block opens and closes, and the
    spans of reasoning and answer that are certain (a tag split across deltas is held back, and so
    is whitespace around the reasoning and before the answer, which the split trims)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.phase = "start"  # "start" (before the first non-blank text), "reasoning", "answer"
        self.reasoning_start = 0  # raw index where the reasoning text begins
        self.reasoning_end: int | None = None  # raw index of the closing tag, once seen
        self.answer_start: int | None = None  # raw index where the answer begins, once known
        self.opened = fmt.starts_inside  # whether there is a reasoning block at all
        self._scan = 0  # where the search for the closing tag resumes
        self._shown_start: int | None = None  # first non-blank reasoning index, once seen

    def advance(self, text: str, final: bool = False) -> None:
        """Take in `text` (the whole output so far, grown since the last call)."""
        if self.phase == "start":
            i = len(text) - len(text.lstrip(_WS))
            rest = text[i:]
            start = self.fmt.start
            if rest.startswith(start):
                self.phase, self.opened, self.reasoning_start = "reasoning", True, i + len(start)
            elif not final and start.startswith(rest):
                return  # blank so far, or maybe the opening tag: wait
            elif self.fmt.starts_inside:
                self.phase, self.reasoning_start = "reasoning", i
            else:
                self.phase, self.answer_start = "answer", 0
        if self.phase == "reasoning":
            at = text.find(self.fmt.end, max(self.reasoning_start, self._scan))
            if at < 0:
                self._scan = max(self.reasoning_start, len(text) - len(self.fmt.end) + 1)
                return
            self.phase, self.reasoning_end = "answer", at
            self.answer_start = at + len(self.fmt.end)

    @property
    def in_reasoning(self) -> bool:
        return self.phase == "reasoning" or (self.phase == "start" and self.fmt.starts_inside)

    def reasoning_span(self, text: str, final: bool) -> tuple[int, int]:
        """[start, end) of the reasoning text that is certain (empty when there is none)."""
        if not self.opened or self.phase == "start":
            return 0, 0
        if self.reasoning_end is not None:
            limit = self.reasoning_end
        else:
            limit = len(text) if final else len(text) - _held_back(text, len(text), self.fmt.end)
        start = self._shown_start
        if start is None:
            start = self.reasoning_start
            while start < limit and text[start] in _WS:
                start += 1
            if start < limit:
                self._shown_start = start
        end = limit
        while end > start and text[end - 1] in _WS:
            end -= 1
        return start, end

    def content_start(self, text: str, final: bool) -> int | None:
        """Raw index where the shown answer begins (after the reasoning, its leading blanks are
        trimmed); None while that is not yet known."""
        if self.answer_start is None:
            return len(text) if final else None
        if self.reasoning_end is None:
            return self.answer_start
        start = self.answer_start
        while start < len(text) and text[start] in _WS:
            start += 1
        return start if start < len(text) or final else None


def split_reasoning(fmt: ReasoningFormat | None, text: str) -> ReasoningSplit:
    """The split of a finished output's whole text."""
    if fmt is None:
        return ReasoningSplit(None, text)
    tracker = ReasoningTracker(fmt)
    tracker.advance(text, final=True)
    r0, r1 = tracker.reasoning_span(text, final=True)
    c0 = tracker.content_start(text, final=True)
    assert c0 is not None
    return ReasoningSplit(text[r0:r1] if tracker.opened else None, text[c0:])


class ReasoningStreamer:
    """Feeds text deltas; returns the (reasoning, answer) text that became certain. Joined, the
    pieces equal `split_reasoning` of the whole text."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.tracker = ReasoningTracker(fmt)
        self.text = ""
        self._sent_reasoning = 0  # raw index up to which reasoning was returned
        self._sent_content: int | None = None  # raw index up to which the answer was returned

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        text, tracker = self.text, self.tracker
        tracker.advance(text, final)
        r0, r1 = tracker.reasoning_span(text, final)
        reasoning = text[max(r0, self._sent_reasoning) : r1]
        self._sent_reasoning = max(self._sent_reasoning, r1)
        content = ""
        c0 = tracker.content_start(text, final)
        if c0 is not None:
            start = c0 if self._sent_content is None else self._sent_content
            content = text[start:]
            self._sent_content = len(text)
        return reasoning, content
