"""Embedding requests through the async engine: batched within the token budget, identical to the
model run directly, and refused on the wrong kind of engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncLLMEngine, EngineConfig, SamplingParams
from engine.embeddings.embedding_model import EmbeddingModel

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "Paged attention keeps each sequence's KV history in fixed-size blocks.",
    "¿Dónde está la biblioteca?",
    "短い文です。",
    "Embeddings 🚀 map text to vectors.",
]


@pytest.fixture(scope="module")
def embed_engine(minilm_dir):
    # A budget of 40 tokens forces these inputs into several engine steps.
    config = EngineConfig.from_options(
        str(minilm_dir), dtype="float32", task="embed", max_num_batched_tokens=40
    )
    return AsyncLLMEngine.from_config(config)


def test_concurrent_embeddings_equal_the_model_alone(embed_engine, minilm_dir):
    tok = embed_engine.tokenizer
    ids = [tok.encode(t) for t in TEXTS]

    async def run():
        await embed_engine.start()
        try:
            return await asyncio.gather(
                *(embed_engine.embed(f"e{i}", x) for i, x in enumerate(ids))
            )
        finally:
            await embed_engine.shutdown()

    outs = asyncio.run(run())
    assert embed_engine.core.totals.num_steps > 1  # the budget split the work across steps
    direct = EmbeddingModel.load(minilm_dir, "float32", "cpu")
    for x, out in zip(ids, outs, strict=True):
        ref = direct.embed([x])[0]
        got = torch.tensor(out.embedding)
        assert out.num_prompt_tokens == len(x)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99999
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_generation_on_an_embedding_engine_is_refused(embed_engine):
    async def run():
        await embed_engine.start()
        try:
            with pytest.raises(ValueError, match="embedding model"):
                async for _ in embed_engine.generate("g", [101, 102], SamplingParams()):
                    pass
        finally:
            await embed_engine.shutdown()

    asyncio.run(run())


def test_too_long_input_is_a_clear_error(embed_engine):
    with pytest.raises(ValueError, match="maximum context length"):
        embed_engine.core.validate([101] * (embed_engine.max_model_len + 1))
