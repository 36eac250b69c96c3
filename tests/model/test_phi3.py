"""Phi-3 / Phi-4-mini (fused qkv_proj and gate_up_proj, partial rotary, LongRoPE short and long
factors) against transformers: greedy tokens under chunked prefill, preemption and prefix-cache
hits, prompt logprobs, both attention backends, int8 blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.models.loader import load_model
from tests.model import tiny_models as tm

ORIGINAL = 64  # LongRoPE's pretraining length
LENGTHS = [1, 9, 30, 56, 60, 64, 70, 110]
LONG = [65, 66, 70, 81, 96, 110, 130]  # past it: transformers rotates with the long factors
SHORT = [1, 7, 20, 33, 40, 47, 52]  # within it (+12 generated): the short factors


def phi3_config(smollm2_dir: Path, longrope: bool, partial: float):
    from transformers import Phi3Config

    smol = json.loads((smollm2_dir / "config.json").read_text())
    rotary = int(32 * partial)
    rope = None
    if longrope:
        rope = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(rotary // 2)],
            "long_factor": [1.0 + 2.0 * i for i in range(rotary // 2)],
        }
    return Phi3Config(
        vocab_size=smol["vocab_size"],
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        rope_scaling=rope,
        rope_theta=10000.0,
        bos_token_id=smol.get("bos_token_id"),
        eos_token_id=smol.get("eos_token_id"),
        pad_token_id=None,
        tie_word_embeddings=False,
        architectures=["Phi3ForCausalLM"],
    )


# name: (LongRoPE, partial rotary factor, prompt lengths, max_model_len)
VARIANTS = {
    "phi3": (False, 1.0, LENGTHS, None),
    # A long served context (512 > 64): the long factors, transformers' past the original length.
    "phi4mini_longrope_long": (True, 0.75, LONG, None),
    # --max-model-len within the original length: the short factors.
    "longrope_short": (True, 1.0, SHORT, ORIGINAL),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request, smollm2_dir, tmp_path_factory) -> tm.FamilyCase:
    longrope, partial, lengths, max_model_len = VARIANTS[request.param]
    config = phi3_config(smollm2_dir, longrope, partial)
    folder = tm.save_tiny_checkpoint(config, tmp_path_factory.mktemp("phi3"), smollm2_dir)
    return tm.FamilyCase.build(folder, lengths, max_model_len=max_model_len)


def test_loads_fused_checkpoint_tensors(case):
    model = load_model(case.folder, "float32", "cpu").model
    assert type(model).__name__ == "Phi3ForCausalLM"
    config = case.hf_model.config
    rotary = model.rotaries[0]
    assert rotary.rotary_dim == int(32 * config.rope_parameters["partial_rotary_factor"])
    longrope = config.rope_parameters["rope_type"] == "longrope"
    assert rotary.long_after == (ORIGINAL if longrope else None)
    assert rotary.uses_long_factors == longrope  # 512 positions served by default
    model.limit_context(ORIGINAL)
    assert not rotary.uses_long_factors


def test_greedy_equals_transformers_with_chunked_prefill(case):
    tm.check_chunked_prefill(case)


def test_greedy_equals_transformers_under_preemption(case):
    tm.check_preemption(case, num_blocks=16)


def test_prefix_cache_hits_keep_tokens(case):
    if case.max_model_len is None:
        tm.check_prefix_cache_hits(case, shared=48, tail=20)  # 68 tokens: past the original 64
    else:
        tm.check_prefix_cache_hits(case, shared=32, tail=12)  # 44 + 12 fit the short context


def test_prompt_logprobs_match_transformers(case):
    tm.check_prompt_logprobs(case, case.prompts[-1])  # past the original length


def test_both_attention_backends_match_transformers(case):
    tm.check_backends_match_transformers(case, case.prompts[-2])


def test_int8_blocks_are_batch_invariant_and_close(case):
    tm.check_int8_batch_invariant(case)
