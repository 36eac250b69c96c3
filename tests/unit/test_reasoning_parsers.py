"""Reasoning parsers: the split of whole outputs, the same split streamed at every split point, the
prompt's state of the block (opened by the template, closed by enable_thinking=false), detection
from chat templates, and stop strings / token counts in the detokenizer."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import ReasoningFormat
from engine.text.reasoning import (
    ReasoningSplit,
    ReasoningStreamer,
    detect_reasoning_parser,
    get_reasoning_parser,
    split_reasoning,
)

MAYBE = ReasoningFormat(starts_inside=False)
INSIDE = ReasoningFormat(starts_inside=True)

CASES = [
    # (format, output text, reasoning, content)
    (MAYBE, "<think>\nLet me see.\n</think>\n\nThe answer.", "Let me see.", "The answer."),
    (MAYBE, "  <think>a</think>b", "a", "b"),
    (MAYBE, "The answer, no thinking.", None, "The answer, no thinking."),
    (MAYBE, "<think>cut off mid-thought", "cut off mid-thought", ""),
    (MAYBE, "<thinking is not the tag", None, "<thinking is not the tag"),
    (MAYBE, "", None, ""),
    (MAYBE, "<think></think>", "", ""),
    (MAYBE, "<think>x</think>y</think>z", "x", "y</think>z"),
    (MAYBE, "<think>a <tool_call>{}</tool_call></think>ok", "a <tool_call>{}</tool_call>", "ok"),
    (INSIDE, "Let me see.\n</think>\n\nThe answer.", "Let me see.", "The answer."),
    (INSIDE, "<think>\nR1-0528 writes the tag</think>A", "R1-0528 writes the tag", "A"),
    (INSIDE, "all reasoning, never closed", "all reasoning, never closed", ""),
    (INSIDE, "</think>only answer", "", "only answer"),
    (INSIDE, "a</thin", "a</thin", ""),
    (INSIDE, "思考</think>答え", "思考", "答え"),
]


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_whole_split(fmt, text, reasoning, content):
    assert split_reasoning(fmt, text) == ReasoningSplit(reasoning, content)


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_streamed_split_equals_whole_at_every_split_point(fmt, text, reasoning, content):
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            streamer = ReasoningStreamer(fmt)
            got_r, got_c = "", ""
            for k, piece in enumerate(pieces):
                r, c = streamer.feed(piece, final=k == len(pieces) - 1)
                got_r += r
                got_c += c
            assert got_r == (reasoning or "")
            assert got_c == content


def test_streaming_holds_back_a_tag_split_across_deltas():
    streamer = ReasoningStreamer(MAYBE)
    assert streamer.feed("<th") == ("", "")  # maybe the opening tag
    assert streamer.feed("ink>Hmm") == ("Hmm", "")
    assert streamer.feed(" ok</thi") == (" ok", "")  # maybe the closing tag
    assert streamer.feed("nk>\n\n") == ("", "")  # blanks before the answer wait
    assert streamer.feed("Yes") == ("", "Yes")
    assert streamer.feed(".", final=True) == ("", ".")


def test_content_streams_before_the_end_when_no_block_opens():
    streamer = ReasoningStreamer(MAYBE)
    assert streamer.feed("Hello") == ("", "Hello")
    assert streamer.feed(" <think>") == ("", " <think>")  # a tag after text is just text


def test_prompt_state_decides_the_format():
    qwen3 = get_reasoning_parser("qwen3")
    r1 = get_reasoning_parser("deepseek_r1")
    assert qwen3 is not None and r1 is not None
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3.format_for(chat) == MAYBE
    assert r1.format_for(chat) == INSIDE  # R1 always starts by thinking
    assert qwen3.format_for(chat + "<think>\n") == INSIDE  # Qwen3-Thinking opens the block
    assert qwen3.format_for(chat + "<think>\n\n</think>\n\n") is None  # enable_thinking: false
    assert r1.format_for(chat + "<think>\n\n</think>\n\n") is None
    # A closed block in the history does not close the new turn's.
    history = "<|im_start|>assistant\n<think>x</think>y<|im_end|>\n" + chat
    assert qwen3.format_for(history) == MAYBE


def test_detection_and_names():
    assert detect_reasoning_parser(None) == "none"
    assert detect_reasoning_parser("{{ messages }}") == "none"
    assert (
        detect_reasoning_parser("{%- if enable_thinking is false %}<think>\n\n</think>") == "qwen3"
    )
    assert detect_reasoning_parser("<｜Assistant｜><think>\n") == "deepseek_r1"
    assert get_reasoning_parser("none") is None
    assert get_reasoning_parser("auto", "plain") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'.*qwen3"):
        get_reasoning_parser("nope")


class _CharTokenizer:
    """One character per token, for the detokenizer (its decode is exact)."""

    def decode_stream(self, context, skip_special_tokens):
        return None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _detokenize(text: str, fmt: ReasoningFormat, stop: list[str]):
    from engine.text.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(_CharTokenizer(), [], True, stop, False, fmt)  # type: ignore[arg-type]
    reasoning, content = "", ""
    for c in text:
        matched = detok.add_tokens([ord(c)])
        content += detok.take_delta(False)
        reasoning += detok.take_reasoning_delta(False)
        if matched:
            break
    content += detok.take_delta(True)
    reasoning += detok.take_reasoning_delta(True)
    assert content == detok.answer_text
    assert reasoning == (detok.visible_reasoning(True) or "")
    return reasoning, content, detok


def test_stop_strings_apply_to_the_answer_only():
    text = "<think>I could stop here. STOP</think>Answer. STOP ignored"
    reasoning, content, detok = _detokenize(text, MAYBE, ["STOP"])
    assert reasoning == "I could stop here. STOP"
    assert content == "Answer. "
    assert detok.stop_matched == "STOP"


def test_reasoning_token_count():
    text = "<think>ab</think>cd"
    _, _, detok = _detokenize(text, MAYBE, [])
    assert detok.num_reasoning_tokens == len("<think>ab</think>")
    _, content, detok = _detokenize("plain", MAYBE, [])
    assert (content, detok.num_reasoning_tokens) == ("plain", 0)
    _, _, detok = _detokenize("never closed", INSIDE, [])
    assert detok.num_reasoning_tokens == len("never closed")
