"""GGUF files of the non-Llama families as llama.cpp writes them, served as stored: a tiny random
Hugging Face checkpoint written with the `gguf` package's GGUFWriter under that family's
`general.architecture` (tensor names from gguf's own name map, the family's metadata keys, Q8_0 and
Q4_0 blocks from gguf.quants, a float tensor, a fused weight whose parts mix block types). Every
weight served as stored must be the file's blocks and dequantize bitwise to gguf.quants.dequantize;
greedy tokens on the dequantized weights equal transformers' generate on the same file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import (
    MODEL_ARCH_NAMES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    get_tensor_name_map,
)
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.models import MODEL_REGISTRY
from engine.models.block_parts import BlockParts
from engine.models.block_quant import BlockQ8Weight
from engine.models.gguf_blocks import GGUF_ARCHS
from engine.models.loader import find_bundled_model

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
PROMPTS = ["Hello there", "The capital of France is", "def f(x):"]
# Per layer, the block type of each llama.cpp matmul ("F32": a float tensor). Layer 1's attn_v
# differs from its attn_q/attn_k: its fused qkv is served as stored part by part.
SEPARATE_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
     "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"},
    {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "F32",
     "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0"},
]  # fmt: skip
# Our fused weight -> its llama.cpp parts, in fused row order.
SEPARATE_PARTS = {
    "self_attn.qkv_weight": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_weight": ("attn_output",),
    "mlp.gate_up_weight": ("ffn_gate", "ffn_up"),
    "mlp.down_weight": ("ffn_down",),
}
# Phi-3 stores q/k/v as one attn_qkv and gate/up as one ffn_up (its checkpoint's qkv_proj and
# gate_up_proj, as they are).
FUSED_TYPES = [
    {"attn_qkv": "Q4_0", "attn_output": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"},
    {"attn_qkv": "Q8_0", "attn_output": "F32", "ffn_up": "Q4_0", "ffn_down": "Q8_0"},
]
FUSED_PARTS = {
    "self_attn.qkv_weight": ("attn_qkv",),
    "self_attn.o_weight": ("attn_output",),
    "mlp.gate_up_weight": ("ffn_up",),
    "mlp.down_weight": ("ffn_down",),
}
# Qwen3-MoE: attention as above; all experts of a layer in one tensor per matrix kind. Layer 1's
# gate and up experts differ in type (each expert's gate_up is then packed from floats).
EXPERT_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
     "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"},
    {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "F32",
     "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q4_0"},
]  # fmt: skip
NUM_EXPERTS = 4
EXPERT_PARTS = {
    "self_attn.qkv_weight": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_weight": ("attn_output",),
    **{f"mlp.experts.{e}.gate_up_weight": ("ffn_gate_exps", "ffn_up_exps") for e in range(4)},
    **{f"mlp.experts.{e}.down_weight": ("ffn_down_exps",) for e in range(4)},
}
FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0"}
NORM_SHIFT = 1.0  # GGUF type -> kvserve's block format (Q4_0 as Q4_1)


@dataclass(frozen=True)
class Family:
    arch: str  # GGUF general.architecture
    hf_architecture: str  # the class kvserve must have registered
    config: Any  # a tiny transformers config
    tied: bool
    layer_types: list[dict[str, str]] = field(default_factory=lambda: SEPARATE_TYPES)
    parts: dict[str, tuple[str, ...]] = field(default_factory=lambda: SEPARATE_PARTS)

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or HIDDEN // HEADS

    def num_as_stored(self) -> int:
        """Fused weights all of whose parts are in block types served as stored."""
        return sum(
            all(types[p] in FORMATS for p in parts)
            for types in self.layer_types
            for parts in self.parts.values()
        )


def _families(vocab: int) -> list[Family]:
    from transformers import Gemma3TextConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    qwen2 = Qwen2Config(**common, tie_word_embeddings=False)
    qwen3 = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)  # head_dim != hidden/heads
    # Phi-4-mini's shape: a quarter of each head not rotated, LongRoPE factors (the short ones
    # apply up to original_max_position_embeddings, which the served context stays within).
    rotary_half = int(HIDDEN // HEADS * 0.5) // 2
    phi3 = Phi3Config(
        **common | {"max_position_embeddings": 256},
        tie_word_embeddings=False,
        pad_token_id=0,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=256,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.5 * i for i in range(rotary_half)],
            "long_factor": [2.0 + i for i in range(rotary_half)],
        },
    )
    qwen3moe = Qwen3MoeConfig(
        **common,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # as llama.cpp runs qwen3moe
        tie_word_embeddings=False,
    )
    # Gemma 3's block: q/k norms, four (1 + w) norms, GELU-tanh, sliding layers (a window shorter
    # than prompt + output), embeddings scaled by sqrt(hidden); tied, as every Gemma.
    gemma3 = Gemma3TextConfig(
        **common | {"rms_norm_eps": 1e-6},
        head_dim=32,
        sliding_window=8,
        tie_word_embeddings=True,
    )
    return [
        Family("qwen2", "Qwen2ForCausalLM", qwen2, tied=False),
        Family("qwen3", "Qwen3ForCausalLM", qwen3, tied=True),
        Family("phi3", "Phi3ForCausalLM", phi3, False, FUSED_TYPES, FUSED_PARTS),
        Family("qwen3moe", "Qwen3MoeForCausalLM", qwen3moe, False, EXPERT_TYPES, EXPERT_PARTS),
        Family("gemma3", "Gemma3ForCausalLM", gemma3, tied=True),
    ]


def _write_gguf(
    family: Family, path: Path, key_length: int | None = None
) -> dict[str, tuple[str, ...]]:
    """The checkpoint's tensors under llama.cpp's names and metadata keys for the family, quantized
    per its layer types; returns {HF name: the GGUF tensors it is made of, in order}."""
    from transformers import AutoModelForCausalLM

    cfg = family.config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    with torch.no_grad():  # weights larger than the default init: decisive logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.05 if "embed" in name or "lm_head" in name else 0.1)
    written: dict[str, tuple[str, ...]] = {}
    bundled = GGUFReader(find_bundled_model())
    writer = GGUFWriter(path, family.arch)
    for key, entry in bundled.fields.items():  # SmolLM2's tokenizer, as GGUF stores it
        if key.startswith("tokenizer."):
            kind = entry.types[0]
            sub = entry.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, entry.contents(), kind, sub_type=sub)
    head_dim = family.head_dim
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family.arch == "phi3":  # as llama.cpp's Phi3MiniModel: rotary width, LongRoPE factors
        rope = cfg.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        for which in ("long", "short"):
            factors = np.asarray(rope[f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)
    else:  # llama.cpp writes a config's head_dim as the key/value length
        writer.add_key_length(key_length or head_dim)
        writer.add_value_length(key_length or head_dim)
    if family.arch == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    if family.arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    arch_enum = next(a for a, name in MODEL_ARCH_NAMES.items() if name == family.arch)
    names = get_tensor_name_map(arch_enum, LAYERS)
    for hf_name, tensor in model.state_dict().items():
        if family.tied and hf_name == "lm_head.weight":
            continue  # llama.cpp writes a tied head once, as token_embd
        pieces = [(hf_name, tensor)]
        if hf_name.endswith("experts.gate_up_proj"):  # [E, 2 * inter, hidden]: gate, up apart
            gate, up = tensor.chunk(2, dim=1)
            prefix = hf_name.removesuffix("gate_up_proj")
            pieces = [(prefix + "gate_proj", gate), (prefix + "up_proj", up)]
        parts = []
        for piece_name, piece in pieces:
            name = names.get_name(piece_name, try_suffixes=(".weight", ".bias"))
            assert name is not None, piece_name
            name = name if name.endswith((".weight", ".bias")) else name + ".weight"
            parts.append(name)
            if family.arch == "gemma3" and name.endswith("norm.weight"):
                piece = piece + NORM_SHIFT  # llama.cpp stores Gemma's (1 + w) norms whole
            _add_tensor(writer, name, piece.contiguous().numpy(), _type_of(family, name))
        written[hf_name] = tuple(parts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _add_tensor(writer: GGUFWriter, name: str, w: np.ndarray, kind: str) -> None:
    w = w.astype(np.float32)
    if kind == "F32":
        writer.add_tensor(name, w)
    else:
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf_quantize(w, qtype), raw_dtype=qtype)


def _reference(family: Family, path: Path, written: dict[str, tuple[str, ...]]) -> Any:
    """transformers' model of the family with every weight the gguf package's dequantization of
    the file's tensor (an independent check of kvserve's conversion of the file)."""
    from transformers import AutoModelForCausalLM

    reader = GGUFReader(path)
    model = AutoModelForCausalLM.from_config(family.config).to(torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for hf_name, gguf_names in written.items():
            parts = [_dequantized(reader, name) for name in gguf_names]
            if family.arch == "gemma3" and gguf_names[0].endswith("norm.weight"):
                parts = [t - NORM_SHIFT for t in parts]  # as transformers reads them back
            whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)  # gate, up rows
            params[hf_name].copy_(whole.view(params[hf_name].shape))
    return model


def _type_of(family: Family, gguf_name: str) -> str:
    pieces = gguf_name.split(".")
    if pieces[0] == "blk" and pieces[-1] == "weight" and pieces[2] in family.layer_types[0]:
        return family.layer_types[int(pieces[1])][pieces[2]]
    if gguf_name in ("token_embd.weight", "output.weight"):
        return "Q8_0"
    return "F32"  # norms, biases


def _dequantized(reader: GGUFReader, name: str) -> torch.Tensor:
    """The gguf package's own dequantization of a stored tensor: [rows, cols] float32."""
    tensor = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(gguf_dequantize(np.asarray(tensor.data), tensor.tensor_type).copy())


