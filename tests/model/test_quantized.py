"""Weight-only int8/int4 SmolLM2 against the same model in bf16: greedy continuations mostly agree and
the first token's log-probabilities stay close (tolerances measured on the bundled model)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: I love reading books in the garden.",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
)
MAX_TOKENS = 12
# (min mean fraction of the continuation identical before the first differing token,
#  max |logprob difference| of the bf16 model's first token) per method.
LIMITS = {"int8": (0.8, 0.2), "int4": (0.4, 0.4)}


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20)
    results = []
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        first = completion.logprobs[0]  # the first generated position's top-20
        results.append((list(completion.token_ids), first))
    return results


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="bfloat16", max_num_seqs=8)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    return prompts, _run(llm, prompts)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_greedy_tokens_and_logprobs_stay_close_to_bf16(smollm2_dir, reference, method):
    prompts, ref = reference
    llm = LLM(str(smollm2_dir), dtype="bfloat16", max_num_seqs=8, quantization=method)
    got = _run(llm, prompts)
    agree = [_common_prefix(r[0], g[0]) / MAX_TOKENS for r, g in zip(ref, got, strict=True)]
    diffs = []
    for (ref_tokens, ref_first), (_, got_first) in zip(ref, got, strict=True):
        ref_lp = _sampled_logprob(ref_first, ref_tokens[0])
        got_lp = _top_logprob_of(got_first, ref_tokens[0])
        diffs.append(abs(ref_lp - got_lp))
    print(f"{method}: agreement {agree} first-token |dlogprob| {diffs}")
    min_agree, max_diff = LIMITS[method]
    assert sum(a == 1.0 for a in agree) >= 1  # not a different model altogether
    assert sum(agree) / len(agree) >= min_agree
    assert max(diffs) <= max_diff
    # the first greedy token is the bf16 model's on every prompt
    assert all(r[0][0] == g[0][0] for r, g in zip(ref, got, strict=True))


def _sampled_logprob(entry, token_id: int) -> float:
    assert entry.token_id == token_id
    return entry.logprob


def _top_logprob_of(entry, token_id: int) -> float:
    if entry.token_id == token_id:
        return entry.logprob
    for top_id, logprob in entry.top:
        if top_id == token_id:
            return logprob
    return float("-inf")


def test_quantization_shrinks_the_served_weights(smollm2_dir):
    from engine.models.loader import load_model
    from engine.models.quantization import quantize_model

    sizes = {}
    for method in (None, "int8", "int4"):
        model = load_model(smollm2_dir, "bfloat16", "cpu").model
        sizes[method] = quantize_model(model, method)
    # Embeddings stay bf16 (lookups), so the totals shrink by less than 2x / 4x.
    assert sizes["int8"] < 0.75 * sizes[None]
    assert sizes["int4"] < 0.75 * sizes["int8"]
    with torch.no_grad():
        assert torch.isfinite(
            model.compute_logits(torch.randn(2, model.hidden_size, dtype=torch.bfloat16))
        ).all()
