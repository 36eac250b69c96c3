"""Engine TokenLogprobs -> OpenAI's two logprob formats: legacy completions and chat (with bytes)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine import TokenLogprob

_FLOOR = -9999.0  # JSON has no -inf; OpenAI clients expect a finite number


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def _ids_needing_strings(entries: Sequence[TokenLogprob | None], limit: int) -> list[int]:
    ids: set[int] = set()
    for entry in entries:
        if entry is not None:
            ids.add(entry.token_id)
            ids.update(t for t, _ in entry.top[:limit])
    return sorted(ids)


class CompletionLogprobsBuilder:
    """Accumulates the legacy `text_offset/token_logprobs/tokens/top_logprobs` lists for one choice."""

    def __init__(self, tokenizer: Any, num_top: int, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.offset = text_offset

    def build(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None
    ) -> dict[str, list[Any]]:
        """Logprobs for `token_ids` (entries[i] describes token_ids[i]; None -> no logprob, the first prompt token)."""
        entries = list(entries) if entries is not None else [None] * len(token_ids)
        needed = sorted(set(token_ids) | set(_ids_needing_strings(entries, self.num_top)))
        strings = dict(zip(needed, self.tokenizer.token_strings(needed), strict=True))
        out: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for token_id, entry in zip(token_ids, entries, strict=False):
            token = strings[token_id]
            out["tokens"].append(token)
            out["text_offset"].append(self.offset)
            self.offset += len(token)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite(entry.logprob))
            top = {strings[t]: finite(lp) for t, lp in entry.top[: self.num_top]}
            top.setdefault(token, finite(entry.logprob))  # the sampled token is always listed
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(
    tokenizer: Any, entries: Sequence[TokenLogprob], num_top: int
) -> list[dict[str, Any]]:
    """Chat format: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}] per sampled token."""
    needed = _ids_needing_strings(entries, num_top)
    strings = dict(zip(needed, tokenizer.token_strings(needed), strict=True))
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
