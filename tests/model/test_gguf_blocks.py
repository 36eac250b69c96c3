"""llama.cpp-style GGUF files served as stored: a tiny random Llama written with the `gguf` package's
GGUFWriter (tests/model/gguf_files.py: Q8_0 and Q4_0 tensors, q/k rows in llama.cpp's rotary order, a float tensor, a fused
weight whose parts use different block types, an untied head), loaded with --quantization gguf.
Its block weights must be the file's bytes (read independently with gguf.GGUFReader), bitwise the
float weights transformers dequantized; the rest is packed from the floats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.models.block_parts import BlockParts
from engine.models.block_quant import BlockQ8Weight, BlockValues, from_gguf_blocks
from engine.models.gguf_blocks import read_gguf_index
from engine.models.loader import find_bundled_model
from tests.model.gguf_files import FUSED, TinyLlama, hf_row_order, write_tiny_llama

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

HIDDEN, INTER, HEADS, KV_HEADS = 64, 128, 4, 2
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
# token_embd.weight Q4_0; output.weight (untied) Q8_0
SPEC = TinyLlama(HIDDEN, INTER, HEADS, KV_HEADS, LAYER_TYPES, ("Q4_0", 0.05), ("Q8_0", 0.05))


def _stored_values(reader: GGUFReader, name: str) -> BlockValues:
    """A tensor's blocks from the file (read by the gguf package), rows in HF order."""
    tensor = next(t for t in reader.tensors if t.name == name)
    k, n = (int(d) for d in tensor.shape)
    values = from_gguf_blocks(tensor.tensor_type.name, np.asarray(tensor.data), (n, k))
    for part, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS)):
        if f".{part}." in name:
            values = values.rows(hf_row_order(n, heads))
    return values


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(path, SPEC)
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
