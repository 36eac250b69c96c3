"""A decoder embedding folder (Qwen3-Embedding's layout: last-token pooling, Normalize, instruction
prompts with a default) served by a real `kvserve serve` with no --task, driven with the openai SDK's
`client.embeddings.create` and compared with sentence-transformers' `encode` on the same folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F

from tests.e2e.conftest import ServerProcess
from tests.st_folders import (
    PROMPTS,
    sentence_transformers_reference,
    tiny_llama_config,
    write_embedding_folder,
)

pytest.importorskip("sentence_transformers")

MODEL = "tiny-decoder-embedder"
QUERIES = ["What is the capital of China?", "Explain gravity"]
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other.",
]


@pytest.fixture(scope="module")
def folder(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = int(json.loads((smollm2_dir / "config.json").read_text())["vocab_size"])
    return write_embedding_folder(
        tmp_path_factory.mktemp("decoder_embedder") / "model",
        smollm2_dir,
        tiny_llama_config(vocab),
        prompts=PROMPTS,
        default_prompt_name="query",  # plain inputs are queries; documents name their prompt
        padding_side="left",
    )


@pytest.fixture(scope="module")
def client(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = ["--device", "cpu", "--dtype", "float32", "--served-model-name", MODEL]
    log = tmp_path_factory.mktemp("logs") / "decoder_embed.log"
    server = ServerProcess(folder, [*args, "--log-level", "warning"], log)
    server.wait_ready()  # modules.json makes it an embedding server without --task
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def _assert_close(data: list, want: torch.Tensor) -> None:
    got = torch.tensor([item.embedding for item in data])
    assert got.shape == want.shape
    assert F.cosine_similarity(got.double(), want.double(), dim=-1).min() > 1 - 1e-6
    assert (got - want).abs().max() < 1e-4


def test_plain_inputs_get_the_default_prompt(client: openai.OpenAI, folder: Path) -> None:
    resp = client.embeddings.create(model=MODEL, input=QUERIES)
    _assert_close(resp.data, sentence_transformers_reference(folder, QUERIES))
    alone = client.embeddings.create(model=MODEL, input=QUERIES[1])
    _assert_close(alone.data, sentence_transformers_reference(folder, QUERIES[1:]))


def test_a_named_prompt_per_request(client: openai.OpenAI, folder: Path) -> None:
    resp = client.embeddings.create(
        model=MODEL, input=DOCUMENTS, extra_body={"prompt_name": "document"}
    )
    _assert_close(resp.data, sentence_transformers_reference(folder, DOCUMENTS, "document"))
    queries = client.embeddings.create(model=MODEL, input=QUERIES)
    scores = (
        torch.tensor([d.embedding for d in queries.data])
        @ torch.tensor([d.embedding for d in resp.data]).T
    )
    want = sentence_transformers_reference(folder, QUERIES) @ (
        sentence_transformers_reference(folder, DOCUMENTS, "document").T
    )
    assert torch.allclose(scores, want, atol=1e-4)


def test_bad_prompt_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input="hi", extra_body={"prompt_name": "passage"})
    assert exc.value.param == "prompt_name" and "query" in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input=[1, 2, 3], extra_body={"prompt_name": "query"})
    assert exc.value.param == "prompt_name"
