"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v bias per `qkv_bias`) with sparse expert blocks
plus a shared expert that every token runs, scaled by its own sigmoid gate."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.decoder import DecoderSpec, common_spec
from engine.models.moe_decoder import MoeDecoderForCausalLM
from engine.models.rotary import rope_parameters


def qwen2_moe_spec(cfg: Any) -> DecoderSpec:
    return DecoderSpec(
        **common_spec(cfg),
        rope=(rope_parameters(cfg),),
        qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
        activation=getattr(cfg, "hidden_act", "silu"),
    )


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, qwen2_moe_spec(hf_config), dtype, device)
