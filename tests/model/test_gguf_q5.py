"""GGUF Q5_0 and Q5_1 served as stored (llama-quantize's fallback for rows not a multiple of 256:
a SmolLM2 Q4_K_M keeps its 576-wide rows as Q5_0, a Q5_K_M as Q5_1): blocks parsed bitwise as
`gguf.quants.dequantize` reads them; the q5_linear kernels within tolerance of a float matmul and
bitwise equal on every ISA path this CPU runs, alone or in any batch, on 1 or 2 threads; Q5_0 (no
m stored) summing q - 16 in integers, nearer the exact product than Q5_1 with m = -16 d; and a tiny
random Llama whose tensors are Q5_0 and Q5_1 (beside Q8_0, Q4_K and Q6_K parts of the same fused
weights) served with every matmul as stored, each weight gguf's dequantization of the file, greedy
tokens following the same model on its dequantized float32 weights, decode steps in one C++ call
per layer."""

from __future__ import annotations

from collections.abc import Iterator
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
from engine.models.block_q5 import Q5_BLOCK_BYTES, BlockQ5Weight, Q5Values, from_gguf_q5blocks
from engine.models.cpu_features import BLOCK_KERNEL_PATHS, block_kernel_probe
from tests.model.gguf_files import FUSED, TinyLlama, gguf_rows, int8_activations, write_tiny_llama

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="kvserve's C++ CPU kernels could not be built here"
)

KINDS = ("Q5_0", "Q5_1")


def _ops() -> Any:
    return torch.ops.kvserve


@pytest.fixture
def restore_path() -> Iterator[None]:
    before = str(_ops().block_kernels_path())
    yield
    _ops().block_kernels_select(before)


def _paths() -> list[str]:
    return [p for p in BLOCK_KERNEL_PATHS if block_kernel_probe(p) == ""]


