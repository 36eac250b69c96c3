"""Engine TokenLogprobs -> OpenAI's two logprob formats, legacy completions and chat (with bytes), and
vLLM's `prompt_logprobs`; tokens shown as "token_id:<id>" when a request asks (vLLM's
return_tokens_as_token_ids)."""

from __future__ import annotations

import codecs
import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine import TokenLogprob

if TYPE_CHECKING:
    from engine import Tokenizer

_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a finite number


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def token_id_strings(ids: Sequence[int]) -> list[str]:
    """vLLM's return_tokens_as_token_ids spelling of tokens."""
    return [f"token_id:{t}" for t in ids]


def _strings(tokenizer: Tokenizer, ids: list[int], as_ids: bool) -> list[str]:
    return token_id_strings(ids) if as_ids else tokenizer.token_strings(ids)


def _ids_needing_strings(entries: Sequence[TokenLogprob | None], limit: int) -> list[int]:
    ids: set[int] = set()
    for entry in entries:
        if entry is not None:
            ids.add(entry.token_id)
            ids.update(t for t, _ in entry.top[:limit])
    return sorted(ids)


class CompletionLogprobsBuilder:
    """Accumulates the legacy `text_offset/token_logprobs/tokens/top_logprobs` lists for one choice.

    `text_offset[i]` is the character index in the returned text where token i's text starts. Tokens
    are bytes, not characters: a token that continues an incomplete UTF-8 character starts where that
    character starts. Offsets carry on across `build` calls, so streamed chunks continue each other.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        num_top: int,
        skip_special_tokens: bool = True,
        as_ids: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.skip_special_tokens = skip_special_tokens
        self.as_ids = as_ids
        self._base = 0  # characters before the generated text (an echoed prompt)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0  # complete characters of the generated tokens so far

    def build_prompt(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], prompt_text: str
    ) -> dict[str, list[Any]]:
        """Logprobs of an echoed prompt whose text is `prompt_text`; later tokens follow that text."""
        offsets = _prompt_offsets(self.tokenizer, token_ids, prompt_text)
        self._base = len(prompt_text)
        self._utf8.reset()
        self._chars = 0
        return self._lists(token_ids, entries, offsets)

    def build(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None
    ) -> dict[str, list[Any]]:
        """Logprobs for `token_ids` (entries[i] describes token_ids[i]; None -> no logprob)."""
        skipped = _skipped_special_ids(self.tokenizer)
        raws = self.tokenizer.token_bytes(list(token_ids))
        offsets = []
        for token_id, raw in zip(token_ids, raws, strict=True):
            offsets.append(self._base + self._chars)
            if self.skip_special_tokens and _is_skipped(self.tokenizer, token_id, skipped):
                continue
            self._chars += len(self._utf8.decode(bytes(raw)))
        return self._lists(token_ids, entries, offsets)

    def _lists(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprob | None] | None,
        offsets: list[int],
    ) -> dict[str, list[Any]]:
        entries = list(entries) if entries is not None else [None] * len(token_ids)
        needed = sorted(set(token_ids) | set(_ids_needing_strings(entries, self.num_top)))
        strings = dict(zip(needed, _strings(self.tokenizer, needed, self.as_ids), strict=True))
        out: dict[str, list[Any]] = {
            "text_offset": offsets[: len(entries)],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = strings[token_id]
            out["tokens"].append(token)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(entry.logprob))
            top = {strings[t]: finite(lp) for t, lp in entry.top[: self.num_top]}
            top.setdefault(token, finite(entry.logprob))  # the sampled token is always listed
            out["top_logprobs"].append(top)
        return out


# tokenizer -> {token id: whether decoding with skip_special_tokens drops it}, filled lazily
_SKIPPED_CACHE: weakref.WeakKeyDictionary[Any, dict[int, bool]] = weakref.WeakKeyDictionary()


def _skipped_special_ids(tokenizer: Tokenizer) -> dict[int, bool]:
    try:
        return _SKIPPED_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return {}


def _is_skipped(tokenizer: Tokenizer, token_id: int, cache: dict[int, bool]) -> bool:
    """A special token that decoding with skip_special_tokens leaves out of the text."""
    skipped = cache.get(token_id)
    if skipped is None:
        skipped = tokenizer.decode([token_id], skip_special_tokens=True) == "" and bool(
            tokenizer.decode([token_id], skip_special_tokens=False)
        )
        cache[token_id] = skipped
    return skipped


def _prompt_offsets(tokenizer: Tokenizer, token_ids: Sequence[int], text: str) -> list[int]:
    """Where each prompt token starts in `text` (the prompt as the client sent it, or as decoded).

    Tokens are matched against the text's bytes, so a special token the tokenizer added (a BOS that
    is not in the text) takes no room, and a leading space the text lacks (SentencePiece) is allowed.
    """
    data = text.encode("utf-8")
    chars_at = [0] * (len(data) + 1)  # complete characters within data[:i]
    position = 0
    for count, char in enumerate(text, start=1):
        width = len(char.encode("utf-8"))
        for k in range(1, width):
            chars_at[position + k] = count - 1
        position += width
        chars_at[position] = count
    skipped = _skipped_special_ids(tokenizer)
    offsets = []
    position = 0
    for token_id, raw_list in zip(token_ids, tokenizer.token_bytes(list(token_ids)), strict=True):
        offsets.append(chars_at[position])
        raw = bytes(raw_list)
        if data.startswith(raw, position):
            position += len(raw)
        elif raw.startswith(b" ") and data.startswith(raw[1:], position):
            position += len(raw) - 1
        elif not _is_skipped(tokenizer, token_id, skipped):
            position = min(position + len(raw), len(data))
    return offsets


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob], num_top: int, as_ids: bool = False
) -> list[dict[str, Any]]:
    """Chat format: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}] per sampled
    token (`as_ids`: each token "token_id:<id>", its bytes those of that string, as vLLM does)."""
    needed = _ids_needing_strings(entries, num_top)
    strings = dict(zip(needed, _strings(tokenizer, needed, as_ids), strict=True))
    if as_ids:
        raw = {t: list(strings[t].encode()) for t in needed}
    else:
        raw = dict(zip(needed, tokenizer.token_bytes(needed), strict=True))
    content = []
    for entry in entries:
        content.append(
            {
                "token": strings[entry.token_id],
                "logprob": finite(entry.logprob),
                "bytes": list(raw[entry.token_id]),
                "top_logprobs": [
                    {"token": strings[t], "logprob": finite(lp), "bytes": list(raw[t])}
                    for t, lp in entry.top[:num_top]
                ],
            }
        )
    return content


def prompt_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None] | None,
    num_top: int,
    as_ids: bool = False,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first: nothing precedes it) or
    {token id: {logprob, rank, decoded_token}} for the prompt's token and the top `num_top`."""
    entries = list(entries) if entries is not None else [None] * len(token_ids)
    needed = sorted(set(token_ids) | set(_ids_needing_strings(entries, num_top)))
    strings = dict(zip(needed, _strings(tokenizer, needed, as_ids), strict=True))
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        # The prompt's own token first, then the top ones (vLLM's order).
        position = {
            str(token_id): {
                "logprob": finite(entry.logprob),
                "rank": entry.rank,
                "decoded_token": strings[token_id],
            }
        }
        for rank, (t, lp) in enumerate(entry.top[:num_top], start=1):
            position.setdefault(
                str(t), {"logprob": finite(lp), "rank": rank, "decoded_token": strings[t]}
            )
        out.append(position)
    return out
