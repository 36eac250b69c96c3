"""Llama-family decoders (Llama, Mistral, Qwen2, SmolLM): the shared decoder with SwiGLU, whole-head
rotary and optional q/k/v bias, read from their configs."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.decoder import DecoderForCausalLM, DecoderSpec, common_spec
from engine.models.rotary import rope_parameters


def llama_spec(cfg: Any) -> DecoderSpec:
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return DecoderSpec(
        **common_spec(cfg),
        rope=(rope_parameters(cfg),),
        # Qwen2 always has q/k/v bias; Llama's `attention_bias` covers all four projections.
        qkv_bias=attention_bias or getattr(cfg, "model_type", "") == "qwen2",
        o_bias=attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        activation=_silu_only(cfg),
    )


def _silu_only(cfg: Any) -> str:
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; Llama-family models use silu")
    return act


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, llama_spec(hf_config), dtype, device)
