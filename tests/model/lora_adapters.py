"""PEFT LoRA adapters with random weights for the LoRA tests: PEFT initialises lora_B to zero (an
adapter that changes nothing), so both A and B are drawn at random, large enough to change greedy
tokens; and the transformers + peft references (unmerged and merged)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.model import tiny_models as tm
from tests.model.tiny_models import hf_greedy, hf_logprobs, hf_reference

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    out: Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] | str = ALL_LINEAR,
    seed: int = 1,
    std: float = 0.3,
    rslora: bool = False,
) -> Path:
    """Save a PEFT LoRA folder for the checkpoint at `base` with random A and B; returns `out`."""
    from peft import LoraConfig, get_peft_model

    model = hf_reference(base)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) * std * (8 / fan_in) ** 0.5)
    peft_model.save_pretrained(out)
    return out


def peft_reference(base: Path, adapter: Path, merged: bool = False) -> Any:
    """transformers' model with the adapter, float32 (merged into the weights, or beside them)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_reference(base), adapter).eval()
    return model.merge_and_unload() if merged else model


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new: int) -> Any:
    model = hf_reference(base) if adapter is None else peft_reference(base, adapter)
    return hf_greedy(model, prompts, max_new)


def peft_logprobs(base: Path, adapter: Path, ids: list[int]) -> torch.Tensor:
    return hf_logprobs(peft_reference(base, adapter), ids)


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def save_tiny_base(smollm2_dir: Path, out: Path) -> Path:
    """A random 2-layer Llama (hidden 64) with SmolLM2's tokenizer: the adapters' base model."""
    from transformers import LlamaConfig

    smol = json.loads((smollm2_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=smol["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=smol.get("bos_token_id"), eos_token_id=smol.get("eos_token_id"),
    )  # fmt: skip
    return tm.save_tiny_checkpoint(config, out, smollm2_dir)


def save_three_adapters(base: Path, root: Path) -> dict[str, Path]:
    """Three adapters unlike each other: every linear; attention only with rsLoRA; the MLP."""
    return {
        "all": make_adapter(base, root / "all", rank=8, alpha=16, seed=1),
        "attn": make_adapter(
            base,
            root / "attn",
            rank=4,
            alpha=8,
            targets=["q_proj", "v_proj", "o_proj"],
            seed=2,
            rslora=True,
            std=0.5,
        ),  # fmt: skip
        "mlp": make_adapter(
            base,
            root / "mlp",
            rank=16,
            alpha=8,
            targets=["gate_proj", "up_proj", "down_proj"],
            seed=3,
        ),  # fmt: skip
    }
