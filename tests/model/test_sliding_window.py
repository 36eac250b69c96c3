"""Sliding-window models end to end against transformers (float32, eager attention): a tiny
random-weight Mistral (every layer slides) and Qwen2 (`use_sliding_window`, layers from
`max_window_layers` on slide), prompts several windows long, greedy tokens under chunked prefill,
prefix-cache hits and preemption, and prompt logprobs, on the C++ CPU backend and the SDPA one."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.kernels.attention import attention_backend
from tests.conftest import _copy_tokenizer

WINDOW = 16
MAX_TOKENS = 12
WORDS = (
    "a sliding window keeps only the latest keys so the model forgets what came long before while "
    "the harbour bells ring over boats and quiet streets until the evening tide returns"
).split()

BACKENDS = [
    "sdpa",
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ kernels")
    ),
]


def _config(family: str, vocab_size: int, **ids) -> MistralConfig | Qwen2Config:
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        sliding_window=WINDOW,
        tie_word_embeddings=True,
        initializer_range=0.1,  # 5x the default: decisive logits, and the window shows
        **ids,
    )
    if family == "mistral":
        return MistralConfig(**common)
    # Layer 0 attends globally, layers 1 and 2 slide.
    return Qwen2Config(**common, use_sliding_window=True, max_window_layers=1)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model_dir(request, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    smol = json.loads((smollm2_dir / "config.json").read_text())
    ids = dict(bos_token_id=smol.get("bos_token_id"), eos_token_id=smol.get("eos_token_id"))
    config = _config(request.param, smol["vocab_size"], **ids)
    torch.manual_seed(0)
    cls = MistralForCausalLM if request.param == "mistral" else Qwen2ForCausalLM
    model = cls(config).to(torch.float32).eval()
    out = tmp_path_factory.mktemp(f"tiny_{request.param}_window")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(out)
    _copy_tokenizer(smollm2_dir, out)
    return out


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    """Prompts 2 to 7 windows long; the last two share a long prefix (prefix-cache hits)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(3)
    texts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (36, 55, 80, 100)]
    prompts = [tokenizer.encode(t) for t in texts]
    prompts.append(prompts[-1][:70] + tokenizer.encode(" and then the bells stopped"))
    assert min(len(p) for p in prompts) > 2 * WINDOW and max(len(p) for p in prompts) > 6 * WINDOW
    return prompts


def _generate(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return [_generate(hf_model, p) for p in prompts]


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", request.param)
    attention_backend.cache_clear()
    yield request.param
    attention_backend.cache_clear()


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_the_window_changes_the_reference(model_dir, hf_model, prompts, reference):
    """The test is sensitive: with full attention, transformers' own tokens differ."""
    from transformers import AutoModelForCausalLM

    full_attention = {"sliding_window": None}
    if "qwen2" in model_dir.name:
        full_attention["layer_types"] = ["full_attention"] * 3
    full = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **full_attention
    ).eval()
    assert any(_generate(full, p) != ref for p, ref in zip(prompts, reference, strict=True))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_greedy_equals_transformers_chunked_and_cached(
    model_dir, prompts, reference, backend, monkeypatch
):
    calls = []  # the C++ one-call decode layers must run (and honour the window) on "cpu"
    for name in ("decode_layer", "decode_layers"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(
            cpu_kernels, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k)
        )
    # A 24-token budget chunks every prompt; 8-token blocks put window edges inside blocks.
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="none",
        block_size=8,
        max_num_batched_tokens=24,
        max_num_seqs=4,
    )
    windows = llm.engine.model.layer_windows
    assert windows == ([WINDOW] * 3 if "mistral" in model_dir.name else [None, WINDOW, WINDOW])
    assert _greedy(llm, prompts[:4]) == reference[:4]
    # The last prompt shares 70 tokens with one already computed: its first blocks come cached.
    hits_before = llm.engine.totals.prefix_cache_hits
    outs = llm.generate(prompts[4:] + prompts[:1], SamplingParams(temperature=0.0, max_tokens=12))
    assert llm.engine.totals.prefix_cache_hits - hits_before >= 64
    assert outs[0].num_cached_tokens >= 64
    assert [list(o.outputs[0].token_ids) for o in outs] == reference[4:] + reference[:1]
    assert bool(calls) == (backend == "cpu")


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_greedy_equals_transformers_under_preemption(model_dir, prompts, reference, backend):
    # Sliding layers give their out-of-window blocks back, so an all-sliding Mistral needs a
    # small pool to be forced to preempt; Qwen2's three KV cache groups (one full layer, two
    # sliding) make a block one layer's worth, so its pool counts more blocks.
    num_blocks = 10 if "mistral" in model_dir.name else 30
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="none",
        block_size=8,
        max_num_batched_tokens=32,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
    )
    assert _greedy(llm, prompts) == reference
    assert llm.engine.totals.num_preemptions > 0, "the pool was meant to force preemptions"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_prompt_logprobs_match_transformers(model_dir, hf_model, prompts, backend):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="none",
        block_size=8,
        max_num_batched_tokens=24,
    )
    prompt = prompts[3]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt)
    worst = max(
        abs(plp[pos].logprob - ref[pos - 1, prompt[pos]].item()) for pos in range(1, len(prompt))
    )
    assert worst < 1e-4
