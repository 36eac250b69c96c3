"""Suffix-decoding proposer (no torch, after Suffix Decoding, arXiv 2411.04975): suffix tries of
bounded depth over a sequence's own prompt and output, and over the recent outputs of other requests
(a bounded cache shared by the engine). The longest suffix of a sequence's tokens found in a trie
picks the continuation: from the matched node, the most frequent child, while the estimated chance
of the whole run (the product of each step's child count / node count) stays at least
`min_token_prob`, and at most `max_spec_factor` x the match length tokens. Repetitive agent and code
workloads (the same tool output, the same file, again) get long proposals; each costs O(depth) per
token fed and O(depth) dict look-ups per proposal, whatever the length of the sequence."""

from __future__ import annotations

from collections import OrderedDict

MAX_FEED_PER_STEP = (
    2048  # tokens a sequence's own trie takes in per proposal (about 20 ms at depth 24)
)


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0  # suffixes (start positions) whose path passes through this node
        self.children: dict[int, _Node] | None = None

    def child(self, token: int) -> _Node:
        children = self.children
        if children is None:
            children = self.children = {}
        node = children.get(token)
        if node is None:
            node = children[token] = _Node()
        return node


class SuffixTrie:
    """Every substring of at most `depth` tokens of the texts fed, as paths from the root, counted by
    how many start positions pass through each node. Texts grow token by token (`extend`); a text's
    contributions can be taken back whole (`remove`, for the shared cache's eviction)."""

    __slots__ = ("depth", "root")

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def extend(self, active: list[_Node], tokens: list[int]) -> None:
        """Append `tokens` to a text whose open paths (the nodes of its last depth - 1 starts,
        oldest first) are `active`; updates `active` in place."""
        depth = self.depth
        for token in tokens:
            self.root.count += 1
            active.append(self.root)
            for i, node in enumerate(active):
                nxt = node.child(token)
                nxt.count += 1
                active[i] = nxt
            if len(active) >= depth:
                del active[0]  # that start's path is `depth` long: complete

    def remove(self, tokens: list[int]) -> None:
        """Take back every path a text of `tokens` added (fed in one or more `extend` calls)."""
        depth = self.depth
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for token in tokens[start : start + depth]:
                assert node.children is not None
                nxt = node.children[token]
                nxt.count -= 1
                if nxt.count == 0:
                    del node.children[token]  # nothing else passes here: drop the subtree
                    break
                node = nxt

    def matches(self, context: list[int]) -> list[tuple[_Node, int]]:
        """(node, length) of each suffix of `context` of at most depth - 1 tokens (so one token at
        least can follow) that is a path here with a continuation, longest first."""
        found = []
        size = len(context)
        for length in range(min(self.depth - 1, size), 0, -1):
            node: _Node | None = self.root
            for token in context[size - length :]:
                children = node.children  # type: ignore[union-attr]
                node = children.get(token) if children is not None else None
                if node is None:
                    break
            if node is not None and node.children:
                found.append((node, length))
        return found

    @staticmethod
    def continuation(node: _Node, limit: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, at most `limit` tokens, while its estimated chance
        stays >= min_prob; and its score (the expected number of tokens accepted)."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and node.children:
            token, child = max(node.children.items(), key=lambda kv: kv[1].count)
            prob *= child.count / node.count
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return out, score


class SuffixCache:
    """The engine's shared trie of recent requests' outputs, bounded by `max_requests` (the oldest
    request's output is taken back when one more arrives), and the proposal rule over it and a
    sequence's own trie."""

    def __init__(
        self, depth: int, max_requests: int, max_spec_factor: float, min_token_prob: float
    ) -> None:
        self.depth = depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_requests = max_requests
        self.shared = SuffixTrie(depth)
        # seq_id -> (output tokens fed so far, open paths in the shared trie), oldest first
        self._outputs: OrderedDict[str, tuple[list[int], list[_Node]]] = OrderedDict()

    def add_output(self, seq_id: str, new_tokens: list[int]) -> None:
        """Feed a sequence's newly generated tokens to the shared trie (new sequences evict the
        oldest cached output beyond `max_requests`)."""
        if not new_tokens or self.max_requests == 0:
            return
        entry = self._outputs.get(seq_id)
        if entry is None:
            while len(self._outputs) >= self.max_requests:
                _, (old_tokens, _) = self._outputs.popitem(last=False)
                self.shared.remove(old_tokens)
            entry = self._outputs[seq_id] = ([], [])
        tokens, active = entry
        self.shared.extend(active, new_tokens)
        tokens.extend(new_tokens)

    @property
    def num_cached_requests(self) -> int:
        return len(self._outputs)

    def propose(self, own: SuffixTrie, context: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `context`: the best-scoring continuation over its matches in its
        own trie and in the shared one (a long match leaves less depth below it, so shorter ones
        are tried too, until one gives k tokens)."""
        best: list[int] = []
        best_score = 0.0
        for trie in (own, self.shared):
            for node, length in trie.matches(context):
                limit = min(k, max(1, int(self.max_spec_factor * length)), self.depth - length)
                tokens, score = SuffixTrie.continuation(node, limit, self.min_token_prob)
                if score > best_score:
                    best, best_score = tokens, score
                if len(tokens) == k:
                    break  # shorter matches: no longer proposal, and less context behind it
        return best


class SequenceSuffix:
    """One sequence's own trie over its prompt and output, fed lazily: it holds the tokens before
    the sequence's last one, so a suffix never matches itself, only earlier occurrences. New output
    tokens also go to the shared cache."""

    __slots__ = ("trie", "active", "num_fed", "num_prompt", "num_shared")

    def __init__(self, depth: int, num_prompt_tokens: int) -> None:
        self.trie = SuffixTrie(depth)
        self.active: list[_Node] = []
        self.num_fed = 0  # tokens[:num_fed] are in the own trie
        self.num_prompt = num_prompt_tokens
        self.num_shared = num_prompt_tokens  # tokens[num_prompt:num_shared] went to the cache

    def propose(self, cache: SuffixCache, seq_id: str, tokens: list[int], k: int) -> list[int]:
        end = len(tokens) - 1
        if end > self.num_fed:  # a long prompt is indexed over several steps, not in one stall
            upto = min(end, self.num_fed + MAX_FEED_PER_STEP)
            self.trie.extend(self.active, tokens[self.num_fed : upto])
            self.num_fed = upto
        if end > self.num_shared:  # the cache too lags one token: no self-matches there either
            cache.add_output(seq_id, tokens[self.num_shared : end])
            self.num_shared = end
        if k <= 0:
            return []
        return cache.propose(self.trie, tokens, k)
