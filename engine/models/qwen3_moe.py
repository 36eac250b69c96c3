"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse expert blocks in the layers that
`decoder_sparse_step` and `mlp_only_layers` make sparse; top-k routing per `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.moe_decoder import MoeDecoderForCausalLM
from engine.models.qwen3 import qwen3_spec


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device):
        super().__init__(hf_config, qwen3_spec(hf_config), dtype, device)
