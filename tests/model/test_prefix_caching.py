"""Automatic prefix caching on the real SmolLM2 (float32): identical greedy outputs with caching on
and off, cached_tokens equal to the whole shared blocks, eviction under a small pool, and multi-turn
chats reusing the first turn's prompt *and* answer."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

BLOCK = 16
DOC = (
    "Kvserve is a small inference server. It keeps every sequence's attention keys and values in "
    "fixed-size blocks, schedules prompt chunks and decode tokens under one token budget per step, "
    "and reuses blocks whose tokens it has already seen. The harbour town of Port Ellis has three "
    "bridges, a lighthouse painted green, and a market that opens at six every Tuesday. "
) * 3
QUESTIONS = [
    "What colour is the lighthouse?",
    "How many bridges are there?",
    "When does the market open?",
    "What does kvserve reuse?",
]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_cached(cached_source: list[int], prompt: list[int]) -> int:
    """Whole blocks of the shared prefix, always leaving the prompt's last token to compute."""
    return min(common_prefix(cached_source, prompt), len(prompt) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def llm_on(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", block_size=BLOCK, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def llm_off(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", block_size=BLOCK, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(llm_on):
    tok = llm_on.tokenizer
    return [tok.encode(f"{DOC}\nQuestion: {q}\nAnswer:") for q in QUESTIONS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def test_outputs_identical_with_caching_on_and_off(llm_on, llm_off, prompts):
    first = llm_on.generate(prompts[:1], GREEDY)  # warms the cache with the document
    rest = llm_on.generate(prompts[1:], GREEDY)
    on = first + rest
    off = llm_off.generate(prompts, GREEDY)
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert all(o.num_cached_tokens == 0 for o in off)
    for out, prompt in zip(rest, prompts[1:], strict=True):
        assert out.num_cached_tokens == expected_cached(prompts[0], prompt)
        assert out.num_cached_tokens >= len(prompts[0]) // 2  # the document was reused
    totals = llm_on.engine.totals
    assert totals.prefix_cache_hits == sum(o.num_cached_tokens for o in rest)


def test_second_chat_turn_reuses_prompt_and_answer(llm_on):
    tok = llm_on.tokenizer
    messages = [
        {"role": "system", "content": "You are a concise assistant. " + DOC},
        {"role": "user", "content": "Describe Port Ellis in one sentence."},
    ]
    turn1 = tok.apply_chat_template(messages)
    out1 = llm_on.generate([turn1], SamplingParams(temperature=0.0, max_tokens=24))[0]
    answer = out1.outputs[0]
    messages += [
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "And what opens on Tuesdays?"},
    ]
    turn2 = tok.apply_chat_template(messages)
    out2 = llm_on.generate([turn2], GREEDY)[0]
    # Only tokens whose KV was computed can be cached: the prompt and all but the last sampled token.
    computed = turn1 + answer.token_ids[:-1]
    assert out2.num_cached_tokens == expected_cached(computed, turn2)
    assert out2.num_cached_tokens > len(turn1) // BLOCK * BLOCK  # blocks of the answer were reused
    fresh = LLM(str(llm_on.engine.model_dir), dtype="float32", enable_prefix_caching=False)
    assert fresh.generate([turn2], GREEDY)[0].outputs[0].token_ids == out2.outputs[0].token_ids


def test_eviction_under_a_small_pool_keeps_outputs_correct(smollm2_dir, llm_off, prompts):
    # Room for about two requests: cached blocks are evicted and re-filled constantly.
    small = LLM(
        str(smollm2_dir),
        dtype="float32",
        block_size=BLOCK,
        num_blocks=2 * (len(prompts[0]) // BLOCK + 3),
    )
    expected = [o.outputs[0].token_ids for o in llm_off.generate(prompts, GREEDY)]
    for round_ in range(2):
        outs = small.generate(prompts[::-1] if round_ else prompts, GREEDY)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == (expected[::-1] if round_ else expected)
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


class _CollidingKey:
    """A block key whose hash is the same for every block: only exact equality can tell them apart."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CollidingKey) and self.key == other.key


def test_forced_hash_collisions_never_reuse_another_prompts_kv(smollm2_dir, llm_off, monkeypatch):
    from engine.core import kv_cache_manager

    monkeypatch.setattr(
        kv_cache_manager, "block_key", lambda parent, tokens: _CollidingKey((parent, tokens))
    )
    llm = LLM(str(smollm2_dir), dtype="float32", block_size=BLOCK)
    tok = llm.tokenizer
    tenant_a = tok.encode(f"{DOC}\nQuestion: {QUESTIONS[0]}\nAnswer:")
    tenant_b = tok.encode("Write a short poem about the sea at night, with stars. " * 8)
    assert len(tenant_b) >= 4 * BLOCK and common_prefix(tenant_a, tenant_b) < BLOCK
    first_a = llm.generate([tenant_a], GREEDY)[0]
    b = llm.generate([tenant_b], GREEDY)[0]
    assert b.num_cached_tokens == 0  # every key collided with tenant A's, none matched
    (b_alone,) = llm_off.generate([tenant_b], GREEDY)
    assert b.outputs[0].token_ids == b_alone.outputs[0].token_ids
    # A true shared prefix is still found among the colliding keys.
    again_a = llm.generate([tenant_a], GREEDY)[0]
    assert again_a.num_cached_tokens == expected_cached(tenant_a, tenant_a) > 0
    assert again_a.outputs[0].token_ids == first_a.outputs[0].token_ids
