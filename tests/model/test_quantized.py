"""Block-quantized SmolLM2 against the same model in float32. The CPU default for the bundled GGUF
(`--quantization auto` -> gguf where the AVX2 block kernels run) serves the file's own Q4_1 / Q8_0
blocks, bitwise the weights the float32 model dequantized; its greedy continuations stay close to
float32 and are identical alone, inside any batch, with prefills chunked any way and after
prefix-cache hits; int8 and int4 packed from the float weights stay close too; the served weights
shrink."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.kernels.kv_dtype import bf16_attention_runs
from engine.models.block_quant import BlockQ4Weight, BlockQ8Weight
from engine.models.cpu_features import detect_cpu
from engine.models.quantization import BlockEmbedding, weight_bytes

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is 12 times 12?\nA:",
    "Translate to French: I love reading books in the garden.",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
    "List three fruits:\n1.",
    # longer than a 24-token step budget: its prefill is chunked there, alone and mixed alike
    "In the beginning of the nineteenth century, the city grew quickly as new factories along the "
    "river drew workers from the surrounding farms, and the old walls were torn down to make room",
)
MAX_TOKENS = 16
# Whole prefills, no prefix cache: every prompt's prefill runs the same way alone and in a batch.
OPTIONS = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "enable_prefix_caching": False}


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _prefixes(llm: LLM, reference: tuple[list[list[int]], list[list[int]]], name: str) -> list[int]:
    prompts, ref = reference
    got = _greedy(llm, prompts)
    prefixes = [_common_prefix(r, g) for r, g in zip(ref, got, strict=True)]
    print(f"{name} vs float32 matching prefixes (of {MAX_TOKENS}): {prefixes}")
    return prefixes


@pytest.fixture(scope="module")
def float_llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", quantization="none", **OPTIONS)


@pytest.fixture(scope="module")
def reference(float_llm):
    prompts = [float_llm.tokenizer.encode(t) for t in TEXTS]
    assert max(len(p) for p in prompts) > 24
    return prompts, _greedy(float_llm, prompts)


@pytest.fixture(scope="module")
def default_llm(smollm2_dir):
    # The defaults: auto quantization, auto dtype (float32 activations).
    return LLM(str(smollm2_dir), **OPTIONS)


@pytest.fixture(scope="module")
def gguf_llm(default_llm, smollm2_dir):
    """The bundled GGUF's own blocks: the default where the AVX2 kernels run, else asked for."""
    if detect_cpu().block_kernels:
        return default_llm
    return LLM(str(smollm2_dir), quantization="gguf", **OPTIONS)


def test_the_default_on_this_cpu(default_llm):
    model = default_llm.engine.model
    assert default_llm.engine.dtype == torch.float32
    if detect_cpu().block_kernels:
        assert isinstance(model.layers[0].mlp.down_weight, BlockQ4Weight)  # the file's Q4_1
        assert isinstance(model.lm_head_weight, BlockQ8Weight)  # its Q8_0 token_embd ...
        assert isinstance(model.embed_tokens, BlockEmbedding)  # ... shared by lookups and head
        # block weights: a 16-bit KV cache, bfloat16 where the bf16 attention runs in hardware
        sixteen = torch.bfloat16 if bf16_attention_runs() else torch.float16
        assert default_llm.engine.kv_dtype == sixteen
        assert all(c.dtype == sixteen for c in default_llm.engine.runner.kv_caches)
        assert default_llm.engine.target_step_ms == 200  # and the step-time budget
        assert default_llm.engine.scheduler.step_budget is not None
    else:  # the block kernels would run portable loops, slower than float32
        assert isinstance(model.layers[0].mlp.down_weight, torch.Tensor)
        assert default_llm.engine.kv_dtype == torch.float32
        assert default_llm.engine.target_step_ms == 0


def test_a_float16_kv_cache_holds_twice_the_tokens_and_stays_close(smollm2_dir, reference):
    """The same block weights over a float16 and a float32 KV cache of the same memory: twice the
    blocks, and greedy continuations that stay as close to the float32 model as each other."""
    options = {**OPTIONS, "kv_cache_memory": 64 << 20}
    half = LLM(str(smollm2_dir), quantization="gguf", kv_cache_dtype="float16", **options)
    full = LLM(str(smollm2_dir), quantization="gguf", kv_cache_dtype="float32", **options)
    assert full.engine.kv_dtype == torch.float32 and half.engine.kv_dtype == torch.float16
    assert half.engine.kv.num_blocks == 2 * full.engine.kv.num_blocks
    with_half = _prefixes(half, reference, "gguf, float16 KV")
    with_full = _prefixes(full, reference, "gguf, float32 KV")
    assert sum(with_half) >= 0.6 * MAX_TOKENS * len(with_half)
    assert abs(sum(with_half) - sum(with_full)) <= 2 * MAX_TOKENS


