"""Tiny random Llamas written as llama.cpp-style GGUF files with the `gguf` package's GGUFWriter
(SmolLM2's tokenizer from the bundled file, any mix of tensor types per layer), and the `gguf`
package's own dequantization of a file's tensors in HF row order: the shared writer of the
served-as-stored tests (test_gguf_blocks, test_gguf_kquants, test_gguf_q5); and the int8
activations the block kernels compute with, for exact reference products."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.models.kquant import KQUANT_BLOCK_BYTES, synthetic_kblocks
from engine.models.loader import find_bundled_model

# Our fused weight -> its llama.cpp parts, in fused row order.
FUSED = {
    "self_attn.qkv_weight": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_weight": ("attn_output",),
    "mlp.gate_up_weight": ("ffn_gate", "ffn_up"),
    "mlp.down_weight": ("ffn_down",),
}


@dataclass(frozen=True)
class TinyLlama:
    """A file's shape and the GGUF type of each tensor ("F32", "F16", or a block type: K-quants
    as valid random blocks, the others gguf's quantization of random floats)."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    layer_types: list[dict[str, str]]  # per layer: llama.cpp part (attn_q, ...) -> type
    embed: tuple[str, float]  # token_embd.weight: type, weight std
    head: tuple[str, float]  # output.weight (untied)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def shapes(self) -> dict[str, tuple[int, int]]:  # llama.cpp part -> [rows, cols]
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return {
            "attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
            "ffn_gate": (self.inter, h), "ffn_up": (self.inter, h), "ffn_down": (h, self.inter),
        }  # fmt: skip


def _tensor(kind: str, shape: tuple[int, int], rng: np.random.Generator, std: float) -> np.ndarray:
    if kind in KQUANT_BLOCK_BYTES:  # the gguf package cannot quantize K-quants
        return synthetic_kblocks(kind, *shape, rng, std)
    w = (rng.standard_normal(shape) * std).astype(np.float32)
    if kind == "F32":
        return w
    if kind == "F16":
        return w.astype(np.float16)
    return gguf_quantize(w, GGMLQuantizationType[kind])


def write_tiny_llama(path: Path, spec: TinyLlama, seed: int = 0) -> None:
    bundled = GGUFReader(find_bundled_model())
    writer = GGUFWriter(path, "llama")
    for key, field in bundled.fields.items():  # SmolLM2's tokenizer, as GGUF stores it
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    vocab = len(bundled.fields["tokenizer.ggml.tokens"].data)
    writer.add_vocab_size(vocab)
    writer.add_context_length(512)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.inter)
    writer.add_block_count(len(spec.layer_types))
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(spec.head_dim)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, int], kind: str, std: float = 0.1) -> None:
        tensor = _tensor(kind, shape, rng, std)
        raw = None if kind in ("F32", "F16") else GGMLQuantizationType[kind]
        writer.add_tensor(name, tensor, raw_dtype=raw)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(spec.hidden)).astype(np.float32))

    add("token_embd.weight", (vocab, spec.hidden), *spec.embed)
    norm("output_norm.weight")
    add("output.weight", (vocab, spec.hidden), *spec.head)
    for i, types in enumerate(spec.layer_types):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for part, shape in spec.shapes().items():
            add(f"blk.{i}.{part}.weight", shape, types[part])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_row_order(rows: int, heads: int) -> torch.Tensor:
    """The GGUF row of each HF row of a q/k weight (take rows in this order for HF's): llama.cpp's
    converter puts each head's rotary pairs adjacent (GGUF row h*d + 2i + t), HF pairs the head's
    halves (row h*d + t*d/2 + i)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_rows(reader: GGUFReader, name: str, heads: int | None = None) -> torch.Tensor:
    """gguf's dequantization of a tensor, rows in HF order (`heads`: a q/k weight of that many
    heads, whose rows llama.cpp permutes)."""
    tensor = next(t for t in reader.tensors if t.name == name)
    w = torch.from_numpy(
        np.ascontiguousarray(gguf_dequantize(np.asarray(tensor.data), tensor.tensor_type))
    )
    return w if heads is None else w[hf_row_order(w.shape[0], heads)]


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] as the block kernels quantize it (per row and block of 32: d = max|x| / 127,
    q = round-half-even(x * 127 / max|x|); an all-zero block stays zero), back in float32."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * (127.0 / amax)) * (amax / 127.0)
    return torch.where(amax > 0, q, 0.0).view_as(x)
