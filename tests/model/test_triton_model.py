"""The whole engine with the Triton attention backend against the SDPA reference: greedy tokens of
a random-weight Llama under chunked prefill (prefill chunks over cached context) mixed with decodes.
On CPU the kernels run under Triton's interpreter; on CUDA, compiled."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:  # before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from engine.kernels.attention import attention_backend  # noqa: E402

TEXTS = ("The capital of France is", "def fibonacci(n):", " ".join(["river"] * 70))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_triton_backend_greedy_equals_sdpa(tiny_llama_dir, monkeypatch):
    device = "cuda" if ON_CUDA else "cpu"
    # A 24-token budget: the long prompt is prefilled in chunks that attend to cached context,
    # sharing steps with the other sequences' decodes.
    options = dict(
        device=device,
        dtype="float32",
        max_num_seqs=4,
        num_blocks=64,
        max_num_batched_tokens=24,
        block_size=8,
        cuda_graphs=False,
    )
    try:
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "sdpa")
        attention_backend.cache_clear()
        reference = LLM(str(tiny_llama_dir), **options)
        prompts = [reference.tokenizer.encode(t) for t in TEXTS]
        expected = _greedy(reference, prompts)
        monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
        attention_backend.cache_clear()
        got = _greedy(LLM(str(tiny_llama_dir), **options), prompts)
    finally:
        attention_backend.cache_clear()
    assert got == expected
