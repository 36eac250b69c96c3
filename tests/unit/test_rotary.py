"""Every rope type kvserve reads (linear, dynamic, yarn, llama3, longrope, with partial rotary)
gives transformers' ROPE_INIT_FUNCTIONS inverse frequencies and attention factor, and cos/sin tables
equal to its rotary modules' (LongRoPE's short set for a served context within the original length,
its long set past it); an unknown type is a clear error."""

from __future__ import annotations

import pytest
import torch

from engine.models.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq, rope_parameters

HEAD_DIM = 32
MAX_POS = 256


def llama_config(rope: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters=rope,
    )


def phi3_config(rope: dict | None, partial: float = 1.0, original: int = 64):
    from transformers import Phi3Config

    return Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
        rope_scaling=rope,
    )


def longrope(dim: int) -> dict:
    short = [1.0 + 0.05 * i for i in range(dim // 2)]
    long = [1.0 + 0.9 * i for i in range(dim // 2)]
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long}


CASES = {
    "linear": lambda: llama_config({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
    "dynamic": lambda: llama_config({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "yarn": lambda: llama_config(
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 1e6,
            "original_max_position_embeddings": 64,
        }
    ),
    "yarn_mscale": lambda: llama_config(
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "rope_theta": 1e4,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.7,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "llama3": lambda: llama_config(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 5e5,
        }
    ),
    "longrope": lambda: phi3_config(longrope(HEAD_DIM)),
    "longrope_partial": lambda: phi3_config(longrope(24), partial=0.75),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CASES[name]()
    params = rope_parameters(config)
    reference = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    expected, expected_factor = reference(config, "cpu")
    inv_freq, factor = rope_inv_freq(HEAD_DIM, params, MAX_POS)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    if params["rope_type"] == "longrope":  # past the original length: the long factors
        long_expected, _ = reference(config, "cpu", seq_len=65)
        long_freq, _ = rope_inv_freq(HEAD_DIM, params, MAX_POS, long=True)
        torch.testing.assert_close(long_freq, long_expected, rtol=1e-6, atol=0)
        assert not torch.allclose(long_freq, inv_freq)


def _hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    module = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, len(positions), 8)
    cos, sin = module(x, positions[None])  # [1, n, rotary_dim] (both halves)
    return cos[0], sin[0]


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_tables_are_transformers_for_the_served_context(partial):
    """transformers rotates a sequence with the short factors while it fits the original length
    (64 here) and the long ones past it; kvserve serves one set, picked by max_model_len, which
    equals transformers' for every sequence within that served range."""
    dim = int(HEAD_DIM * partial)
    config = phi3_config(longrope(dim), partial=partial)
    ours = RotaryEmbedding(HEAD_DIM, MAX_POS, rope_parameters(config), torch.float32, "cpu")
    assert ours.rotary_dim == dim and ours.uses_long_factors  # max_position_embeddings 256 > 64
    for limit, lengths in ((64, (1, 40, 64)), (MAX_POS, (65, 100, MAX_POS))):
        ours.limit_context(limit)
        assert ours.uses_long_factors == (limit > 64)
        for length in lengths:
            hf_cos, hf_sin = _hf_cos_sin(config, torch.arange(length))
            cos, sin = ours.lookup(torch.arange(length))
            torch.testing.assert_close(torch.cat([cos[:, 0], cos[:, 0]], -1), hf_cos)
            torch.testing.assert_close(torch.cat([sin[:, 0], sin[:, 0]], -1), hf_sin)


def test_partial_rotary_passes_the_tail_through():
    x = torch.randn(3, 2, 8)
    cos, sin = torch.rand(3, 1, 3), torch.rand(3, 1, 3)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 6:], x[..., 6:])
    torch.testing.assert_close(out[..., :6], apply_rotary(x[..., :6].contiguous(), cos, sin))


def test_unknown_rope_type_is_a_clear_error():
    params = {"rope_type": "made_up", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope scaling type 'made_up' is not supported"):
        RotaryEmbedding(HEAD_DIM, MAX_POS, params, torch.float32, torch.device("cpu"))
