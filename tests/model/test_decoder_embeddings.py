"""Decoder embeddings (Qwen3-Embedding style) against sentence-transformers itself: a tiny random
decoder folder with modules.json, last-token (or mean) pooling, Normalize and instruction prompts;
kvserve's vectors equal `SentenceTransformer.encode`'s batched (either padding side) and alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.embeddings.embedding_model import EmbeddingModel
from engine.embeddings.prompts import EmbeddingPrompts
from engine.models import MODEL_REGISTRY
from engine.text.tokenizer import Tokenizer
from tests.st_folders import (
    PROMPTS,
    TINY_CONFIGS,
    sentence_transformers_reference,
    tiny_llama_config,
    write_embedding_folder,
)

pytest.importorskip("sentence_transformers")

TEXTS = [
    "What is the capital of China?",
    "Explain gravity",
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. It gives weight to "
    "physical objects and is responsible for the movement of planets around the sun.",
    "x",
    "東京は日本の首都です。",
    "def add(a, b):\n    return a + b",
]


def _vocab_size(smollm2_dir: Path) -> int:
    return int(json.loads((smollm2_dir / "config.json").read_text())["vocab_size"])


def _embed(
    model: EmbeddingModel, tokenizer: Tokenizer, texts: list[str], prompt: str
) -> torch.Tensor:
    """kvserve's vectors for texts with the prompt joined before them (as the server does)."""
    return model.embed([list(tokenizer.encode(prompt + text)) for text in texts])


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cosines = F.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cosines.min() > 1 - 1e-6, cosines
    assert (got - want).abs().max() < 1e-4


_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def folders(
    request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """A family's folder padded on the right (v5 module names) and on the left (v6 names)."""
    if _CLASSES[request.param] not in MODEL_REGISTRY:
        pytest.skip(f"{_CLASSES[request.param]} is not a kvserve model class yet")
    config = TINY_CONFIGS[request.param](_vocab_size(smollm2_dir))
    root = tmp_path_factory.mktemp(f"decoder_embed_{request.param}")
    return {
        side: write_embedding_folder(
            root / side,
            smollm2_dir,
            config,
            prompts=PROMPTS,
            padding_side=side,
            module_style="v5" if side == "right" else "v6",
        )
        for side in ("right", "left")
    }


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("prompt_name", [None, "query"])
def test_last_token_vectors_equal_sentence_transformers(
    folders: dict[str, Path], side: str, prompt_name: str | None
) -> None:
    folder = folders[side]
    model = EmbeddingModel.load(folder, dtype="float32", device="cpu")
    assert (model.pooling, model.normalize, model.is_encoder) == ("last", True, False)
    assert model.prompts == EmbeddingPrompts(PROMPTS, None)
    tokenizer = Tokenizer.from_pretrained(folder)
    prompt = model.prompts.text_for(prompt_name)
    want = sentence_transformers_reference(folder, TEXTS, prompt_name)  # one padded batch
    got = _embed(model, tokenizer, TEXTS, prompt)
    _assert_close(got, want)
    for i, text in enumerate(TEXTS):  # alone, as its own batch
        _assert_close(_embed(model, tokenizer, [text], prompt), want[i : i + 1])
    # The vectors say something: texts land apart, and the prompt moves a text's vector.
    similarity = got @ got.T
    assert similarity[~torch.eye(len(TEXTS), dtype=torch.bool)].max() < 0.99
    if prompt_name is not None:
        plain = _embed(model, tokenizer, TEXTS, "")
        # (past a sliding window, and two layers, a long text's last token no longer sees it)
        assert F.cosine_similarity(plain, got, dim=-1).min() < 0.99


def test_default_prompt_applies_when_a_request_names_none(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    config = tiny_llama_config(_vocab_size(smollm2_dir))
    folder = write_embedding_folder(
        tmp_path / "m", smollm2_dir, config, prompts=PROMPTS, default_prompt_name="query"
    )
    model = EmbeddingModel.load(folder, dtype="float32", device="cpu")
    tokenizer = Tokenizer.from_pretrained(folder)
    assert model.prompts.text_for(None) == PROMPTS["query"]
    assert model.prompts.text_for("document") == ""
    want = sentence_transformers_reference(folder, TEXTS)  # encode's default: default_prompt_name
    _assert_close(_embed(model, tokenizer, TEXTS, model.prompts.text_for(None)), want)


@pytest.mark.parametrize("normalize", [True, False])
def test_mean_pooling_and_no_normalize_follow_the_folder(
    smollm2_dir: Path, tmp_path: Path, normalize: bool
) -> None:
    config = tiny_llama_config(_vocab_size(smollm2_dir))
    folder = write_embedding_folder(
        tmp_path / "m", smollm2_dir, config, pooling="mean", normalize=normalize, prompts=PROMPTS
    )
    model = EmbeddingModel.load(folder, dtype="float32", device="cpu")
    assert (model.pooling, model.normalize) == ("mean", normalize)
    tokenizer = Tokenizer.from_pretrained(folder)
    want = sentence_transformers_reference(folder, TEXTS, "query")
    _assert_close(_embed(model, tokenizer, TEXTS, PROMPTS["query"]), want)


def test_prompts_left_out_of_a_mean_pool_are_refused_at_start(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    config = tiny_llama_config(_vocab_size(smollm2_dir))
    folder = write_embedding_folder(
        tmp_path / "m", smollm2_dir, config, pooling="mean", prompts=PROMPTS, include_prompt=False
    )
    with pytest.raises(ValueError, match="include_prompt: false"):
        EmbeddingModel.load(folder, dtype="float32", device="cpu")
    # Last-token pooling never pools the prompt, so the same flag is fine there.
    folder = write_embedding_folder(
        tmp_path / "last", smollm2_dir, config, prompts=PROMPTS, include_prompt=False
    )
    assert EmbeddingModel.load(folder, dtype="float32", device="cpu").pooling == "last"
