"""The model config of a GGUF file: transformers' metadata mapping, plus the shape facts it drops for
some architectures, read from the file's own keys and tensors as llama.cpp writes them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def gguf_config(gguf: Path) -> Any:
    """transformers' config for `gguf`, completed from the file:
    - `head_dim` from `<arch>.attention.key_length` (Qwen3 states its own head_dim there;
      transformers' qwen3 mapping drops it and keeps Qwen3Config's default of 128);
    - an expert's width from `<arch>.expert_feed_forward_length` (`moe_intermediate_size`, which
      transformers' qwen3moe mapping drops);
    - for phi3, partial rotary from `rope.dimension_count` (Phi-4-mini rotates 3/4 of each head)
      and LongRoPE from the `rope_factors_short` / `rope_factors_long` tensors with
      `rope.scaling.original_context_length`, none of which transformers' phi3 mapping reads."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    reader = GGUFReader(gguf)
    fields = reader.fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = str(value("general.architecture") or "")
    key_length = value(f"{arch}.attention.key_length")
    if key_length is not None and hasattr(config, "head_dim"):
        config.head_dim = int(key_length)
    expert_width = value(f"{arch}.expert_feed_forward_length")
    if expert_width is not None and hasattr(config, "moe_intermediate_size"):
        config.moe_intermediate_size = int(expert_width)
    if arch == "phi3":
        _complete_phi3(config, reader, value)
    return config


def _complete_phi3(config: Any, reader: Any, value: Any) -> None:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = config.hidden_size // config.num_attention_heads
    rotary_dims = value("phi3.rope.dimension_count")
    if rotary_dims is not None:
        rope["partial_rotary_factor"] = int(rotary_dims) / head_dim
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if "rope_factors_short.weight" in factors and "rope_factors_long.weight" in factors:
        original = value("phi3.rope.scaling.original_context_length")
        if original is None:
            raise ValueError("phi3 rope factors without rope.scaling.original_context_length")
        rope |= {
            "rope_type": "longrope",
            "short_factor": _floats(factors["rope_factors_short.weight"]),
            "long_factor": _floats(factors["rope_factors_long.weight"]),
            "original_max_position_embeddings": int(original),
        }
        config.original_max_position_embeddings = int(original)
    config.rope_parameters = rope


def _floats(tensor: Any) -> list[float]:
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