def _family_ids() -> list[str]:
    return ["qwen2", "qwen3", "phi3", "qwen3moe", "gemma3"]


@pytest.fixture(scope="module", params=_family_ids())
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(family, gguf path, LLM as stored, LLM on the dequantized float32 weights)."""
    reader = GGUFReader(find_bundled_model())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    family = next(f for f in _families(vocab) if f.arch == request.param)
    if family.hf_architecture not in MODEL_REGISTRY:
        pytest.skip(f"{family.hf_architecture} is not a kvserve model class yet")
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{family.arch}.gguf"
    reference = _reference(family, path, _write_gguf(family, path))
    cache = str(tmp_path_factory.mktemp("cache"))
    options = {"cache_dir": cache, "max_num_seqs": 4, "enable_prefix_caching": False}
    stored = LLM(str(path), quantization="gguf", **options)
    floats = LLM(str(path), dtype="float32", quantization="none", **options)
    return family, path, stored, floats, reference


def test_the_architecture_is_served_as_stored(served: tuple) -> None:
    family, _, stored, _, _ = served
    assert stored.engine.model.head_dim == family.head_dim
    assert family.arch in GGUF_ARCHS and not GGUF_ARCHS[family.arch].unpermute_qk


def test_every_block_weight_is_the_files_blocks(served: tuple) -> None:
    family, path, stored, floats, _ = served
    model, float_model = stored.engine.model, floats.engine.model
    reader = GGUFReader(path)
    float_params = dict(float_model.named_parameters())
    kept = 0
    for i, types in enumerate(family.layer_types):
        layer = model.layers[i]
        for ours, parts in family.parts.items():
            owner, attr = ours.rsplit(".", 1)
            weight = getattr(layer.get_submodule(owner), attr)
            expected = float_params[f"layers.{i}.{ours}"]  # what transformers dequantized
            formats = [FORMATS.get(types[p]) for p in parts]
            if None in formats:  # not runnable as stored: Q8_0 from floats
                assert isinstance(weight, BlockQ8Weight), (i, ours)
                continue
            if len(set(formats)) > 1:  # parts in different formats: each its own blocks
                assert isinstance(weight, BlockParts), (i, ours)
            else:
                assert weight.kind == formats[0], (i, ours)
            stored_parts = [_dequantized(reader, f"blk.{i}.{p}.weight") for p in parts]
            if ".experts." in ours:  # [experts, rows, cols]: this expert's rows
                expert = int(ours.split(".")[2])
                stored_parts = [t[expert] for t in stored_parts]
            theirs = torch.cat(stored_parts)
            assert torch.equal(weight.dequantize(), theirs), (i, ours)  # gguf's own dequantization
            assert torch.equal(theirs, expected), (i, ours)
            kept += 1
    assert kept == family.num_as_stored() >= 6
    head = model.lm_head_weight
    assert isinstance(head, BlockQ8Weight)
    head_name = "token_embd.weight" if family.tied else "output.weight"
    assert torch.equal(head.dequantize(), _dequantized(reader, head_name))


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(served: tuple) -> None:
    family, path, stored, floats, reference = served
    # Token ids, not text: SmolLM2's BPE vocabulary under a Gemma tokenizer converter tokenizes
    # differently per reader; the weights are what is under test.
    prompts = [list(floats.tokenizer.encode(p)) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in floats.generate(prompts, params)]
    for ids, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(  # an explicit mask: an id equal to pad_token_id is text here
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                min_new_tokens=12,
            )
        assert list(tokens) == out[0, len(ids) :].tolist(), ids
    assert len({tuple(t) for t in ours}) > 1  # the prompts lead to different continuations
    alone = [stored.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in stored.generate(prompts, params)]
    assert together == alone and all(len(t) == 12 for t in alone)


def test_a_file_whose_tensors_do_not_fit_its_metadata_is_refused(tmp_path: Path) -> None:
    """transformers re-initializes such tensors at random; the conversion must not serve that."""
    from engine.models.loader import resolve_model

    vocab = len(GGUFReader(find_bundled_model()).fields["tokenizer.ggml.tokens"].data)
    family = next(f for f in _families(vocab) if f.arch == "qwen3")
    path = tmp_path / "wrong-head-dim.gguf"
    _write_gguf(family, path, key_length=16)  # the tensors have head_dim 32
    with pytest.raises(ValueError, match="could not convert GGUF file .*wrong-head-dim.gguf"):
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"))
