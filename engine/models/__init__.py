"""Models and their weights: plain-torch decoders (one shared decoder, a small file per family) and
BERT, shared layers, weight quantization, LoRA adapters (lora_weights loads PEFT folders, lora_apply
adds a step's per-adapter deltas), and loading Hugging Face folders or GGUF files. The registry maps
config.json architectures to classes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.models.decoder import DecoderForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

# Mistral, Qwen2 and SmolLM are Llama configs; Qwen2 differs only by q/k/v bias (read from config).
# A family class is built from (hf_config, dtype, device).
ModelClass = Callable[[Any, torch.dtype, torch.device], DecoderForCausalLM]
MODEL_REGISTRY: dict[str, ModelClass] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # its text tower
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Mixtures of experts: the decoder with sparse expert blocks (engine.models.moe_decoder).
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architectures: list[str]) -> ModelClass:
    """The class for the first supported name in config.json's `architectures`."""
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    got = ", ".join(architectures) if architectures else "none listed in config.json"
    raise ValueError(
        f"unsupported model architecture ({got}); kvserve supports "
        f"{', '.join(supported_architectures())}"
    )


__all__ = [
    "MODEL_REGISTRY",
    "DecoderForCausalLM",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "supported_architectures",
]
