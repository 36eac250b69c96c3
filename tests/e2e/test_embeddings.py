"""/v1/embeddings on a real `kvserve serve --task embed` (the bundled MiniLM) through the `openai` SDK,
against vectors computed here with transformers; and a generation server refusing embeddings."""

from __future__ import annotations

import base64
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import REPO_ROOT, ServerProcess

MODEL = "all-MiniLM-L6-v2"
SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "Paged attention keeps each sequence's KV history in fixed-size blocks.",
    "¿Dónde está la biblioteca más cercana?",
    "東京は日本の首都です。",
    "Embeddings 🚀 map text to vectors; similar texts land close together.",
    "x",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "In 1969, Apollo 11 landed on the Moon and Neil Armstrong took the first steps. " * 4,
    "def add(a: int, b: int) -> int:\n    return a + b",
]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # No MODEL argument: `--task embed` alone serves the bundled all-MiniLM-L6-v2.
    args = ["--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    server = ServerProcess("--task=embed", args, tmp_path_factory.mktemp("logs") / "embed.log")
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(embed_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> tuple[list[list[int]], torch.Tensor]:
    """Token ids and [len(SENTENCES), 384] vectors from transformers: mean pooling, L2-normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    model = AutoModel.from_pretrained(minilm_dir, torch_dtype=torch.float32).eval()
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [batch, seq, hidden]
    mask = batch["attention_mask"].unsqueeze(-1).float()  # [batch, seq, 1]
    mean = (hidden * mask).sum(1) / mask.sum(1)  # [batch, hidden]
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES]
    return ids, torch.nn.functional.normalize(mean, dim=-1)


def _cosines(vectors: list[list[float]], ref: torch.Tensor) -> list[float]:
    got = torch.tensor(vectors)
    return torch.nn.functional.cosine_similarity(got, ref, dim=-1).tolist()


def test_vectors_match_transformers(client: openai.OpenAI, reference) -> None:
    ids, ref = reference
    resp = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    assert resp.model == MODEL and [d.index for d in resp.data] == list(range(len(SENTENCES)))
    assert all(len(d.embedding) == 384 for d in resp.data)
    assert min(_cosines([d.embedding for d in resp.data], ref)) >= 0.9999
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(x) for x in ids)


def test_base64_decodes_to_the_float_vectors(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=SENTENCES[:3], encoding_format="float")
    # With no encoding_format the SDK asks for base64 and decodes it to floats itself.
    default = client.embeddings.create(model=MODEL, input=SENTENCES[:3])
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    # Asked for explicitly, the SDK hands back the string: little-endian float32 bytes.
    explicit = client.embeddings.create(model=MODEL, input=SENTENCES[:3], encoding_format="base64")
    for a, b in zip(explicit.data, floats.data, strict=True):
        assert isinstance(a.embedding, str)
        decoded = struct.unpack("<384f", base64.b64decode(a.embedding))
        assert list(decoded) == pytest.approx(b.embedding, abs=1e-6)


def test_a_text_embeds_the_same_alone_and_in_a_batch(client: openai.OpenAI) -> None:
    batch = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    for i in (0, 5, 8):
        alone = client.embeddings.create(model=MODEL, input=SENTENCES[i], encoding_format="float")
        assert alone.data[0].embedding == pytest.approx(batch.data[i].embedding, abs=1e-5)


def test_token_id_inputs_equal_their_text(client: openai.OpenAI, reference) -> None:
    ids, ref = reference
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids[2:5], encoding_format="float")
    assert _cosines([one.data[0].embedding], ref[1:2])[0] >= 0.9999
    assert min(_cosines([d.embedding for d in many.data], ref[2:5])) >= 0.9999
    assert many.usage.prompt_tokens == sum(len(x) for x in ids[2:5])


def test_dimensions_truncate_and_renormalize(client: openai.OpenAI, reference) -> None:
    _, ref = reference
    resp = client.embeddings.create(
        model=MODEL, input=SENTENCES[:2], dimensions=64, encoding_format="float"
    )
    for d, full in zip(resp.data, ref[:2], strict=True):
        assert len(d.embedding) == 64
        expected = torch.nn.functional.normalize(full[:64], dim=0)
        assert torch.tensor(d.embedding).norm().item() == pytest.approx(1.0, abs=1e-5)
        assert (
            torch.nn.functional.cosine_similarity(torch.tensor(d.embedding), expected, dim=0)
            >= 0.9999
        )


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    long_text = "one two three four five six seven eight nine ten " * 40  # > 256 tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, input=long_text)
    assert exc.value.code == "context_length_exceeded"
    resp = client.embeddings.create(
        model=MODEL, input=long_text, extra_body={"truncate_prompt_tokens": 12}
    )
    assert resp.usage.prompt_tokens == 12
    full = client.embeddings.create(
        model=MODEL, input=[long_text], extra_body={"truncate_prompt_tokens": -1}
    )
    assert full.usage.prompt_tokens == 256


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": "hi", "dimensions": 385}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": [999999]}, "input"),
    ],
)
def test_bad_requests_are_400(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MODEL, **kwargs)
    assert exc.value.param == param


def test_wrong_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")


def test_generation_requests_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])


def test_models_tokenize_and_idle_engine(
    client: openai.OpenAI, embed_server: ServerProcess
) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    tokens = httpx.post(embed_server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == 4 and tokens["max_model_len"] == 256
    stats = embed_server.wait_idle()
    assert stats["task"] == "embed"


def test_generation_server_refuses_embeddings(tiny_server: ServerProcess) -> None:
    r = httpx.post(tiny_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "embedding model" in error["message"]


def test_readme_embeddings_example_runs(embed_server: ServerProcess) -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- embeddings example -->\s*```python\n(.*?)```", readme, re.DOTALL)
    assert len(blocks) == 1
    code = blocks[0].replace("http://localhost:8000", embed_server.url)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    size, cosine, tokens = result.stdout.split()
    assert int(size) == 128 and 0.3 < float(cosine) < 1.0 and int(tokens) > 10
