"""GGUF K-quants served as stored: Q4_K, Q5_K and Q6_K blocks (valid blocks built from random
bytes with sane scales: the gguf package cannot quantize K-quants, and dequantization is what is
checked) parsed bitwise as `gguf.quants.dequantize` reads them; the kq_linear kernels within
tolerance of a float matmul, bitwise batch-invariant and bitwise equal on every ISA path this CPU
runs; and a tiny random Llama written as a Q4_K_M-like file (Q4_K, Q5_K, Q6_K, Q8_0, F16 and F32
tensors, fused weights whose parts mix them, a layer all K-quants that decode steps run in one C++
call) served with every matmul as stored, each weight the
file's blocks, greedy tokens equal to the same model on its dequantized float32 weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.models.block_parts import BlockParts
from engine.models.cpu_features import BLOCK_KERNEL_PATHS, block_kernel_probe
from engine.models.kquant import BlockKWeight, from_gguf_kblocks
from engine.models.kquant import synthetic_kblocks as random_kblocks
from tests.model.gguf_files import FUSED, TinyLlama, gguf_rows, int8_activations, write_tiny_llama

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

KINDS = ("Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_bitwise_as_gguf(kind: str) -> None:
    rng = np.random.default_rng(1)
    raw = random_kblocks(kind, 13, 768, rng)
    raw[0, :] = rng.integers(0, 256, raw.shape[1], dtype=np.uint8)  # any bytes, any scales
    values = from_gguf_kblocks(kind, raw, (13, 768))
    theirs = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(13, 768)
    ours = values.dequantize().numpy()
    finite = np.isfinite(theirs).all(axis=1)  # random fp16 bytes may be inf/NaN scales
    assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))
    # Interleaved for the kernels and read back: the same values, the same floats.
    weight = BlockKWeight(values)
    back = weight.values()
    for field in ("q", "d", "dmin", "sc"):
        assert torch.equal(getattr(back, field), getattr(values, field)), field
    padded = 16 * raw.shape[1]  # the file's bytes of 16 rows (13 padded to 2 groups of 8)
    assert padded < weight.nbytes <= padded * 1.03  # 148 / 180 / 212 bytes per 144 / 176 / 210


def _paths() -> list[str]:
    return [p for p in BLOCK_KERNEL_PATHS if block_kernel_probe(p) == ""]


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_match_floats_and_agree_on_every_path(kind: str) -> None:
    rng = np.random.default_rng(2)
    rows, cols = 20, 512  # 3 column groups (the last padded), 2 super-blocks
    values = from_gguf_kblocks(kind, random_kblocks(kind, rows, cols, rng), (rows, cols))
    weight = BlockKWeight(values)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(3))  # tiles of 4, and 1
    expected = x @ values.dequantize().T
    ops: Any = torch.ops.kvserve
    auto = str(ops.block_kernels_path())
    outs = {}
    try:
        for path in _paths():
            ops.block_kernels_select(path)
            outs[path] = weight.matmul(x)
            alone = torch.cat([weight.matmul(x[i : i + 1]) for i in range(len(x))])
            assert torch.equal(alone, outs[path]), path  # batch-invariant, bitwise
    finally:
        ops.block_kernels_select(auto)
    assert "portable" in outs and len(outs) >= 2 or len(_paths()) == 1
    for path, out in outs.items():
        assert torch.equal(out, outs["portable"]), path
    err = (outs["portable"] - expected).abs().max() / expected.abs().max()
    assert err < 0.02, err  # int8 activations per block of 32


# ---------------------------------------------------------------- a Q4_K_M-like file end to end

HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 4, 2
LAYER_TYPES = [
    {  # as llama.cpp's Q4_K_M: Q6_K for attn_v and ffn_down in some layers
        "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
        "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K",
    },
    {  # Q5_K, and Q8_0 / F16 tensors beside them; gate and up in different K-quants
        "attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q5_K", "attn_output": "F16",
        "ffn_gate": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q8_0",
    },
    {  # every matmul one K-quant: decode steps run this layer in one C++ call (decode_layer)
        "attn_q": "Q6_K", "attn_k": "Q6_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
        "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K",
    },
]  # fmt: skip
SERVED_AS = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q8_0": "q8_0"}
# Q4_K embedding; a Q6_K head of large logits: clear greedy choices
SPEC = TinyLlama(HIDDEN, INTER, HEADS, KV_HEADS, LAYER_TYPES, ("Q4_K", 0.5), ("Q6_K", 0.5))


@pytest.fixture(scope="module")
def kquant_llms(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LLM, LLM]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-q4_k_m.gguf"
    write_tiny_llama(path, SPEC)
    cache = str(tmp_path_factory.mktemp("cache"))
    options = {"cache_dir": cache, "max_num_seqs": 4, "enable_prefix_caching": False}
    stored = LLM(str(path), quantization="gguf", **options)
    floats = LLM(str(path), dtype="float32", quantization="none", **options)
    return path, stored, floats


def test_every_weight_of_the_file_is_served_as_stored(kquant_llms: tuple[Path, LLM, LLM]) -> None:
    path, stored, floats = kquant_llms
    model, float_params = stored.engine.model, dict(floats.engine.model.named_parameters())
    reader = GGUFReader(path)
    for i, types in enumerate(LAYER_TYPES):
        for ours, parts in FUSED.items():
            owner, attr = ours.split(".")
            weight = getattr(getattr(model.layers[i], owner), attr)
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}
            theirs = torch.cat(
                [gguf_rows(reader, f"blk.{i}.{p}.weight", heads.get(p)) for p in parts]
            )
            assert torch.equal(theirs, float_params[f"layers.{i}.{ours}"]), (i, ours)
            kinds = [SERVED_AS.get(types[p]) for p in parts]
            if None in kinds:  # the F16 tensor: packed from its floats as Q8_0
                assert weight.kind == "q8_0", (i, ours)
                continue
            runs = [k for j, k in enumerate(kinds) if j == 0 or kinds[j - 1] != k]
            assert weight.kind == "+".join(runs), (i, ours)
            assert isinstance(weight, BlockParts) == (len(runs) > 1), (i, ours)
            assert torch.equal(weight.dequantize(), theirs), (i, ours)  # bitwise gguf's floats
    assert all(args is not None for args in model._decode_calls())  # parts too: one C++ call
    head = model.lm_head_weight
    assert isinstance(head, BlockKWeight) and head.kind == "q6_k"
    assert torch.equal(head.dequantize(), gguf_rows(reader, "output.weight", None))
    # the Q4_K embedding is looked up in the float table transformers dequantized
    ids = torch.tensor([0, 3, 49151])
    assert torch.equal(model.embed_tokens(ids), gguf_rows(reader, "token_embd.weight", None)[ids])


def test_greedy_tokens_follow_the_dequantized_model(kquant_llms: tuple[Path, LLM, LLM]) -> None:
    """The same weights; only the int8 activations (per row and block of 32) differ from float32:
    along the float model's greedy continuation (teacher-forced), every token's logprob is close,
    and wherever float32's choice is clear, the K-quant kernels choose it too."""
    _, stored, floats = kquant_llms
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [list(floats.tokenizer.encode(t)) for t in ("Hello there", "The capital of", "def")]
    continuations = [list(o.outputs[0].token_ids) for o in floats.generate(prompts, params)]
    forced = [p + c for p, c in zip(prompts, continuations, strict=True)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    ours = [o.prompt_logprobs for o in stored.generate(forced, score)]
    theirs = [o.prompt_logprobs for o in floats.generate(forced, score)]
    clear, worst = 0, 0.0
    for prompt, mine, ref in zip(prompts, ours, theirs, strict=True):
        assert mine is not None and ref is not None
        for got, want in zip(mine[len(prompt) :], ref[len(prompt) :], strict=True):
            assert got is not None and want is not None
            worst = max(worst, abs(got.logprob - want.logprob))
            if want.rank == 1 and want.top[0][1] - want.top[1][1] > 0.5:
                assert got.rank == 1, (got, want)
                clear += 1
    print(f"K-quants vs float32: logprobs within {worst:.3f}; all {clear} clear choices kept")
    assert worst < 0.3  # logits of std ~5 here: int8 activations move them by ~1%
    assert clear >= 18
    generated = [o.outputs[0].token_ids for o in stored.generate(prompts, params)]
    alone = [stored.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert alone == generated and generated[0][0] == continuations[0][0]  # batch-invariant
    # Decode steps (one C++ call per layer, K-quant and mixed-part matmuls) give bitwise the
    # logprobs the prefill of the same tokens (the Python layer) gives.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in stored.generate(prompts, params)]
    refed = [p + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    scored = stored.generate(
        refed, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    )
    for prompt, out, again in zip(prompts, outs, scored, strict=True):
        assert out.logprobs is not None and again.prompt_logprobs is not None
        decoded = [e.logprob for e in out.logprobs]
        prefilled = [e.logprob for e in again.prompt_logprobs[len(prompt) :] if e is not None]
        assert decoded == prefilled


def test_the_served_formats_key_tells_k_quants_as_stored_apart(
    kquant_llms: tuple[Path, LLM, LLM],
) -> None:
    """KV caches keyed by model identity must not reuse KV computed when these K-quants were served
    as Q8_0 (before they were served as stored): the key names each weight's block format."""
    from engine.models.quantization import _from_float, served_formats

    _, stored, _ = kquant_llms
    model = stored.engine.model
    key = served_formats(model)
    assert key == served_formats(model) and len(key) == 16
    layer = model.layers[0].mlp
    as_stored = layer.down_weight
    try:
        layer.down_weight = _from_float(as_stored.dequantize(), "q8_0")  # the old way
        assert served_formats(model) != key
    finally:
        layer.down_weight = as_stored
    assert served_formats(model) == key


def test_q4_0_is_served_in_its_own_18_bytes_per_block() -> None:
    """Q4_0 (w = d (q - 8)) stores no minimum: each block's integer dot product takes the
    weights as q - 8 (exact), then one fma per block, so it reads 18 bytes per block, gives the same
    bits on every path and batch size, and lands nearer the exact product than Q4_1's arithmetic
    with m = -8 d stored (one rounding per block fewer)."""
    from engine.models.block_quant import BlockQ4Weight, BlockValues, from_gguf_blocks

    rng = np.random.default_rng(4)
    w = rng.standard_normal((20, 96)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType.Q4_0)
    values = from_gguf_blocks("Q4_0", raw, (20, 96))
    theirs = gguf_dequantize(raw, GGMLQuantizationType.Q4_0).reshape(20, 96)
    assert np.array_equal(values.dequantize().numpy(), theirs)  # (d * 0 may be -0 there)
    q4_0 = BlockQ4Weight(values)
    as_q4_1 = BlockQ4Weight(BlockValues("q4_1", values.q, values.d, values.m))
    assert q4_0.kind == "q4_0" and q4_0.m.numel() == 0
    assert q4_0.nbytes == 24 * 3 * 18 and as_q4_1.nbytes == 24 * 3 * 20  # 20 rows padded to 24
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(5))
    ops: Any = torch.ops.kvserve
    auto = str(ops.block_kernels_path())
    try:
        ops.block_kernels_select("portable")
        expected, with_m = q4_0.matmul(x), as_q4_1.matmul(x)
        for path in _paths():
            ops.block_kernels_select(path)
            assert torch.equal(q4_0.matmul(x), expected), path
            assert torch.equal(q4_0.matmul(x[:1]), expected[:1]), path
    finally:
        ops.block_kernels_select(auto)
    # The exact product of the dequantized weights and the int8 activations the kernels use.
    exact = int8_activations(x).double() @ torch.from_numpy(theirs).double().T
    assert torch.allclose(expected.double(), exact, rtol=1e-5, atol=1e-4)
    error = (expected.double() - exact).abs().sum()
    assert error <= (with_m.double() - exact).abs().sum()
    back = q4_0.values()
    assert all(torch.equal(getattr(back, f), getattr(values, f)) for f in ("q", "d", "m"))
