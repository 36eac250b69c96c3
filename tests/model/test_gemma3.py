"""Gemma 3 (sliding-window layers between global ones with their own rotary bases, q/k norm, four
(1 + weight) norms per block, sqrt(hidden) embedding scale, query_pre_attn_scalar, GELU-tanh, final
logit softcapping) against transformers with prompts several windows long: greedy tokens under
chunked prefill, preemption and prefix-cache hits, prompt logprobs, both attention backends, int8
blocks; and the text tower of a Gemma3ForConditionalGeneration folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.models.loader import load_model
from tests.model import tiny_models as tm

WINDOW = 16
LENGTHS = [1, 9, 17, 33, 50, 64, 90, 120]  # up to 7.5 windows


def text_kwargs(smollm2_dir: Path, **overrides) -> dict:
    smol = json.loads((smollm2_dir / "config.json").read_text())
    base = dict(
        vocab_size=smol["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=smol.get("bos_token_id"),
        eos_token_id=smol.get("eos_token_id"),
        pad_token_id=0,
        hidden_activation="gelu_pytorch_tanh",
    )
    return base | overrides


# Gemma scales embeddings by sqrt(hidden) = 8: smaller draws keep the layers' share decisive.
EMBED_STD = {True: 0.15, False: 0.1}  # tied, untied
VARIANTS = {
    # the older integer pattern: every 2nd layer global; global rope linearly scaled; tied head
    "pattern_scaled_rope": dict(
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        tie_word_embeddings=True,
    ),
    # explicit layer types, both softcaps set (transformers applies the final one only)
    "layer_types_softcap": dict(
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        final_logit_softcapping=12.0,
        attn_logit_softcapping=20.0,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, smollm2_dir, tmp_path_factory) -> tm.FamilyCase:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        **text_kwargs(smollm2_dir, **VARIANTS[request.param]),
        architectures=["Gemma3ForCausalLM"],
    )
    out = tmp_path_factory.mktemp("gemma3")
    embed_std = EMBED_STD[config.tie_word_embeddings]
    folder = tm.save_tiny_checkpoint(config, out, smollm2_dir, embed_std=embed_std)
    return tm.FamilyCase.build(folder, LENGTHS)


def test_loads_windows_and_rotary_bases(case):
    model = load_model(case.folder, "float32", "cpu").model
    config = case.hf_model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    expected = [WINDOW if t == "sliding_attention" else None for t in config.layer_types]
    assert model.layer_windows == expected and None in expected and WINDOW in expected
    for layer, window in zip(model.layers, expected, strict=True):
        assert layer.self_attn.window == window
        assert layer.self_attn.rope_index == (1 if window else 0)  # local base for local layers
    assert model.layers[0].self_attn.scale == 24**-0.5
    assert model.spec.attn_softcap is None  # transformers' Gemma 3 never applies it
    assert model.spec.final_softcap == config.final_logit_softcapping


def test_greedy_equals_transformers_with_chunked_prefill(case):
    tm.check_chunked_prefill(case)


def test_greedy_equals_transformers_under_preemption(case):
    # Mixed layers make KV cache groups of equal size (2 or 1 layers here), so a block is that
    # many layers' worth; the sliding ones give theirs back past the window. 30 still preempts.
    tm.check_preemption(case, num_blocks=30)


def test_prefix_cache_hits_keep_tokens(case):
    tm.check_prefix_cache_hits(case)


def test_prompt_logprobs_match_transformers(case):
    tm.check_prompt_logprobs(case, case.prompts[-1])


def test_both_attention_backends_match_transformers(case):
    tm.check_backends_match_transformers(case, case.prompts[-2])


def test_int8_blocks_are_batch_invariant_and_close(case):
    tm.check_int8_batch_invariant(case)


@pytest.fixture(scope="module")
def multimodal_case(smollm2_dir, tmp_path_factory) -> tm.FamilyCase:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = Gemma3TextConfig(**text_kwargs(smollm2_dir, sliding_window_pattern=3))
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        architectures=["Gemma3ForConditionalGeneration"],
    )
    out = tmp_path_factory.mktemp("gemma3mm")
    folder = tm.save_tiny_checkpoint(config, out, smollm2_dir, embed_std=EMBED_STD[True])
    return tm.FamilyCase.build(folder, LENGTHS[:6])


def test_conditional_generation_folder_serves_its_text_tower(multimodal_case):
    from safetensors import safe_open

    with safe_open(str(multimodal_case.folder / "model.safetensors"), "pt") as f:
        assert any("vision_tower" in name for name in f.keys())  # noqa: SIM118
    loaded = load_model(multimodal_case.folder, "float32", "cpu")
    assert loaded.max_model_len == 512
    assert loaded.model.embed_scale is not None
    assert loaded.model.embed_scale.item() == pytest.approx(64**0.5)
    assert loaded.model.embed_scale.dtype == torch.float32
    tm.check_chunked_prefill(multimodal_case)
