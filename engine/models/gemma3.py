"""Gemma 3 text decoders (`Gemma3ForCausalLM`, and the text tower of `Gemma3ForConditionalGeneration`
folders): sliding-window layers between global ones, each kind with its own rotary base, q/k norm,
four (1 + weight) RMSNorms per block, embeddings scaled by sqrt(hidden), GELU-tanh MLP,
`query_pre_attn_scalar` and final logit softcapping."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.models.decoder import DecoderForCausalLM, DecoderSpec, common_spec
from engine.models.rotary import rope_parameters

logger = logging.getLogger(__name__)

GLOBAL, LOCAL = "full_attention", "sliding_attention"
# Checkpoint prefixes of the text tower: transformers 5 (`model.language_model.`), older
# multimodal checkpoints (`language_model.model.`), text-only ones (`model.`).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_OTHER_TOWERS = ("vision_tower", "multi_modal_projector")


def text_config(hf_config: Any) -> Any:
    """The text model's config: a multimodal config's `text_config`, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


def gemma3_spec(hf_config: Any) -> DecoderSpec:
    cfg = text_config(hf_config)
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(
            "this Gemma 3 config uses bidirectional attention (an embedding model); kvserve "
            "serves Gemma 3 as a causal decoder"
        )
    types = list(cfg.layer_types)  # transformers fills them from sliding_window_pattern if absent
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        # transformers' Gemma 3 keeps the value but never applies it, so checkpoints are trained
        # (and must be served) without it; Gemma 2 is the family that softcaps attention.
        logger.info("Gemma 3: attn_logit_softcapping is not applied (as in transformers)")
    return DecoderSpec(
        **common_spec(cfg) | {"attention_scale": float(cfg.query_pre_attn_scalar) ** -0.5},
        rope=(rope_parameters(cfg, GLOBAL), rope_parameters(cfg, LOCAL)),
        layer_rope=tuple(int(t == LOCAL) for t in types),
        qkv_bias=bool(getattr(cfg, "attention_bias", False)),
        o_bias=bool(getattr(cfg, "attention_bias", False)),
        activation=cfg.hidden_activation,
        qk_norm=True,
        gemma_norms=True,
        embed_scale=cfg.hidden_size**0.5,
        final_softcap=getattr(cfg, "final_logit_softcapping", None),
    )


class Gemma3ForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, gemma3_spec(hf_config), dtype, device)

    def checkpoint_name(self, hf_name: str) -> str | None:
        if hf_name == "language_model.lm_head.weight":
            return "lm_head.weight"
        for prefix in _TEXT_PREFIXES:
            if hf_name.startswith(prefix):
                name = hf_name.removeprefix(prefix)
                return None if name.startswith(_OTHER_TOWERS) else name
        return None if hf_name.startswith(_OTHER_TOWERS) else hf_name
