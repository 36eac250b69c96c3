"""Incremental detokenization of one output sequence, with stop strings, stream hold-back and the
split of a reasoning block from the answer (stop strings match in the answer only).

Byte-level tokenizers step `tokenizers`' DecodeStream (one Rust call per token); others decode a
small window of tokens (prefix offset / read offset) twice per token. Both cost O(1) per token.
"""

from __future__ import annotations

from engine.core.sampling_params import ReasoningFormat
from engine.text.reasoning import ReasoningTracker
from engine.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (spacing rules)


class IncrementalDetokenizer:
    """Turns one sequence's new tokens into text; finds stop strings; says what is safe to stream."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""  # full output text so far (final text once a stop matched)
        self.stop_matched: str | None = None
        # Window over `tokens`: [prefix_offset, read_offset) has been turned into text already and
        # is decoded again only as context; tokens from read_offset on are not yet in `text`.
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._tokens = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._sent_offset = 0  # chars of `text` already returned by take_delta
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._stream_step = tokenizer.decode_stream(context, skip_special_tokens)
        # With a reasoning format, `text` holds both parts; the tracker says where each one is.
        self.reasoning = ReasoningTracker(reasoning) if reasoning is not None else None
        self._sent_reasoning = 0  # raw index of `text` up to which reasoning was returned
        self._num_tokens = 0
        self.num_reasoning_tokens = 0  # output tokens up to the one that closed the reasoning

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Consume new tokens; return the stop string if one now matched, else None."""
        for token_id in token_ids:
            if self.stop_matched is not None:
                break
            self._tokens.append(token_id)
            self._num_tokens += 1
            # The token that closes the block counts as reasoning too.
            thinking = self.reasoning is not None and self.reasoning.in_reasoning
            self._append_text(self._decode_pending(final=False))
            if self.reasoning is not None and (thinking or self.reasoning.in_reasoning):
                self.num_reasoning_tokens = self._num_tokens
        return self.stop_matched

    def take_delta(self, finished: bool) -> str:
        """New answer text that is safe to send; with finished=True everything still held is
        released. With a reasoning format, `take_reasoning_delta` gives the reasoning part."""
        if finished and self.stop_matched is None and self._read_offset < len(self._tokens):
            self._append_text(self._decode_pending(final=True))  # flush incomplete UTF-8 as-is
        start, end = self._content_span(finished)
        start = max(start, self._sent_offset)
        if end <= start:
            return ""
        self._sent_offset = end
        return self.text[start:end]

    def take_reasoning_delta(self, finished: bool) -> str:
        """New reasoning text that is safe to send (call it after take_delta)."""
        if self.reasoning is None:
            return ""
        start, end = self.reasoning.reasoning_span(self.text, finished or self._final)
        start = max(start, self._sent_reasoning)
        if end <= start:
            return ""
        self._sent_reasoning = end
        return self.text[start:end]

    def visible_text(self) -> str:
        """All answer text that is safe to show while running (cumulative streaming): minus a
        held-back stop-string prefix. Does not move take_delta's position."""
        start, end = self._content_span(False)
        return self.text[start:end]

    def visible_reasoning(self, finished: bool = False) -> str | None:
        """All reasoning text that is safe to show; None without a reasoning block."""
        if self.reasoning is None or not self.reasoning.opened:
            return None
        start, end = self.reasoning.reasoning_span(self.text, finished or self._final)
        return self.text[start:end]

    @property
    def answer_text(self) -> str:
        """The whole answer of a finished sequence (after take_delta(finished=True))."""
        start, end = self._content_span(True)
        return self.text[start:end]

    @property
    def _final(self) -> bool:
        return self.stop_matched is not None

    def _content_span(self, finished: bool) -> tuple[int, int]:
        """[start, end) of `text` that is answer and safe to show."""
        final = finished or self.stop_matched is not None
        start = 0
        if self.reasoning is not None:
            if final:  # (_append_text advances it as text arrives)
                self.reasoning.advance(self.text, final)
            content_start = self.reasoning.content_start(self.text, final)
            if content_start is None:
                return len(self.text), len(self.text)
            start = content_start
        end = len(self.text)
        if not final:
            end -= self._partial_stop_len()
        return start, max(start, end)

    def _decode_pending(self, final: bool) -> str:
        """Text of tokens past read_offset, or "" while it ends in an incomplete character."""
        if self._stream_step is not None and not final:
            chunk = self._stream_step(self._tokens[-1])  # the token just appended
            if not chunk:
                return ""
            self._prefix_offset = self._read_offset  # the same window the decode path keeps
            self._read_offset = len(self._tokens)
            return chunk
        tokens, prefix, read = self._tokens, self._prefix_offset, self._read_offset
        decode = self.tokenizer.decode
        prefix_text = decode(tokens[prefix:read], self.skip_special_tokens)
        full_text = decode(tokens[prefix:], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: wait for visible text
        if full_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # the next token may complete this multi-byte character
        self._prefix_offset = read
        self._read_offset = len(tokens)
        return full_text[len(prefix_text) :]

    def _append_text(self, new_text: str) -> None:
        if not new_text:
            return
        # A match must end inside new_text, so it starts no earlier than this.
        search_from = max(len(self.text) - self._max_stop_len + 1, 0)
        self.text += new_text
        if self.reasoning is not None:
            was_answering = self.reasoning.answer_start is not None
            self.reasoning.advance(self.text)
            answer_start = self.reasoning.answer_start
            if answer_start is None:
                return  # still reasoning: a stop string there does not stop
            search_from = max(search_from, answer_start) if was_answering else answer_start
        if self.stop:
            self._check_stop(search_from)

    def _check_stop(self, search_from: int) -> None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            position = self.text.find(stop, search_from)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return
        position, stop = best
        end = position + len(stop) if self.include_stop_str_in_output else position
        self.text = self.text[:end]
        self.stop_matched = stop

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of `text` that could still grow into a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
