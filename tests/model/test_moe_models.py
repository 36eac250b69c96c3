"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral with a sliding
window shorter than the prompts) against transformers: greedy tokens under chunked prefill mixed with
decodes, preemption and prefix-cache hits, prompt logprobs, both attention backends; a prompt's
output the same alone and in a batch, bitwise with int8 expert blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.models.block_quant import BlockQ8Weight
from engine.models.loader import load_model
from engine.models.moe import SparseMoeBlock
from tests.model import tiny_models as tm

LENGTHS = [1, 5, 17, 33, 40, 64, 90, 120]


def _config(family: str, smollm2_dir: Path):
    smol = json.loads((smollm2_dir / "config.json").read_text())
    common = dict(
        vocab_size=smol["vocab_size"],
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=smol.get("bos_token_id"),
        eos_token_id=smol.get("eos_token_id"),
        tie_word_embeddings=False,
        num_experts_per_tok=2,
    )
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        # Layer 1 is dense (mlp_only_layers); the others sparse, top-2 renormalized.
        return Qwen3MoeConfig(
            **common,
            num_hidden_layers=4,
            head_dim=32,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            architectures=["Qwen3MoeForCausalLM"],
        )
    if family == "qwen3_moe_step2":
        from transformers import Qwen3MoeConfig

        # Every second layer sparse, top-2 probabilities as the softmax gives them.
        return Qwen3MoeConfig(
            **(common | {"tie_word_embeddings": True}),
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=6,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            architectures=["Qwen3MoeForCausalLM"],
        )
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        # Layer 1 dense: pure decode steps run it as the one-call C++ layer, between sparse ones.
        return Qwen2MoeConfig(
            **common,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            num_experts=8,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            architectures=["Qwen2MoeForCausalLM"],
        )
    from transformers import MixtralConfig

    return MixtralConfig(
        **common,
        num_hidden_layers=3,
        intermediate_size=64,
        num_local_experts=8,
        sliding_window=48,
        architectures=["MixtralForCausalLM"],
    )


FAMILIES = ["qwen3_moe", "qwen3_moe_step2", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, smollm2_dir, tmp_path_factory) -> tm.FamilyCase:
    config = _config(request.param, smollm2_dir)
    folder = tm.save_tiny_checkpoint(config, tmp_path_factory.mktemp(request.param), smollm2_dir)
    return tm.FamilyCase.build(folder, LENGTHS)


def test_loads_with_sparse_blocks_where_the_config_says(case):
    model = load_model(case.folder, "float32", "cpu").model
    hf_layers = case.hf_model.model.layers
    assert type(model).__name__ == case.hf_model.config.architectures[0]
    for ours, theirs in zip(model.layers, hf_layers, strict=True):
        sparse = hasattr(theirs.mlp, "experts")
        assert isinstance(ours.mlp, SparseMoeBlock) == sparse
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    window = 48 if case.hf_model.config.model_type == "mixtral" else None  # shorter than prompts
    assert model.layer_windows == [window] * model.num_layers
    assert model.supports_cuda_graphs is False  # experts are grouped on the host each step
    # Pure decode steps run dense Llama-like layers as the one-call C++ layer, never sparse ones.
    calls = model._decode_calls()
    for call, layer in zip(calls, model.layers, strict=True):
        assert call is None or not isinstance(layer.mlp, SparseMoeBlock)
    if case.hf_model.config.model_type == "qwen2_moe":
        assert calls[1] is not None


def test_greedy_equals_transformers_with_chunked_prefill(case):
    tm.check_chunked_prefill(case)


def test_greedy_equals_transformers_under_preemption(case):
    # Mixtral's sliding layers give their blocks past the window back: a smaller pool preempts.
    tm.check_preemption(case, num_blocks=10 if case.hf_model.config.model_type == "mixtral" else 20)


def test_prefix_cache_hits_keep_tokens(case):
    tm.check_prefix_cache_hits(case)


def test_prompt_logprobs_match_transformers(case):
    tm.check_prompt_logprobs(case, case.prompts[-1])


def test_both_attention_backends_match_transformers(case):
    tm.check_backends_match_transformers(case, case.prompts[-2])


def test_float32_greedy_is_the_same_alone_and_among_others(case):
    llm = case.llm(max_num_batched_tokens=32, enable_prefix_caching=False)
    batched = tm.greedy(llm, case.prompts)
    for i in (0, 3, 7):
        assert tm.greedy(llm, [case.prompts[i]])[0] == batched[i], i


def test_int8_experts_are_bitwise_batch_invariant(case):
    """Every expert matrix runs as Q8_0 blocks; a prompt's tokens and their logprobs are bitwise
    the same alone and in a batch of chunked prefills and decodes."""
    llm = case.llm(quantization="int8", max_num_batched_tokens=24, enable_prefix_caching=False)
    model = llm.engine.model
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert all(
        isinstance(getattr(owner, attr), BlockQ8Weight)
        for block in blocks
        for owner, attr in block.quantizable_weights()
    )
    params = SamplingParams(temperature=0.0, max_tokens=tm.MAX_TOKENS, ignore_eos=True, logprobs=2)

    def run(prompts):
        return [
            [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.outputs[0].logprobs or []]
            for out in llm.generate(prompts, params)
        ]

    batched = run(case.prompts)
    for i in (0, 4, 7):
        assert run([case.prompts[i]])[0] == batched[i], i
    tm.check_int8_batch_invariant(case)
