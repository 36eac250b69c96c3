"""Scoring on the real SmolLM2 (float32, CPU) against transformers: each choice's logprob is
log P(choice | context) within 1e-4 with prefix caching on and off, under a small token budget, under
preemption; the context is computed once; is_greedy agrees with greedy generation."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams, summarize_scores

BLOCK = 16
WORDS = (
    "a quiet harbor town kept its lighthouse burning while sailors traded maps and stories of "
    "distant islands where the wind sang through tall grass"
).split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(smollm2_dir):
    """(context ids, [choice ids]): contexts around block boundaries, 3 multi-token choices each."""
    from engine import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_dir)
    rng = random.Random(11)
    out = []
    for n_words in (3, 12, 40, 90):
        context = tok.encode(text(rng, n_words))
        for length in (BLOCK + 1, 2 * BLOCK):  # last token alone in a block / a full last block
            if len(context) < length <= len(context) + 8:
                context = (context + context)[:length]
        choices = [tok.encode(" " + text(rng, k), add_special_tokens=False) for k in (2, 5, 9)]
        out.append((context, choices))
    out.append(((out[0][0] * 5)[: 2 * BLOCK], out[1][1]))  # exactly two full blocks
    assert all(len(c) >= 2 for _, choices in out for c in choices)
    return out


def reference(hf_model, context: list[int], choice: list[int]) -> tuple[list[float], list[int]]:
    """Per-token log P(choice[j] | context, choice[:j]) and each position's argmax, from transformers."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([context + choice])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(context) - 1 : -1], -1)  # [len(choice), vocab]
    chosen = logprobs.gather(1, torch.tensor(choice).unsqueeze(1)).squeeze(1)
    return chosen.tolist(), logprobs.argmax(-1).tolist()


def score_all(llm: LLM, cases, top: int = 0, generations: list[list[int]] = ()):
    """Add every case at once (they share steps with each other and with greedy `generations` that
    grow as they decode), run to completion; ScoreResults in order."""
    engine = llm.engine
    computed = 0
    for i, prompt in enumerate(generations):
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        engine.add_request(f"g{i}", prompt, params)
    for i, (context, choices) in enumerate(cases):
        engine.add_score_request(f"s{i}", context, choices, top)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        computed += engine.last_step.num_batched_tokens if engine.last_step else 0
    results = [
        summarize_scores(finals[f"s{i}"], [""] * len(c), "sum", top)
        for i, (_, c) in enumerate(cases)
    ]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing leaked
    return results, computed


def assert_matches(hf_model, cases, results) -> None:
    for (context, choices), result in zip(cases, results, strict=True):
        assert len(result.choices) == len(choices)
        for choice, scored in zip(choices, result.choices, strict=True):
            ref, _ = reference(hf_model, context, choice)
            assert scored.token_ids == choice and scored.num_tokens == len(choice)
            assert abs(scored.logprob - sum(ref)) < 1e-4, (len(context), len(choice))
            for got, want in zip(scored.token_logprobs, ref, strict=True):
                assert abs(got - want) < 1e-4
        assert abs(sum(c.probability for c in result.choices) - 1.0) < 1e-9


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_scores_equal_transformers_under_a_small_token_budget(
    smollm2_dir, hf_model, cases, prefix_caching
):
    llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        quantization="none",  # exact float32 weights, as transformers runs them
        max_num_batched_tokens=24,  # contexts are chunked; choices share steps with other requests
        enable_prefix_caching=prefix_caching,
    )
    results, computed = score_all(llm, cases)
    assert_matches(hf_model, cases, results)
    # Each context is computed once (its followers share its blocks by reference, caching or not);
    # a follower recomputes at most the context's last partial block before its own tokens.
    contexts = sum(len(ctx) for ctx, _ in cases)
    choice_tokens = sum(len(c) for _, choices in cases for c in choices)
    followers = sum(len(choices) - 1 for _, choices in cases)
    assert contexts + choice_tokens <= computed <= contexts + choice_tokens + followers * BLOCK
    # Scoring the same contexts again: with prefix caching they come from the cache.
    again, _ = score_all(llm, cases[:2])
    assert_matches(hf_model, cases[:2], again)
    assert (again[1].num_cached_tokens > 0) == prefix_caching


def test_scores_equal_transformers_under_preemption(smollm2_dir, hf_model, cases):
    # 10 blocks of 16 tokens: the longest case fits alone, not beside growing generations.
    llm = LLM(
        str(smollm2_dir),
        dtype="float32",
        quantization="none",
        max_num_batched_tokens=64,
        num_blocks=10,
    )
    assert max(len(ctx) + max(map(len, ch)) for ctx, ch in cases) <= 10 * BLOCK
    generations = [cases[3][0][: 20 + i] for i in range(3)]
    results, _ = score_all(llm, cases * 2, generations=generations)
    assert llm.engine.totals.num_preemptions > 0, "the pool was meant to force preemptions"
    assert_matches(hf_model, cases * 2, results)


def test_is_greedy_agrees_with_greedy_generation(smollm2_dir, hf_model):
    llm = LLM(str(smollm2_dir), dtype="float32", quantization="none")
    context = llm.tokenizer.encode("The three primary colors are red, yellow and")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    generated = llm.generate([context], greedy)[0].outputs[0].token_ids
    other = generated[:3] + [generated[3] + 1] + generated[4:]
    result = llm.score(context, [generated, other, generated[:2]], top_logprobs=5)
    assert [c.is_greedy for c in result.choices] == [True, False, True]
    _, argmax = reference(hf_model, context, other)
    assert other[3] != argmax[3]
    # top_logprobs: the most likely first tokens after the context, as transformers ranks them.
    with torch.inference_mode():
        last = torch.log_softmax(hf_model(torch.tensor([context])).logits[0, -1].float(), -1)
    assert [t for t, _ in result.top_logprobs] == torch.topk(last, 5).indices.tolist()
    assert result.top_logprobs[0][0] == generated[0]


def test_text_choices_follow_the_lm_eval_split_and_chat_scores_replies(smollm2_dir, hf_model):
    llm = LLM(str(smollm2_dir), dtype="float32", quantization="none")
    tok = llm.tokenizer
    # The context's trailing space moves to the continuation, as lm-evaluation-harness does.
    result = llm.score("The capital of France is ", ["Paris", "Rome is not"], normalize="mean")
    context = tok.encode("The capital of France is")
    for choice, text in zip(result.choices, ["Paris", "Rome is not"], strict=True):
        whole = tok.encode("The capital of France is " + text)
        assert choice.token_ids == whole[len(context) :] and choice.text == text
        assert abs(choice.logprob - sum(reference(hf_model, context, choice.token_ids)[0])) < 1e-4
    means = [c.mean_logprob for c in result.choices]
    assert result.best.index == means.index(max(means))
    # Chat: the choices are assistant replies; include_end_of_turn also scores <|im_end|>.
    messages = [{"role": "user", "content": "Is water wet? Answer yes or no."}]
    chat = llm.score(None, ["Yes", "No"], messages=messages, include_end_of_turn=True)
    context = tok.apply_chat_template(messages, add_generation_prompt=True)
    for choice in chat.choices:
        assert choice.token_ids[-1] == 2  # <|im_end|>
        ref, _ = reference(hf_model, context, choice.token_ids)
        assert abs(choice.logprob - sum(ref)) < 1e-4
