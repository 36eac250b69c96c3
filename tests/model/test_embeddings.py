"""Embedding numerics against transformers: MiniLM (encoder, mean pooling) and a tiny random Llama
(decoder, last-token pooling), batch invariance, truncation and input validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.embeddings.embedding_model import EmbeddingModel
from engine.embeddings.pooling import truncate_dimensions

SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "?",
    "Embeddings turn text into vectors.",
    "I love pizza 🍕 and sushi 🍣!!!",
    "Le chat est assis sur le tapis.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "今日はいい天気ですね。",
    "我喜欢学习自然语言处理。",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Γειά σου Κόσμε",
    "😀😃😄😁😆😅😂🤣",
    "What's the time? It's 10:45 a.m., isn't it?",
    "Email me at someone@example.com or call +1 (555) 010-9999.",
    "def add(a, b):\n    return a + b",
    "SELECT * FROM users WHERE id = 42;",
    "   leading and trailing spaces   ",
    "MIXED case TeXt WiTh CAPS",
    "1 2 3 4 5 6 7 8 9 10",
    "3.14159265358979323846264338327950288419716939937510",
    "--- *** !!! ??? ... ,,, ;;; :::",
    "New\nlines\nand\ttabs",
    "Transformers use self-attention to weigh the importance of each token.",
    "Paris is the capital of France.",
    "The capital of France is Paris.",
    "Berlin is the capital of Germany.",
    "I went to the bank to deposit money.",
    "We sat on the river bank and watched the boats.",
    "The stock market fell sharply on Monday amid inflation fears.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "She sells sea shells by the sea shore.",
    "To be, or not to be, that is the question.",
    "C'est la vie!",
    "naïve café résumé coöperate",
    "https://example.org/path?query=1&other=two#fragment",
    "<html><body><p>Hi</p></body></html>",
    '{"key": "value", "list": [1, 2, 3]}',
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "The mitochondria is the powerhouse of the cell.",
    "Can you recommend a good book about the history of mathematics?",
    "No.",
    "Yes!",
    "This sentence is a little longer than most of the others in this list, because it keeps "
    "going with several clauses, commas, and a few more words to push the token count up so "
    "that the batch has sequences of very different lengths, which is exactly what a packed "
    "batch must handle without letting padding or neighbours leak into any one vector.",
    "Machine learning models can be biased if trained on biased data.",
    "🙂 mixed 文字 and English, with émojis & symbols © ® ™",
    "The end.",
]
assert len(SENTENCES) == 50


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> EmbeddingModel:
    return EmbeddingModel.load(minilm_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def token_ids(minilm_tokenizer) -> list[list[int]]:
    return [minilm_tokenizer(text)["input_ids"] for text in SENTENCES]


@pytest.fixture(scope="module")
def hf_outputs(minilm_dir: Path, minilm_tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state [B, L, H], attention mask [B, L]) from transformers on a padded batch."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()
    batch = minilm_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    return hidden, batch["attention_mask"]


def _cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return F.cosine_similarity(a.double(), b.double(), dim=-1).tolist()


def test_minilm_reads_its_sentence_transformers_config(minilm: EmbeddingModel) -> None:
    assert minilm.is_encoder
    assert (minilm.pooling, minilm.normalize) == ("mean", True)
    assert minilm.max_model_len == 256  # sentence_bert_config.json, not max_position_embeddings
    assert minilm.hidden_size == 384


def test_minilm_matches_transformers_mean_pooling(
    minilm: EmbeddingModel, token_ids: list[list[int]], hf_outputs: tuple
) -> None:
    hidden, mask = hf_outputs
    weights = mask.unsqueeze(-1).float()  # [B, L, 1]
    reference = F.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)  # [B, H]
    vectors = minilm.embed(token_ids)
    assert vectors.shape == (50, 384) and vectors.dtype == torch.float32
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(50), atol=1e-5)
    cosines = _cosines(vectors, reference)
    worst = min(range(50), key=cosines.__getitem__)
    assert cosines[worst] >= 0.9999, f"{SENTENCES[worst]!r}: cosine {cosines[worst]}"


def test_cls_pooling_override_matches_transformers_first_token(
    minilm_dir: Path, token_ids: list[list[int]], hf_outputs: tuple
) -> None:
    model = EmbeddingModel.load(minilm_dir, dtype="float32", device="cpu", pooling="cls")
    reference = F.normalize(hf_outputs[0][:, 0], dim=-1)
    assert min(_cosines(model.embed(token_ids), reference)) >= 0.9999


def test_a_text_embeds_the_same_alone_and_in_a_batch(
    minilm: EmbeddingModel, token_ids: list[list[int]]
) -> None:
    batch = minilm.embed(token_ids)
    for i in (0, 2, 5, 46, 49):  # short, one-token, emoji, the longest, the last
        alone = minilm.embed([token_ids[i]])[0]
        assert torch.allclose(alone, batch[i], atol=1e-6), SENTENCES[i]
    # Order within the batch does not matter either.
    reversed_batch = minilm.embed(token_ids[::-1])
    assert torch.allclose(reversed_batch.flip(0), batch, atol=1e-6)


def test_similar_sentences_are_closer_than_unrelated_ones(
    minilm: EmbeddingModel, token_ids: list[list[int]]
) -> None:
    vectors = minilm.embed(token_ids)
    paris_a, paris_b, berlin, photosynthesis = (vectors[i] for i in (27, 28, 29, 33))
    assert paris_a @ paris_b > paris_a @ berlin > paris_a @ photosynthesis


def test_dimension_truncation_renormalizes_real_vectors(
    minilm: EmbeddingModel, token_ids: list[list[int]]
) -> None:
    vectors = minilm.embed(token_ids[:4])
    cut = truncate_dimensions(vectors, 128)
    assert cut.shape == (4, 128)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(4), atol=1e-6)
    assert torch.allclose(cut, F.normalize(vectors[:, :128], dim=-1))
    as_lists = truncate_dimensions(vectors[0].tolist(), 128)
    assert as_lists == pytest.approx(cut[0].tolist(), abs=1e-7)


def test_too_long_and_empty_inputs_are_user_errors(minilm: EmbeddingModel) -> None:
    with pytest.raises(ValueError, match="at most 256"):
        minilm.embed([[101] + [1000] * 255 + [102]])
    with pytest.raises(ValueError, match="empty"):
        minilm.embed([[101, 102], []])
    assert minilm.embed([[101] + [1000] * 254 + [102]]).shape == (1, 384)


def test_bfloat16_stays_close_to_the_float32_reference(
    minilm_dir: Path, minilm: EmbeddingModel, token_ids: list[list[int]]
) -> None:
    model = EmbeddingModel.load(minilm_dir, dtype="bfloat16", device="cpu")
    assert min(_cosines(model.embed(token_ids), minilm.embed(token_ids))) >= 0.999


# ---------------------------------------------------------------- decoder (Llama, last token)


def _tiny_llama(folder: Path, headless: bool) -> torch.nn.Module:
    """A random 2-layer Llama saved as an embedding checkpoint (headless `LlamaModel`, untied) or
    as a causal LM (tied embeddings); returns the transformers model for reference."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=not headless,
    )
    torch.manual_seed(0)
    model = (LlamaModel if headless else LlamaForCausalLM)(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    return model if headless else model.model


@pytest.mark.parametrize("headless", [True, False], ids=["LlamaModel", "LlamaForCausalLM"])
def test_decoder_last_token_pooling_matches_transformers(tmp_path: Path, headless: bool) -> None:
    reference = _tiny_llama(tmp_path, headless)
    model = EmbeddingModel.load(tmp_path, dtype="float32", device="cpu")
    assert not model.is_encoder
    assert (model.pooling, model.normalize, model.max_model_len) == ("last", True, 128)
    generator = torch.Generator().manual_seed(1)
    token_ids = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (5, 17, 1, 40)]
    vectors = model.embed(token_ids)
    for i, ids in enumerate(token_ids):
        with torch.no_grad():
            last = reference(torch.tensor([ids])).last_hidden_state[0, -1]  # after the final norm
        expected = F.normalize(last, dim=-1)
        assert torch.allclose(vectors[i], expected, atol=1e-5), f"sequence {i}"
        assert torch.allclose(model.embed([ids])[0], vectors[i], atol=1e-6)


def test_decoder_mean_pooling_is_causal(tmp_path: Path) -> None:
    """--pooling mean on a decoder averages its causal (not bidirectional) hidden states."""
    reference = _tiny_llama(tmp_path, headless=True)
    model = EmbeddingModel.load(tmp_path, dtype="float32", device="cpu", pooling="mean")
    ids = list(range(10, 30))
    with torch.no_grad():
        hidden = reference(torch.tensor([ids])).last_hidden_state[0]  # [20, 64]
    expected = F.normalize(hidden.mean(0), dim=-1)
    assert torch.allclose(model.embed([ids])[0], expected, atol=1e-5)
