"""Models and their weights: plain-torch Llama and BERT, shared layers, weight quantization, and
loading Hugging Face folders or GGUF files. The registry maps config.json architectures to classes."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# Mistral, Qwen2 and SmolLM share the Llama decoder; Qwen2 differs only by q/k/v bias (read from config).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architectures: list[str]) -> type[LlamaForCausalLM]:
    """The class for the first supported name in config.json's `architectures`."""
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    got = ", ".join(architectures) if architectures else "none listed in config.json"
    raise ValueError(
        f"unsupported model architecture ({got}); kvserve supports "
        f"{', '.join(supported_architectures())}"
    )


__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "get_model_class", "supported_architectures"]
