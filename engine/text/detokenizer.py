"""Incremental detokenization of one output sequence, with stop strings and stream hold-back.

Byte-level tokenizers step `tokenizers`' DecodeStream (one Rust call per token); others decode a
small window of tokens (prefix offset / read offset) twice per token. Both cost O(1) per token.
"""

from __future__ import annotations

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

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Consume new tokens; return the stop string if one now matched, else None."""
        for token_id in token_ids:
            if self.stop_matched is not None:
                break
            self._tokens.append(token_id)
            self._append_text(self._decode_pending(final=False))
        return self.stop_matched

    def take_delta(self, finished: bool) -> str:
        """New text that is safe to send; with finished=True everything still held is released."""
        if finished and self.stop_matched is None and self._read_offset < len(self._tokens):
            self._append_text(self._decode_pending(final=True))  # flush incomplete UTF-8 as-is
        end = len(self.text)
        if not finished and self.stop_matched is None:
            end -= self._partial_stop_len()
        if end <= self._sent_offset:
            return ""
        delta = self.text[self._sent_offset : end]
        self._sent_offset = end
        return delta

    def visible_text(self) -> str:
        """All text that is safe to show while running (cumulative streaming): `text` minus the
        held-back stop-string prefix. Does not move take_delta's position."""
        if self.stop_matched is not None:
            return self.text
        return self.text[: len(self.text) - self._partial_stop_len()]

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