def _raw(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """gguf's quantization of random floats, with extreme blocks: all zero, and any bytes."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0
    raw = gguf_quantize(w, GGMLQuantizationType[kind])
    size = Q5_BLOCK_BYTES[kind]
    noise = rng.integers(0, 256, raw.shape[1], dtype=np.uint8).reshape(-1, size)
    noise[:, 0:4] = raw[1].reshape(-1, size)[:, 0:4]  # finite scales (d, and m for Q5_1)
    raw[1] = noise.reshape(-1)  # every q value, every fifth bit
    return raw


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_dequantize_bitwise_as_gguf(kind: str) -> None:
    raw = _raw(kind, 13, 160, 1)
    values = from_gguf_q5blocks(kind, raw, (13, 160))
    theirs = gguf_dequantize(raw, GGMLQuantizationType[kind]).reshape(13, 160)
    ours = values.dequantize().numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # -0.0 included
    assert int(values.q.max()) == 31 and int(values.q.min()) == 0
    # Interleaved for the kernels and read back: the same values, the same floats.
    weight = BlockQ5Weight(values)
    back = weight.values()
    assert isinstance(back, Q5Values) and back.kind == kind.lower()
    for field in ("q", "d", "m"):
        assert torch.equal(getattr(back, field), getattr(values, field)), field
    assert weight.nbytes == 16 * raw.shape[1]  # the file's bytes of 16 rows (13 padded to 2x8)
    # row slices and concatenation (fused q/k/v) keep the Q5 values
    fused = Q5Values.cat([values.rows(torch.arange(5)), values.rows(torch.arange(5, 13))])
    assert isinstance(fused, Q5Values) and torch.equal(fused.dequantize(), values.dequantize())


def _activations(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    x = x * torch.logspace(-2, 3, rows)[:, None]
    x[rows // 2, :64] = 0.0  # zero blocks: scale 0
    x[-1, 5] = 1e4  # one large value dominates its block's scale
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_match_floats_and_agree_on_every_path(kind: str, restore_path: None) -> None:
    """Rows 1..130 (every row tile remainder, the ymm / zmm switch at 8 rows, 64-row panels), 20
    columns (3 groups, the last padded: a lone group on the zmm pairs), 5 blocks."""
    rows, cols = 20, 160
    values = from_gguf_q5blocks(kind, _raw(kind, rows, cols, 2), (rows, cols))
    weight = BlockQ5Weight(values)
    x = _activations(130, cols)
    outs = {}
    for path in _paths():
        _ops().block_kernels_select(path)
        outs[path] = weight.matmul(x)
        for n in range(1, 131):
            assert torch.equal(weight.matmul(x[:n].contiguous()), outs[path][:n]), (path, n)
        alone = torch.cat([weight.matmul(x[i : i + 1]) for i in range(0, 130, 7)])
        assert torch.equal(alone, outs[path][::7]), path  # batch-invariant, bitwise
    assert "portable" in outs and (len(outs) >= 2 or len(_paths()) == 1)
    for path, out in outs.items():
        assert torch.equal(out, outs["portable"]), path
    moderate = slice(20, 100)  # rows whose int8 activations are not dominated by one value
    expected = x[moderate] @ values.dequantize().T
    err = (outs["portable"][moderate] - expected).abs().max() / expected.abs().max()
    assert err < 0.02, err  # int8 activations per block of 32


@pytest.mark.parametrize("kind", KINDS)
def test_every_path_is_thread_invariant(kind: str, restore_path: None) -> None:
    """SmolLM2-shaped columns (N = 576, K = 576: Q5_0 in its Q4_K_M file), 1 and 2 threads."""
    values = from_gguf_q5blocks(kind, _raw(kind, 576, 576, 5), (576, 576))
    weight = BlockQ5Weight(values)
    x = _activations(40, 576)
    previous = torch.get_num_threads()
    results = []
    for path in _paths():
        _ops().block_kernels_select(path)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                results.append(weight.matmul(x))
            finally:
                torch.set_num_threads(previous)
    assert all(torch.equal(r, results[0]) for r in results)


def test_q5_0_reads_22_bytes_per_block_and_sums_q_minus_16(restore_path: None) -> None:
    """Q5_0 (w = d (q - 16)) stores no minimum: each block's integer dot product takes the
    weights as q - 16 (exact), then one fma per block, from 22 bytes per block; every path gives the
    same bits, close to Q5_1's arithmetic with m = -16 d stored and no farther from the exact
    product."""
    values = from_gguf_q5blocks("Q5_0", _raw("Q5_0", 20, 96, 4), (20, 96))
    q5_0 = BlockQ5Weight(values)
    as_q5_1 = BlockQ5Weight(Q5Values("q5_1", values.q, values.d, values.m))
    assert q5_0.m.numel() == 0 and q5_0.nbytes == 24 * 3 * 22 and as_q5_1.nbytes == 24 * 3 * 24
    x = _activations(13, 96)
    _ops().block_kernels_select("portable")
    expected, with_m = q5_0.matmul(x), as_q5_1.matmul(x)
    for path in _paths():
        _ops().block_kernels_select(path)
        assert torch.equal(q5_0.matmul(x), expected), path
        assert torch.equal(q5_0.matmul(x[:1]), expected[:1]), path
    # The exact product of the dequantized weights and the int8 activations the kernels use.
    exact = int8_activations(x).double() @ values.dequantize().double().T
    scale = exact.abs().max()
    assert torch.allclose(expected.double(), exact, rtol=1e-5, atol=1e-5 * float(scale))
    assert (expected.double() - exact).abs().sum() <= (with_m.double() - exact).abs().sum()


# ---------------------------------------------------------------- a Q5 file end to end

HIDDEN, INTER, HEADS, KV_HEADS = 160, 256, 4, 2  # rows of 160: no K-quant fits, as SmolLM2's 576
LAYER_TYPES = [
    {  # as llama-quantize's Q4_K_M of SmolLM2: Q5_0 for Q4_K, Q8_0 for Q6_K where rows are short
        "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0",
        "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K",
    },
    {  # as its Q5_K_M: Q5_1; gate and up in different Q5 types, a Q4_K down
        "attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q5_1", "attn_output": "Q5_1",
        "ffn_gate": "Q5_1", "ffn_up": "Q5_0", "ffn_down": "Q4_K",
    },
    {  # every matmul one Q5 type
        "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q5_0", "attn_output": "Q5_1",
        "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "ffn_down": "Q5_0",
    },
]  # fmt: skip
SERVED_AS = {"Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
# a Q5_0 embedding; a Q5_1 head of large logits: clear greedy choices
SPEC = TinyLlama(HIDDEN, INTER, HEADS, KV_HEADS, LAYER_TYPES, ("Q5_0", 0.5), ("Q5_1", 0.5))


@pytest.fixture(scope="module")
def q5_llms(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LLM, LLM]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama-q5.gguf"
    write_tiny_llama(path, SPEC)
    cache = str(tmp_path_factory.mktemp("cache"))
    options = {"cache_dir": cache, "max_num_seqs": 4, "enable_prefix_caching": False}
    stored = LLM(str(path), quantization="gguf", **options)
    floats = LLM(str(path), dtype="float32", quantization="none", **options)
    return path, stored, floats


def test_every_weight_of_the_file_is_served_as_stored(q5_llms: tuple[Path, LLM, LLM]) -> None:
    path, stored, floats = q5_llms
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
            kinds = [SERVED_AS[types[p]] for p in parts]
            runs = [k for j, k in enumerate(kinds) if j == 0 or kinds[j - 1] != k]
            assert weight.kind == "+".join(runs), (i, ours)
            assert isinstance(weight, BlockParts) == (len(runs) > 1), (i, ours)
            got = weight.dequantize()
            assert np.array_equal(got.numpy().view(np.uint32), theirs.numpy().view(np.uint32))
    assert all(args is not None for args in model._decode_calls())  # Q5 parts too: one C++ call
    head = model.lm_head_weight
    assert isinstance(head, BlockQ5Weight) and head.kind == "q5_1"
    assert torch.equal(head.dequantize(), gguf_rows(reader, "output.weight"))
    ids = torch.tensor([0, 3, 49151])  # the Q5_0 embedding: the table transformers dequantized
    assert torch.equal(model.embed_tokens(ids), gguf_rows(reader, "token_embd.weight")[ids])


def test_greedy_tokens_follow_the_dequantized_model(q5_llms: tuple[Path, LLM, LLM]) -> None:
    """The same weights; only the int8 activations (per row and block of 32) differ from float32:
    along the float model's greedy continuation (teacher-forced), every token's logprob is close,
    and wherever float32's choice is clear, the Q5 kernels choose it too."""
    _, stored, floats = q5_llms
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
    print(f"Q5 vs float32: logprobs within {worst:.3f}; all {clear} clear choices kept")
    assert worst < 0.3
    assert clear >= 18
    generated = [o.outputs[0].token_ids for o in stored.generate(prompts, params)]
    alone = [stored.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert alone == generated and generated[0][0] == continuations[0][0]  # batch-invariant
    # Decode steps (one C++ call per layer, Q5 and mixed-part matmuls) give bitwise the logprobs
    # the prefill of the same tokens (the Python layer) gives.
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
