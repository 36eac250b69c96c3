"""Phi-3 and Phi-4-mini: the Llama block with q/k/v and gate/up stored fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, loaded as they are), partial rotary (`partial_rotary_factor`) and
LongRoPE short/long factors."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.decoder import DecoderForCausalLM, DecoderSpec, common_spec
from engine.models.rotary import rope_parameters


def phi3_spec(cfg: Any) -> DecoderSpec:
    return DecoderSpec(
        **common_spec(cfg),
        rope=(rope_parameters(cfg),),
        activation=getattr(cfg, "hidden_act", "silu"),
    )


class Phi3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, phi3_spec(hf_config), dtype, device)

    def layer_tensor_names(self) -> dict[str, tuple[str, int]]:
        return super().layer_tensor_names() | {
            "self_attn.qkv_proj.weight": ("self_attn.qkv_weight", 0),
            "mlp.gate_up_proj.weight": ("mlp.gate_up_weight", 0),
        }
