"""The whole engine on the real SmolLM2 (float32, CPU) against transformers: greedy tokens under chunked
prefill mixed with decodes and under heavy preemption, logprobs, prompt logprobs, seeded sampling."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

MAX_TOKENS = 10
WORDS = (
    "the river carried old stories past quiet towns while engineers measured bridges and children "
    "counted boats under a pale sky that promised rain before the market closed"
).split()


def make_prompts(tokenizer) -> list[list[int]]:
    """20 prompts from 1 to over 512 tokens, mixing chat-formatted, prose and code."""
    rng = random.Random(7)
    prompts = [[tokenizer.encode("Hello")[0]]]
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Q: What is 12 times 12?\nA:",
        "Translate to French: I love reading books in the garden.",
    ]
    prompts += [tokenizer.encode(t) for t in texts]
    prompts.append(
        tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    )
    for n_words in (8, 20, 40, 60, 90, 120, 160, 200, 250, 300, 350, 420, 480, 560):
        prompts.append(tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(n_words))))
    assert len(prompts) == 20
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) > 512
    return prompts


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    # A small token budget: long prompts are chunked and share steps with other requests' decodes.
    return LLM(
        str(smollm2_dir),
        dtype="float32",
        quantization="none",
        max_num_batched_tokens=96,
        max_num_seqs=16,
    )


@pytest.fixture(scope="module")
def prompts(llm):
    return make_prompts(llm.tokenizer)


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """transformers greedy tokens and the raw logprobs of each generated token."""
    results = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf_model.generate(
                ids,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(p) :].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.logits]
            results.append((tokens, logprobs))
    return results


def greedy(**kw) -> SamplingParams:
    # EOS ends both kvserve and transformers' generate (its token is the last one reported).
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


def test_greedy_equals_transformers_with_chunked_prefill(llm, prompts, reference):
    outs = llm.generate(prompts, greedy())
    for i, (out, (ref_tokens, _)) in enumerate(zip(outs, reference, strict=True)):
        assert out.outputs[0].token_ids == ref_tokens, (
            f"prompt {i} ({len(prompts[i])} tokens) diverged"
        )
        expected = "length" if len(ref_tokens) == MAX_TOKENS else "stop"
        assert out.outputs[0].finish_reason == expected


def test_greedy_equals_transformers_under_preemption(smollm2_dir, prompts, reference):
    # 50 blocks of 16 tokens hold the longest request (~590 tokens, 37 blocks) but not many at once.
    small = LLM(
        str(smollm2_dir),
        dtype="float32",
        quantization="none",
        max_num_batched_tokens=128,
        num_blocks=50,
    )
    outs = small.generate(prompts, greedy())
    assert small.engine.totals.num_preemptions > 0, "the pool was meant to force preemptions"
    for i, (out, (ref_tokens, _)) in enumerate(zip(outs, reference, strict=True)):
        assert out.outputs[0].token_ids == ref_tokens, f"prompt {i} diverged after preemption"
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks  # nothing leaked


def test_sampled_token_logprobs_match_transformers(llm, prompts, reference):
    picks = [0, 2, 6, 19]
    outs = llm.generate([prompts[i] for i in picks], greedy(logprobs=5))
    for i, out in zip(picks, outs, strict=True):
        ref_tokens, ref_logprobs = reference[i]
        lps = out.outputs[0].logprobs
        assert lps is not None and len(lps) == len(ref_tokens)
        for step, (lp, ref) in enumerate(zip(lps, ref_logprobs[: len(lps)], strict=True)):
            assert lp.token_id == ref_tokens[step]
            assert abs(lp.logprob - ref[lp.token_id].item()) < 1e-3
            assert lp.rank == 1  # greedy picks the top token
            top_ids = [t for t, _ in lp.top]
            assert top_ids == torch.topk(ref, 5).indices.tolist()
            for token_id, value in lp.top:
                assert abs(value - ref[token_id].item()) < 1e-3


def test_prompt_logprobs_match_transformers(llm, hf_model, prompts):
    prompt = prompts[12]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        assert entry.token_id == prompt[pos]
        assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-3
        assert len(entry.top) == 3


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(llm, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompts[3]], params)[0].outputs[0].token_ids
    noise = [
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=None) for _ in range(6)
    ]
    batch = llm.generate(prompts[3:10], [params, *noise])
    assert batch[0].outputs[0].token_ids == alone
    assert llm.generate([prompts[3]], params)[0].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_and_differ(llm, prompts):
    prompt = prompts[15][::-1]  # a prompt no earlier test has cached
    hits_before = llm.engine.totals.prefix_cache_hits
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.num_cached_tokens == 0  # the leader computed the prompt
    # The two followers found the leader's prompt blocks in the prefix cache instead of recomputing.
    whole_blocks = (len(prompt) - 1) // 16 * 16
    assert llm.engine.totals.prefix_cache_hits - hits_before == 2 * whole_blocks
