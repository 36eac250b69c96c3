"""Qwen3 (per-head q/k RMSNorm, head_dim apart from hidden / heads, GQA, tied or untied embeddings)
against transformers: greedy tokens under chunked prefill, preemption and prefix-cache hits, prompt
logprobs, both attention backends, int8 blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.models.loader import load_model
from tests.model import tiny_models as tm

LENGTHS = [1, 5, 17, 33, 40, 64, 90, 120]


def qwen3_config(smollm2_dir: Path, **overrides):
    from transformers import Qwen3Config

    smol = json.loads((smollm2_dir / "config.json").read_text())
    base = dict(
        vocab_size=smol["vocab_size"],
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        bos_token_id=smol.get("bos_token_id"),
        eos_token_id=smol.get("eos_token_id"),
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    return Qwen3Config(**(base | overrides))


@pytest.fixture(scope="module", params=["tied", "untied"])
def case(request, smollm2_dir, tmp_path_factory) -> tm.FamilyCase:
    tied = request.param == "tied"
    config = qwen3_config(smollm2_dir, tie_word_embeddings=tied)
    folder = tm.save_tiny_checkpoint(config, tmp_path_factory.mktemp("qwen3"), smollm2_dir)
    return tm.FamilyCase.build(folder, LENGTHS)


def test_loads_as_qwen3_with_its_own_head_dim(case):
    model = load_model(case.folder, "float32", "cpu").model
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.head_dim == 32 != model.hidden_size // model.num_heads
    assert model.layers[0].self_attn.q_norm is not None
    assert (model.lm_head_weight is None) == case.hf_model.config.tie_word_embeddings


def test_greedy_equals_transformers_with_chunked_prefill(case):
    tm.check_chunked_prefill(case)


def test_greedy_equals_transformers_under_preemption(case):
    tm.check_preemption(case, num_blocks=20)


def test_prefix_cache_hits_keep_tokens(case):
    tm.check_prefix_cache_hits(case)


def test_prompt_logprobs_match_transformers(case):
    tm.check_prompt_logprobs(case, case.prompts[-1])


def test_both_attention_backends_match_transformers(case):
    tm.check_backends_match_transformers(case, case.prompts[-2])


def test_int8_blocks_are_batch_invariant_and_close(case):
    tm.check_int8_batch_invariant(case)
