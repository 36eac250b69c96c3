"""The suffix proposer: its config (vLLM's suffix_decoding_* keys), that every proposal is a real
continuation of an earlier occurrence of the context's suffix, the longest match and most frequent
continuation win, other requests' outputs are proposed from, and the shared cache's eviction takes a
request's paths back whole."""

from __future__ import annotations

import random

import pytest

from engine.core.request import RequestGroup, Sequence
from engine.core.sampling_params import SamplingParams
from engine.core.spec_config import SUFFIX_MAX_TREE_DEPTH, SpeculativeConfig
from engine.core.speculator import Speculator
from engine.core.suffix_proposer import SequenceSuffix, SuffixCache, SuffixTrie


def test_vllm_suffix_config():
    c = SpeculativeConfig.parse('{"method": "suffix"}')
    assert c is not None and c.method == "suffix"
    assert c.num_speculative_tokens == c.suffix_decoding_max_tree_depth == SUFFIX_MAX_TREE_DEPTH
    c = SpeculativeConfig.parse(
        {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 16,
         "suffix_decoding_max_cached_requests": 4, "suffix_decoding_max_spec_factor": 2.0,
         "suffix_decoding_min_token_prob": 0.3, "disable_by_batch_size": 8}
    )  # fmt: skip
    assert c is not None
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth) == (8, 16)
    assert c.suffix_decoding_max_cached_requests == 4
    assert (c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (2.0, 0.3)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "in \\[2, 1024\\]"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "non-negative"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "positive number"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "in \\[0, 1\\]"),
        ({"method": "suffix", "prompt_lookup_min": 2}, "not apply to method suffix"),
        ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
         "not apply to method ngram"),
    ],
)  # fmt: skip
def test_bad_suffix_configs_fail_clearly(value, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(value)


def _occurs_after(text: list[int], pattern: list[int], continuation: list[int]) -> bool:
    n, m = len(pattern), len(continuation)
    return any(
        text[i : i + n] == pattern and text[i + n : i + n + m] == continuation
        for i in range(len(text) - n - m + 1)
    )


def test_proposals_continue_an_earlier_occurrence_of_the_suffix():
    rng = random.Random(0)
    proposed = 0
    for trial in range(150):
        vocab = rng.choice([2, 3, 6, 20])
        depth = rng.randint(2, 8)
        cache = SuffixCache(depth, 0, rng.choice([1.0, 3.0]), rng.choice([0.0, 0.2]))
        own = SequenceSuffix(depth, 0)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        for _ in range(30):
            out = own.propose(cache, "s", tokens, rng.randint(1, 6))
            if out:
                proposed += 1
                earlier = tokens[:-1]  # the last token's own occurrence is not a match
                assert any(
                    _occurs_after(earlier, tokens[len(tokens) - n :], out) for n in range(1, depth)
                ), (trial, tokens, out)
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
    assert proposed > 500


def test_longest_match_and_most_frequent_continuation():
    cache = SuffixCache(8, 0, 4.0, 0.0)
    #        ... 1 2 -> 7 once, 2 -> 5 twice; the context ends in 1 2
    tokens = [1, 2, 7, 7, 3, 2, 5, 4, 2, 5, 4, 1, 2]
    assert SequenceSuffix(8, 0).propose(cache, "a", tokens, 3) == [7, 7, 3]  # longest: [1, 2]
    assert SequenceSuffix(8, 0).propose(cache, "b", tokens[2:], 2) == [5, 4]  # only [2] matches
    # 2 -> 5 twice, 2 -> 7 once: the run's chance 2/3 passes a min prob of 0.6, not one of 0.7
    text = [2, 5, 2, 5, 2, 7, 2]
    assert SequenceSuffix(8, 0).propose(SuffixCache(8, 0, 4.0, 0.6), "d", text, 1) == [5]
    assert SequenceSuffix(8, 0).propose(SuffixCache(8, 0, 4.0, 0.7), "e", text, 1) == []
    # the proposal is at most max_spec_factor x the match length
    assert SequenceSuffix(8, 0).propose(SuffixCache(8, 0, 1.0, 0.0), "c", tokens, 5) == [7, 7]


def test_other_requests_outputs_are_proposed_and_evicted():
    cache = SuffixCache(16, 2, 4.0, 0.1)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    first = SequenceSuffix(16, 2)
    first.propose(cache, "a", [1, 2, *answer, 0], 4)  # its output, lagging one token, is cached
    assert cache.num_cached_requests == 1
    # another request whose own tokens never held the answer: the cache proposes it
    other = SequenceSuffix(16, 1)
    assert other.propose(cache, "b", [9, 40, 41], 5) == [42, 43, 44, 45, 46]
    for i in range(2):  # two newer outputs push the first one out
        SequenceSuffix(16, 0).propose(cache, f"x{i}", [60 + i, 61, 62], 2)
    assert cache.num_cached_requests == 2
    assert SequenceSuffix(16, 1).propose(cache, "c", [9, 40, 41], 5) == []


def test_eviction_takes_every_path_back():
    rng = random.Random(1)
    trie = SuffixTrie(6)
    texts = [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    for text in texts:
        active: list = []
        for i in range(0, len(text), 3):  # fed in pieces, as a sequence grows
            trie.extend(active, text[i : i + 3])
    for text in texts:
        trie.remove(text)
    assert trie.root.count == 0 and not trie.root.children


class _CheapRows:
    """A cost model under which every draft the proposer finds pays."""

    def verify_cost(self, batch_size: int, num_drafts: int) -> float:
        return 0.01 * num_drafts

    def draft_cost(self, batch_size: int, num_forwards: int) -> float:
        return 0.0


def test_speculator_uses_the_suffix_proposer():
    config = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 6})
    assert config is not None
    spec = Speculator(config, max_model_len=1000, cost=_CheapRows())
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 1, 5, 6, 7]
    group = RequestGroup("r", None, list(prompt), SamplingParams(max_tokens=50), 50)
    seq = Sequence("r/0", group, 0, list(prompt), len(prompt))
    group.seqs.append(seq)
    assert spec.propose(seq, budget=10) == [8, 9, 10]  # match of 3: at most 3 (factor 1.0)
    seq.token_ids += [8, 9]
    assert spec.propose(seq, budget=10) == [10, 11, 12, 1, 5]  # match 5, and room for 5


def test_a_long_prompt_is_indexed_over_several_steps(monkeypatch):
    from engine.core import suffix_proposer

    monkeypatch.setattr(suffix_proposer, "MAX_FEED_PER_STEP", 4)
    cache = SuffixCache(8, 0, 4.0, 0.0)
    own = SequenceSuffix(8, 0)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    assert own.propose(cache, "s", tokens, 3) == [3, 4]  # 4 tokens indexed: [1, 2] -> 3, 4 only
    assert own.num_fed == 4
    own.propose(cache, "s", tokens, 3)
    assert own.propose(cache, "s", tokens, 3) == [3, 4, 5]  # caught up
    assert own.num_fed == len(tokens) - 1
