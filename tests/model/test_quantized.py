"""Quantized SmolLM2 against the same model in float32: int8 (the CPU default) greedy continuations
mostly agree with float32 and are identical alone and inside any batch; int4 stays close; the served
weights shrink."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.int8_linear import fbgemm_available

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="fbgemm int8 kernels (x86) only")

TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: I love reading books in the garden.",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "List three fruits:\n1.",
    "The quick brown fox",
)
MAX_TOKENS = 16


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="float32", quantization="none", max_num_seqs=8)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    return prompts, _greedy(llm, prompts)


@pytest.fixture(scope="module")
def int8_llm(smollm2_dir):
    # The default on an x86 CPU: auto -> int8 weights, float32 activations.
    llm = LLM(str(smollm2_dir), max_num_seqs=8, max_num_batched_tokens=24)
    assert llm.engine.dtype == torch.float32
    return llm


def test_default_is_int8_and_greedy_tokens_stay_close_to_float32(int8_llm, reference):
    from engine.models.int8_linear import Int8Embedding, Int8Weight

    model = int8_llm.engine.model
    assert isinstance(model.layers[0].mlp.down_weight, Int8Weight)
    assert isinstance(model.lm_head_weight, Int8Weight)  # the tied head ...
    assert isinstance(model.embed_tokens, Int8Embedding)  # ... and its embedding share int8 rows
    prompts, ref = reference
    got = _greedy(int8_llm, prompts)
    prefixes = [_common_prefix(r, g) for r, g in zip(ref, got, strict=True)]
    print(f"int8 vs float32 matching prefixes (of {MAX_TOKENS}): {prefixes}")
    assert sum(p == MAX_TOKENS for p in prefixes) >= len(prompts) // 2
    assert sum(prefixes) / len(prefixes) >= 0.6 * MAX_TOKENS
    assert sum(p > 0 for p in prefixes) >= len(prompts) - 1  # the first token agrees


def test_int8_greedy_tokens_are_the_same_alone_and_in_any_batch(int8_llm, reference):
    prompts, _ = reference
    alone = [_greedy(int8_llm, [p])[0] for p in prompts]
    # All at once (a 24-token budget chunks prefills and mixes them with decodes), and shuffled.
    assert _greedy(int8_llm, prompts) == alone
    order = [5, 2, 7, 0, 3, 1, 6, 4]
    assert _greedy(int8_llm, [prompts[i] for i in order]) == [alone[i] for i in order]


def test_int4_stays_close_to_float32(smollm2_dir, reference):
    from engine.models.quantization import quantize_model

    # Packed after loading: start-up refuses int4 where its kernel is slower than int8 (AVX2).
    llm = LLM(str(smollm2_dir), dtype="float32", quantization="none", max_num_seqs=8)
    quantize_model(llm.engine.model, "int4")
    prompts, ref = reference
    got = _greedy(llm, prompts[:4])
    prefixes = [_common_prefix(r, g) for r, g in zip(ref, got, strict=False)]
    print(f"int4 vs float32 matching prefixes (of {MAX_TOKENS}): {prefixes}")
    assert sum(p > 0 for p in prefixes) >= 3
    assert max(prefixes) >= 4


def test_quantization_shrinks_the_served_weights(smollm2_dir):
    from engine.models.loader import load_model
    from engine.models.quantization import quantize_model

    sizes = {}
    for method in (None, "int8"):
        model = load_model(smollm2_dir, "float32", "cpu").model
        sizes[method] = quantize_model(model, method)
    # int8 everywhere, the embedding included: 540 MB -> 167 MB (the lookup table is an int8 copy of
    # the tied head's values, beside fbgemm's packed head)
    assert sizes["int8"] < 0.32 * sizes[None]
    with torch.inference_mode():
        assert torch.isfinite(model.compute_logits(torch.randn(2, model.hidden_size))).all()
