"""llama.cpp-style GGUF files served as stored: a tiny random Llama written with the `gguf` package's
GGUFWriter (Q8_0 and Q4_0 tensors, q/k rows in llama.cpp's rotary order, a float tensor, a fused
weight whose parts use different block types, an untied head), loaded with --quantization gguf.
Its block weights must be the file's bytes (read independently with gguf.GGUFReader), bitwise the
float weights transformers dequantized; the rest is packed from the floats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.models.block_parts import BlockParts
from engine.models.block_quant import BlockQ8Weight, BlockValues, from_gguf_blocks
from engine.models.gguf_blocks import read_gguf_index
from engine.models.loader import find_bundled_model

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
# Each layer's tensors and the type they are stored as ("F32" = a float tensor).
LAYER_TYPES = [
    {  # every matmul in a block type kvserve runs as stored
        "attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q8_0",
        "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0",
    },
    {  # qkv mixes Q8_0 and Q4_0 (served part by part); attn_output is float
        "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_0", "attn_output": "F32",
        "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0",
    },
]  # fmt: skip
FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type -> kvserve's block format
HEAD_TYPE = "Q8_0"  # output.weight (untied); token_embd.weight is Q4_0
# Our fused weight -> its llama.cpp parts, in fused row order.
FUSED = {
    "self_attn.qkv_weight": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_weight": ("attn_output",),
    "mlp.gate_up_weight": ("ffn_gate", "ffn_up"),
    "mlp.down_weight": ("ffn_down",),
}


def _to_llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders q/k rows so rotary pairs are adjacent (HF pairs the halves)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_tiny_gguf(path: Path) -> None:
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
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    rng = np.random.default_rng(0)

    def add(name: str, w: np.ndarray, kind: str) -> None:
        w = w.astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, w)
        else:
            qtype = GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf_quantize(w, qtype), raw_dtype=qtype)

    def matrix(rows: int, cols: int, scale: float = 0.1) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * scale

    add("token_embd.weight", matrix(vocab, HIDDEN, 0.05), "Q4_0")
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), "F32")
    add("output.weight", matrix(vocab, HIDDEN, 0.05), HEAD_TYPE)
    shapes = {
        "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
    }  # fmt: skip
    for i, types in enumerate(LAYER_TYPES):
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), "F32")
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN), "F32")
        for part, shape in shapes.items():
            w = matrix(*shape)
            if part in ("attn_q", "attn_k"):
                w = _to_llama_cpp_rows(w, HEADS if part == "attn_q" else KV_HEADS)
            add(f"blk.{i}.{part}.weight", w, types[part])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _stored_values(reader: GGUFReader, name: str) -> BlockValues:
    """A tensor's blocks from the file (read by the gguf package), rows in HF order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    k, n = (int(d) for d in tensor.shape)
    values = from_gguf_blocks(tensor.tensor_type.name, np.asarray(tensor.data), (n, k))
    for part, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS)):
        if f".{part}." in name:  # GGUF row r holds HF row hf_of[r]
            hf_of = _to_llama_cpp_rows(np.arange(n), heads)
            values = values.rows(torch.from_numpy(np.argsort(hf_of)))
    return values


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def llms(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, LLM]:
    """(as stored, float32): one conversion of the file, served both ways."""
    cache = str(tmp_path_factory.mktemp("cache"))
    options = {"cache_dir": cache, "max_num_seqs": 4, "enable_prefix_caching": False}
    stored = LLM(str(tiny_gguf), quantization="gguf", **options)
    floats = LLM(str(tiny_gguf), dtype="float32", quantization="none", **options)
    return stored, floats


def test_the_header_index_matches_the_gguf_package(tiny_gguf: Path) -> None:
    for path in (tiny_gguf, find_bundled_model()):
        arch, tensors = read_gguf_index(path)
        reader = GGUFReader(path)
        assert arch == "llama"
        theirs = [
            (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset))
            for t in reader.tensors
        ]
        assert [(t.name, t.shape, t.type_id, t.offset) for t in tensors] == theirs


def test_llama_cpp_blocks_load_as_stored(llms: tuple[LLM, LLM], tiny_gguf: Path) -> None:
    stored, floats = llms
    model, float_model = stored.engine.model, floats.engine.model
    assert not model.tie_word_embeddings
    reader = GGUFReader(tiny_gguf)
    float_params = dict(float_model.named_parameters())
    kept = 0
    for i, types in enumerate(LAYER_TYPES):
        layer = model.layers[i]
        for ours, parts in FUSED.items():
            owner_name, attr = ours.split(".")
            weight = getattr(getattr(layer, owner_name), attr)
            expected = float_params[f"layers.{i}.{ours}"]
            formats = [FORMATS.get(types[p]) for p in parts]
            if None in formats:
                # not runnable as stored: packed from the float weights as Q8_0
                assert isinstance(weight, BlockQ8Weight), (i, ours)
                err = (weight.dequantize() - expected).abs().max() / expected.abs().max()
                assert 0 < err < 1 / 127, (i, ours)
                continue
            stored = [_stored_values(reader, f"blk.{i}.{p}.weight") for p in parts]
            if len(set(formats)) > 1:  # parts in different formats: each its own blocks
                assert isinstance(weight, BlockParts), (i, ours)
                runs = [(weight.parts[0], stored[:2]), (weight.parts[1], stored[2:])]
            else:
                runs = [(weight, stored)]
            for served_part, values_parts in runs:
                values = BlockValues.cat(values_parts)
                assert served_part.kind == values.kind, (i, ours)
                served = served_part.values()
                for field in ("q", "d", "m"):  # Q4_0: m = -8 d (derived, not stored)
                    assert torch.equal(getattr(served, field), getattr(values, field)), (i, ours)
            assert torch.equal(weight.dequantize(), expected), (i, ours)  # transformers' floats
            kept += 1
    assert kept == 7
    head = model.lm_head_weight
    assert isinstance(head, BlockQ8Weight)
    assert torch.equal(head.values().q, _stored_values(reader, "output.weight").q)
    assert torch.equal(head.dequantize(), float_model.lm_head_weight)
    # untied: the Q4_0 embedding is looked up in the float table transformers dequantized
    ids = torch.tensor([0, 3, 49151])
    assert torch.equal(model.embed_tokens(ids), float_model.embed_tokens(ids))


def test_the_stored_blocks_serve_batch_invariant_tokens(llms: tuple[LLM, LLM]) -> None:
    stored, _ = llms
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello there", "The capital of France is", "def f(x):"]
    alone = [stored.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in stored.generate(prompts, params)]
    assert together == alone and all(len(t) == 8 for t in alone)
