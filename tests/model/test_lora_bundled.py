"""LoRA adapters (rank 16 on every linear module) over the bundled SmolLM2: in float32 the greedy
tokens equal transformers + peft's; on the default weights (the GGUF's Q4_1 blocks, whose kernels
stay in use) a request's tokens are the same alone and in a step mixing two adapters and the base
model, and stay close to float32's, as the bundled-model quantization tests compare them."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.models.block_quant import BlockQ4Weight
from engine.models.cpu_features import detect_cpu
from tests.model import tiny_models as tm
from tests.model.lora_adapters import make_adapter, peft_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village")
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol_lora")
    return {
        f"s{i}": make_adapter(smollm2_dir, root / f"s{i}", rank=16, alpha=32, seed=i, std=0.6)
        for i in range(2)
    }


def _greedy(llm: LLM, prompts: list[list[int]], loras: list[str | None]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, lora=loras)]


def test_float32_matches_peft(smollm2_dir, adapters):
    llm = LLM(
        str(smollm2_dir), dtype="float32", quantization="none",
        lora_modules=[f"{n}={p}" for n, p in adapters.items()],
    )  # fmt: skip
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    want = tm.hf_greedy(peft_reference(smollm2_dir, adapters["s0"]), prompts, MAX_NEW)
    assert _greedy(llm, prompts, ["s0"] * 3) == want
    base = _greedy(llm, prompts, [None] * 3)
    assert base != want  # the adapter changes the text
    mixed = _greedy(llm, prompts, ["s0", None, "s0"])
    assert mixed == [want[0], base[1], want[2]]


def test_quantized_weights_keep_their_kernels_and_batch_invariance(smollm2_dir, adapters):
    modules = [f"{n}={p}" for n, p in adapters.items()]
    llm = LLM(str(smollm2_dir), lora_modules=modules, enable_prefix_caching=False)
    if detect_cpu().block_kernels:
        assert isinstance(llm.engine.model.layers[0].mlp.down_weight, BlockQ4Weight)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    loras: list[str | None] = ["s0", "s1", None]
    alone = [_greedy(llm, [p], [name])[0] for p, name in zip(prompts, loras, strict=True)]
    assert _greedy(llm, prompts, loras) == alone
    # Several rows of one adapter in a step (its low-rank products over more rows): still the
    # tokens each request gets alone.
    same = ["s0"] * len(prompts) + ["s1"] * len(prompts)
    each = [_greedy(llm, [p], [name])[0] for p, name in zip(prompts * 2, same, strict=True)]
    assert _greedy(llm, prompts * 2, same) == each
    float_llm = LLM(
        str(smollm2_dir), dtype="float32", quantization="none", lora_modules=modules,
        enable_prefix_caching=False,
    )  # fmt: skip
    ref = _greedy(float_llm, prompts, loras)
    # the same weights; the block kernels' int8 activations differ from float32 slightly
    assert sum(a[0] == r[0] for a, r in zip(alone, ref, strict=True)) >= 2
    assert alone[0] != _greedy(llm, prompts[:1], [None])[0]
