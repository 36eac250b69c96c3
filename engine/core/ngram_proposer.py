"""N-gram (prompt lookup) proposer, torch-free: the continuation of the most recent earlier occurrence
of the longest suffix n-gram (between prompt_lookup_min and prompt_lookup_max tokens) of a sequence's
own prompt and output. An incremental index keeps each lookup O(max - min + 1), whatever the length."""

from __future__ import annotations


class NgramIndex:
    """For one token list that only grows: n -> {n-gram: position just after its latest occurrence},
    covering the n-grams that end before the list's last token (so the suffix never finds itself)."""

    __slots__ = ("min_n", "max_n", "tables", "num_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are in the tables

    def _catch_up(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the last token's n-grams are the query, not indexed yet
        for last in range(self.num_indexed, end):
            for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                # overwriting keeps the most recent occurrence
                self.tables[n - self.min_n][tuple(tokens[last - n + 1 : last + 1])] = last + 1
        self.num_indexed = max(self.num_indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix n-gram last time ([] if none)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        self._catch_up(tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            after = self.tables[n - self.min_n].get(tuple(tokens[size - n :]))
            if after is not None:
                return tokens[after : min(after + k, size)]
        return []


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The reference semantics, by a plain scan (tests compare NgramIndex with it)."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):  # most recent earlier occurrence first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : min(start + n + k, size)]
    return []
