"""Shared test fixtures: offline hub, the converted SmolLM2 folder, a tiny random Llama, MiniLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# A persistent cache: the one-time GGUF conversion is reused across test runs.
os.environ.setdefault("KVSERVE_CACHE_DIR", str(Path.home() / ".cache" / "kvserve"))
# On a small shared machine, multi-threaded torch ops stall waiting for descheduled threads (a
# 128-token prefill measured 15x slower with 2 threads than with 1 under load). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the Triton kernels' tests run under Triton's interpreter, which must be chosen before
# triton is first imported (it fixes how every @triton.jit function is built) -- and some test
# modules import libraries that import triton (sentence-transformers) before those tests' modules.
if not any(Path("/dev").glob("nvidia[0-9]*")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once to a float32 safetensors folder."""
    from engine.models.loader import resolve_model

    return resolve_model(None)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            (dst / name).write_bytes((src / name).read_bytes())


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer Llama with SmolLM2's tokenizer and vocab (seed fixed)."""
    import json

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    smol_config = json.loads((smollm2_dir / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=smol_config["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=smol_config.get("bos_token_id"),
        eos_token_id=smol_config.get("eos_token_id"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id
    ).save_pretrained(out)
    _copy_tokenizer(smollm2_dir, out)
    return out


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 Hugging Face folder."""
    from engine.models.loader import find_bundled_embedding_model

    return find_bundled_embedding_model()


@pytest.fixture(scope="module")
def fixed_spec_cost():
    """Speculation's cost model kept at its prior constants instead of learning from this
    machine's step times, so which drafts are proposed (and the tests' counts of proposed and
    accepted drafts) does not depend on how fast or busy the machine is. The answers never do."""
    from engine.core import spec_cost, speculator

    class FixedSpecCost(spec_cost.MeasuredSpecCost):
        def observe(self, *args: object, **kwargs: object) -> None:
            return None

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculator, "MeasuredSpecCost", FixedSpecCost)
        yield