def test_gguf_serves_the_file_s_blocks_bitwise(gguf_llm, float_llm):
    """Every matmul weight (the 120 layer weights and the tied head) is the file's blocks, exactly
    the float32 weights transformers dequantized from the same file: llama.cpp's weights."""
    served = gguf_llm.engine.model.quantizable_weights()
    floats = float_llm.engine.model.quantizable_weights()
    assert len(served) == len(floats) == 121
    kinds = set()
    for (owner, attr), (float_owner, float_attr) in zip(served, floats, strict=True):
        weight, expected = getattr(owner, attr), getattr(float_owner, float_attr)
        assert isinstance(weight, BlockQ4Weight | BlockQ8Weight), attr
        assert torch.equal(weight.dequantize(), expected), attr
        kinds.add(weight.kind)
    assert kinds == {"q4_1", "q8_0"}
    ids = torch.tensor([0, 1, 500, 49151])
    embedding = gguf_llm.engine.model.embed_tokens
    assert torch.equal(embedding(ids), float_llm.engine.model.embed_tokens(ids))


def test_gguf_greedy_tokens_stay_close_to_float32(gguf_llm, reference):
    prefixes = _prefixes(gguf_llm, reference, "gguf")
    # the same weights; only the int8 activations (per row and block of 32) differ from float32
    assert sum(p == MAX_TOKENS for p in prefixes) >= len(prefixes) // 2
    assert sum(prefixes) / len(prefixes) >= 0.6 * MAX_TOKENS
    assert sum(p > 0 for p in prefixes) >= len(prefixes) - 1  # the first token agrees


def test_gguf_greedy_tokens_are_the_same_alone_and_in_any_batch(gguf_llm, reference):
    """Whole prefills (the budget holds every prompt) beside any other requests, in any order."""
    prompts, _ = reference
    alone = [_greedy(gguf_llm, [p])[0] for p in prompts]
    assert _greedy(gguf_llm, prompts) == alone
    order = [5, 2, 7, 0, 3, 1, 6, 4]
    assert _greedy(gguf_llm, [prompts[i] for i in order]) == [alone[i] for i in order]
    pairs = [prompts[7], prompts[0], prompts[7]]  # the same prompt twice, beside another
    assert _greedy(gguf_llm, pairs) == [alone[7], alone[0], alone[7]]


def test_gguf_greedy_tokens_are_the_same_with_chunked_prefills_and_prefix_cache_hits(
    smollm2_dir, gguf_llm, reference
):
    """A 24-token step budget chunks prefills differently alone and in a mix, and prefix-cache hits
    prefill only a prompt's tail: a request's tokens (and their logprobs, bit for bit) must not
    depend on that."""
    prompts, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

    def run(llm: LLM, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        outs = [o.outputs[0] for o in llm.generate(batch, params)]
        return [(list(o.token_ids), [e.logprob for e in o.logprobs or []]) for o in outs]

    whole = [run(gguf_llm, [p])[0] for p in prompts]
    chunked = LLM(str(smollm2_dir), quantization="gguf", max_num_seqs=8, max_num_batched_tokens=24)
    mixed = run(chunked, prompts)  # chunked prefills beside decodes
    again = [run(chunked, [p])[0] for p in prompts]  # prefix-cache hits: only the tails prefill
    assert [t for t, _ in mixed] == [t for t, _ in whole]
    assert [t for t, _ in again] == [t for t, _ in whole]
    assert mixed == whole and again == whole


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_and_int4_from_the_float_weights_stay_close(smollm2_dir, reference, method):
    llm = LLM(str(smollm2_dir), quantization=method, **OPTIONS)
    model = llm.engine.model
    layer_kind = BlockQ4Weight if method == "int4" else BlockQ8Weight
    assert isinstance(model.layers[0].self_attn.qkv_weight, layer_kind)
    assert isinstance(model.lm_head_weight, BlockQ8Weight)  # the head is Q8_0 in both
    prefixes = _prefixes(llm, reference, method)
    assert sum(p > 0 for p in prefixes) >= len(prefixes) - 1
    assert sum(prefixes) / len(prefixes) >= 0.5 * MAX_TOKENS


def test_quantization_shrinks_the_served_weights(gguf_llm, float_llm):
    from engine.models.loader import load_model
    from engine.models.quantization import quantize_model

    floats = weight_bytes(float_llm.engine.model)
    served = weight_bytes(gguf_llm.engine.model)
    model = load_model(gguf_llm.engine.model_dir, "float32", "cpu").model
    int8 = quantize_model(model, "int8")
    # float32 540 MB; Q8_0 everywhere 34 bytes per 32 weights (the embedding shares the head's
    # table); the bundled GGUF's Q4_1 layers take 20 bytes per 32
    print(
        f"weights: float32 {floats / 1e6:.0f} MB, int8 {int8 / 1e6:.0f} MB, gguf {served / 1e6:.0f} MB"
    )
    assert int8 < 0.28 * floats
    assert served < 0.2 * floats
    with torch.inference_mode():
        assert torch.isfinite(model.compute_logits(torch.randn(2, model.hidden_size))).all()
