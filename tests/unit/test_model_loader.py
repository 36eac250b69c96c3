"""Loading checkpoints (single, sharded, .bin), clear errors for bad input, and tiny Llama / Qwen2 /
Mistral / rope-scaled models matching transformers' logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.kernels.attention import AttentionMetadata, allocate_kv_cache
from engine.models.loader import (
    find_bundled_embedding_model,
    find_bundled_model,
    load_model,
    resolve_dtype,
    resolve_model,
)
from engine.models.rotary import rope_parameters

PROMPT = [1, 17, 223, 410, 88, 2, 305, 77, 12, 480, 5, 6, 70, 31, 31, 31]  # < every tiny vocab


def our_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Whole-prompt logits from our model through a freshly allocated paged cache."""
    model, block_size = loaded.model, 16
    num_blocks = -(-len(ids) // block_size)
    kv = allocate_kv_cache(
        model.num_layers,
        num_blocks + 1,
        block_size,
        model.num_kv_heads,
        model.head_dim,
        torch.float32,
        "cpu",
    )
    table = list(range(num_blocks, 0, -1))  # reversed: block order must not matter
    meta = AttentionMetadata.from_lists([len(ids)], [len(ids)], [table], block_size)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
    return model.compute_logits(hidden)  # [len(ids), vocab]


def reference_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def assert_matches_reference(model_dir: Path, ids: list[int] = PROMPT) -> None:
    ours = our_logits(load_model(model_dir, "float32", "cpu"), ids)
    ref = reference_logits(model_dir, ids)
    diff = (ours.log_softmax(-1) - ref.log_softmax(-1)).abs().max().item()
    assert diff < 1e-4, diff


def save_tiny(tmp_path: Path, config, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def tiny_kwargs(**overrides) -> dict:
    base = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return base | overrides


# ---------------------------------------------------------------- loading checkpoints


def test_tiny_llama_loads_from_safetensors(tiny_llama_dir: Path):
    loaded = load_model(tiny_llama_dir, "float32", "cpu")
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.max_model_len == 512
    assert loaded.model.num_layers == 2 and loaded.model.num_kv_heads == 2
    assert loaded.model.head_dim == 16
    assert loaded.eos_token_ids == {2}
    assert not loaded.model.training
    assert_matches_reference(tiny_llama_dir)


def test_sharded_safetensors_folder_loads(tiny_llama_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="4MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_matches_reference(tmp_path)


def test_pytorch_bin_fallback(tiny_llama_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), tmp_path / "pytorch_model.bin")
    expected = our_logits(load_model(tiny_llama_dir, "float32", "cpu"), PROMPT)
    got = our_logits(load_model(tmp_path, "float32", "cpu"), PROMPT)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_eos_ids_merge_config_and_generation_config(tiny_llama_dir: Path, tmp_path: Path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(tmp_path, "float32", "cpu").eos_token_ids == {2, 7}


def test_bfloat16_load_is_close_to_float32(tiny_llama_dir: Path):
    loaded = load_model(tiny_llama_dir, "bfloat16", "cpu")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = our_logits(loaded, PROMPT)  # a float32 cache: writes cast K/V to the cache dtype
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    reference = our_logits(load_model(tiny_llama_dir, "float32", "cpu"), PROMPT)
    assert (logits.softmax(-1) - reference.softmax(-1)).abs().max() < 0.05


# ---------------------------------------------------------------- bad input


def test_unknown_architecture_names_it_and_the_supported_ones(tiny_llama_dir: Path, tmp_path: Path):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_llama_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        load_model(tmp_path, "float32", "cpu")


def test_missing_folder_says_what_was_looked_for(tmp_path: Path):
    with pytest.raises(ValueError, match="not found.*config.json.*gguf"):
        resolve_model(str(tmp_path / "no-such-model"))


def test_folder_without_config_or_weights(tiny_llama_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no weights in .*model.safetensors"):
        load_model(tmp_path, "float32", "cpu")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_names_the_file(tiny_llama_dir: Path, tmp_path: Path, damage: str):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    data = (tiny_llama_dir / "model.safetensors").read_bytes()
    bad = b"this is not a safetensors file" if damage == "garbage" else data[: len(data) // 2]
    (tmp_path / "model.safetensors").write_bytes(bad)
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_model(tmp_path, "float32", "cpu")


def test_missing_shard_names_the_file(tiny_llama_dir: Path, tmp_path: Path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors"):
        load_model(tmp_path, "float32", "cpu")


def test_checkpoint_missing_a_tensor(tiny_llama_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    state = load_file(tiny_llama_dir / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights.*layers.1.mlp.gate_up_weight"):
        load_model(tmp_path, "float32", "cpu")


def test_unknown_hub_id_is_not_downloaded():
    with pytest.raises(ValueError, match="not in the local Hugging Face cache.*never downloads"):
        resolve_model("kvserve-test/definitely-not-a-real-model")


def test_hub_id_found_in_the_local_hf_cache(tiny_llama_dir: Path, tmp_path: Path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "models--kvserve-test--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, snapshot / name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("kvserve-test/tiny") == snapshot


def test_corrupt_gguf_fails_cleanly(tmp_path: Path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="could not convert GGUF file .*broken.gguf"):
        resolve_model(str(gguf), cache_dir=str(cache))
    # No half-written folder is left behind to be mistaken for a finished conversion.
    assert not [p for p in cache.iterdir() if p.is_dir()]


def test_non_gguf_file_is_rejected(tmp_path: Path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(path))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float64", torch.device("cpu"))
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_auto_dtype_follows_the_checkpoint():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # A float32 checkpoint (the converted bundled GGUF) stays float32 on CPU: batch-invariant greedy.
    assert resolve_dtype("auto", cpu, "torch.float32") == torch.float32
    assert resolve_dtype("auto", cpu, None) == torch.float32
    assert resolve_dtype("auto", cpu, "float16") == torch.float32  # no fast fp16 on CPU
    assert resolve_dtype("auto", cpu, "bfloat16") in (torch.bfloat16, torch.float32)  # if native
    assert resolve_dtype("auto", cuda, "float32") == torch.bfloat16
    assert resolve_dtype("auto", cuda, "float16") == torch.float16


def test_bundled_model_serves_in_float32_by_default(smollm2_dir):
    from transformers import AutoConfig

    from engine.models.loader import checkpoint_dtype

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert resolve_dtype("auto", torch.device("cpu"), checkpoint_dtype(config)) == torch.float32


# ---------------------------------------------------------------- bundled models and GGUF cache


def test_bundled_models_are_found():
    assert find_bundled_model().suffix == ".gguf"
    assert (find_bundled_embedding_model() / "config.json").is_file()


def test_gguf_conversion_is_cached_and_complete(smollm2_dir: Path):
    assert resolve_model(None) == smollm2_dir  # the second call reuses the converted folder
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config


# ---------------------------------------------------------------- architectures and rope scaling


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0,
        },
    ],
    ids=["linear", "llama3"],
)  # fmt: skip
def test_rope_scaling_matches_transformers(tmp_path: Path, rope: dict):
    from transformers import LlamaConfig

    config = LlamaConfig(**tiny_kwargs(rope_parameters=rope), architectures=["LlamaForCausalLM"])
    folder = save_tiny(tmp_path, config)
    long_prompt = [(i * 37) % 500 for i in range(200)]  # positions well past the original window
    assert_matches_reference(folder, long_prompt)


def test_unsupported_rope_type_is_a_clear_error(tmp_path: Path):
    from transformers import LlamaConfig

    config = LlamaConfig(**tiny_kwargs(), architectures=["LlamaForCausalLM"])
    folder = save_tiny(tmp_path, config)
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "made_up", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope scaling type 'made_up' is not supported"):
        load_model(folder, "float32", "cpu")


def test_old_style_rope_config_keys():
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    params = rope_parameters(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 5e5


def test_qwen2_with_qkv_bias_and_untied_head_matches_transformers(tmp_path: Path):
    from transformers import Qwen2Config

    config = Qwen2Config(
        **tiny_kwargs(tie_word_embeddings=False), architectures=["Qwen2ForCausalLM"]
    )
    folder = save_tiny(tmp_path, config)
    loaded = load_model(folder, "float32", "cpu")
    assert loaded.model.layers[0].self_attn.qkv_bias is not None
    assert loaded.model.lm_head_weight is not None
    assert_matches_reference(folder)


def test_mistral_matches_transformers(tmp_path: Path):
    from transformers import MistralConfig

    config = MistralConfig(
        **tiny_kwargs(num_key_value_heads=1, sliding_window=None),
        architectures=["MistralForCausalLM"],
    )
    assert_matches_reference(save_tiny(tmp_path, config))
