"""The one-call C++ decoder layer of pure decode steps (csrc/decode_layer.cpp) gives bitwise the
values of the Python fused layer it replaces, for Llama and Qwen3 (q/k norm) blocks and float, int8
and int4 weights; and the AVX2 float32
decode attention agrees with a dense reference across head sizes, GQA groups and context lengths."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu_kernels
from engine.kernels.attention import AttentionMetadata
from engine.models import decoder_cpu

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ kernels not built")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _run(llm: LLM) -> list[tuple[list[int], list[tuple[float, list[tuple[int, float]]]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params)
    return [
        (list(o.outputs[0].token_ids), [(t.logprob, t.top) for t in o.outputs[0].logprobs or []])
        for o in outs
    ]


@pytest.fixture(scope="module")
def tiny_qwen3_dir(smollm2_dir, tmp_path_factory):
    """A 2-layer Qwen3 (per-head q/k norm, head_dim 32 apart from hidden / heads)."""
    from tests.model.test_qwen3 import qwen3_config
    from tests.model.tiny_models import save_tiny_checkpoint

    config = qwen3_config(smollm2_dir, num_hidden_layers=2)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("qwen3"), smollm2_dir)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_decode_layer_equals_the_python_layer(request, family, quantization, monkeypatch):
    """All layers in one call (decode_layers), one call per layer (decode_layer) and the Python
    fused layer: the same tokens and logprobs, bit for bit."""
    folder = request.getfixturevalue(f"tiny_{family}_dir")
    llm = LLM(str(folder), dtype="float32", quantization=quantization, max_num_seqs=4)
    model = llm.engine.model
    calls: dict[str, int] = {"decode_layer": 0, "decode_layers": 0}

    def counting(name):
        real = getattr(cpu_kernels, name)

        def count(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return count

    for name in calls:
        monkeypatch.setattr(cpu_kernels, name, counting(name))
    whole = _run(llm)
    assert calls == {"decode_layer": 0, "decode_layers": calls["decode_layers"]}
    assert calls["decode_layers"], "pure decode steps should run every layer in one call"

    monkeypatch.setattr(model, "_decode_plan", lambda: None)
    calls.update(decode_layer=0, decode_layers=0)
    per_layer = _run(llm)
    assert calls["decode_layer"] and not calls["decode_layers"]

    monkeypatch.undo()  # the model's own _decode_plan again, then no layer takes the one call
    monkeypatch.setattr(decoder_cpu, "decode_layer_args", lambda layer: None)
    for name in calls:
        monkeypatch.setattr(cpu_kernels, name, counting(name))
    model.weights_changed()
    calls.update(decode_layer=0, decode_layers=0)
    python = _run(llm)
    assert calls == {"decode_layer": 0, "decode_layers": 0}
    assert whole == per_layer == python  # tokens and logprobs, bitwise


def _dense(q, k, v, scale):  # q [H, d], k/v [L, KVH, d]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k.double()) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 40])  # 40: not a multiple of 32 (portable)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (7, 1)])
def test_float32_decode_attention_matches_dense(head_dim, heads, kv_heads):
    torch.manual_seed(head_dim + heads)
    block_size, lens = 16, [1, 7, 8, 9, 33, 150]
    tables = [list(range(1 + 10 * i, 1 + 10 * i + -(-n // block_size))) for i, n in enumerate(lens)]
    cache = torch.randn(2, 64, block_size, kv_heads, head_dim)
    meta = AttentionMetadata.from_lists([1] * len(lens), lens, tables, block_size)
    q = torch.randn(len(lens), heads, head_dim)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale)
    for i, n in enumerate(lens):
        t = torch.arange(n)
        blocks = torch.tensor(tables[i])[t // block_size]
        k, v = cache[0, blocks, t % block_size], cache[1, blocks, t % block_size]
        torch.testing.assert_close(out[i], _dense(q[i], k, v, scale), atol=2e-6, rtol=1e-5)
        alone = cpu_kernels.paged_decode_attention(
            q[i : i + 1], cache, meta.block_tables[i : i + 1], meta.seq_lens[i : i + 1], scale
        )
        assert torch.equal(alone[0], out[i])  # batch-invariant, bitwise


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (15, 3), (12, 4), (7, 1)])
def test_decode_attention_is_the_same_bits_however_the_heads_are_cut(heads, kv_heads):
    """Items of whole query-head groups, pairs of heads or single heads (chosen by the thread
    count: csrc/paged_decode.cpp): every head's output the same bits on 1 to 5 threads."""
    torch.manual_seed(heads)
    lens = [40, 300]
    tables = [list(range(1 + 20 * i, 1 + 20 * i + -(-n // 16))) for i, n in enumerate(lens)]
    cache = torch.randn(2, 64, 16, kv_heads, 64)
    meta = AttentionMetadata.from_lists([1] * len(lens), lens, tables, 16)
    q = torch.randn(len(lens), heads, 64)
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4, 5):
            torch.set_num_threads(threads)
            for rows in (slice(0, 1), slice(1, 2), slice(0, 2)):
                out = cpu_kernels.paged_decode_attention(
                    q[rows], cache, meta.block_tables[rows], meta.seq_lens[rows], 0.125
                )
                outs.append((rows, out))
    finally:
        torch.set_num_threads(previous)
    reference = outs[2][1]  # one thread, both sequences
    for rows, out in outs:
        assert torch.equal(out, reference[rows])


def test_decode_attention_of_extreme_scores_stays_finite():
    cache = torch.zeros(2, 4, 16, 1, 64)
    cache[0, 1, :5] = 1000.0  # huge logits: the softmax must not overflow
    cache[1, 1, :5] = torch.arange(5.0)[:, None, None]
    q = torch.full((1, 1, 64), 10.0)
    meta = AttentionMetadata.from_lists([1], [5], [[1]], 16)
    out = cpu_kernels.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, 0], torch.full((64,), 2.0))  # equal scores: mean of 0..4
