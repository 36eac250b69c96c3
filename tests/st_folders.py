"""Tiny random decoder embedding folders as sentence-transformers lays them out (Qwen3-Embedding's
shape: modules.json with Transformer, Pooling and Normalize, 1_Pooling/config.json,
config_sentence_transformers.json with instruction prompts), with SmolLM2's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages\nQuery: "
PROMPTS = {"query": QUERY_PROMPT, "document": ""}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# modules.json type names: sentence-transformers up to v5, and v6's module paths.
_MODULE_TYPES = {
    "v5": (
        "sentence_transformers.models.Transformer",
        "sentence_transformers.models.Pooling",
        "sentence_transformers.models.Normalize",
    ),
    "v6": (
        "sentence_transformers.base.modules.transformer.Transformer",
        "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        "sentence_transformers.base.modules.normalize.Normalize",
    ),
}


# The miniature decoder shape every family below shares (GQA 4/2).
_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_llama_config(vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        **_SHAPE,
        max_position_embeddings=256,
        initializer_range=0.2,  # larger than the default, so that different texts land apart
        tie_word_embeddings=True,
    )


def tiny_qwen3_config(vocab_size: int) -> Any:
    """Qwen3-Embedding's structure in miniature: q/k norms, a head_dim of its own, tied."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        **_SHAPE,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=True,
    )


def tiny_mistral_config(vocab_size: int) -> Any:
    """e5-mistral's structure in miniature: a sliding window shorter than most test texts."""
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=vocab_size,
        **_SHAPE,
        max_position_embeddings=256,
        sliding_window=6,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


TINY_CONFIGS = {
    "llama": tiny_llama_config,
    "mistral": tiny_mistral_config,
    "qwen3": tiny_qwen3_config,
}


def write_embedding_folder(
    folder: Path,
    tokenizer_dir: Path,
    config: Any,
    *,
    pooling: str = "lasttoken",
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    padding_side: str = "right",
    include_prompt: bool = True,
    module_style: str = "v5",
    seed: int = 0,
) -> Path:
    """Save a random decoder (its `ForCausalLM` class, as Qwen3-Embedding ships) and the
    sentence-transformers files around it; returns `folder`."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["padding_side"] = padding_side  # Qwen3-Embedding pads on the left
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    transformer, pooling_type, normalize_type = _MODULE_TYPES[module_style]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": transformer},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": pooling_type},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": normalize_type})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling_config: dict[str, Any] = {"include_prompt": include_prompt}
    if module_style == "v6":
        pooling_config |= {"embedding_dimension": config.hidden_size, "pooling_mode": pooling}
    else:
        modes = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}
        pooling_config |= {"word_embedding_dimension": config.hidden_size}
        pooling_config |= {f"pooling_mode_{m}": m == modes[pooling] for m in modes.values()}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    if normalize:
        (folder / "2_Normalize").mkdir(exist_ok=True)
    st_config = {"prompts": prompts or {}, "default_prompt_name": default_prompt_name}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    return folder


def sentence_transformers_reference(
    folder: Path, texts: list[str], prompt_name: str | None = None, batch_size: int = 32
) -> torch.Tensor:
    """[len(texts), hidden] float32 vectors from SentenceTransformer.encode on the folder."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    model.to(torch.float32)
    vectors = model.encode(
        texts, prompt_name=prompt_name, batch_size=batch_size, convert_to_tensor=True
    )
    return vectors.float().cpu()
