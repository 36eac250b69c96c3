"""Qwen3: the Llama block with per-head RMSNorm of q and k before rotary, and a head_dim of its own
(not hidden_size / heads); embeddings tied or not."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.decoder import DecoderForCausalLM, DecoderSpec, common_spec
from engine.models.rotary import rope_parameters


def qwen3_spec(cfg: Any) -> DecoderSpec:
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderSpec(
        **common_spec(cfg),
        rope=(rope_parameters(cfg),),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        activation=getattr(cfg, "hidden_act", "silu"),
        qk_norm=True,
    )


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, qwen3_spec(hf_config), dtype, device)
