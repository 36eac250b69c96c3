"""Mixtral: the Llama block (Mistral's attention) with a sparse expert block in every layer; the
top-k router probabilities always renormalized."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.llama import llama_spec
from engine.models.moe_decoder import MoeDecoderForCausalLM


class MixtralForCausalLM(MoeDecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, llama_spec(hf_config), dtype, device)
