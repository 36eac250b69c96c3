"""LoRA adapters through a real `kvserve serve` (tiny random Llama, PEFT adapters with random A and B
made here), driven with the official openai and anthropic SDKs and httpx: /v1/models, the adapter
selected by `model` ("name" and "base:name") on completions, chat, Responses, Messages, score and
decoder embeddings, greedy tokens equal to transformers + peft, unknown names as 404s, the runtime
load/unload routes (bad folder, rank, corrupt file: 400 and nothing served changes; auth), metrics,
the cost sheet, and start-up errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, TINY_ARGS, ServerProcess
from tests.model.lora_adapters import edit_config, make_adapter, peft_greedy

pytest.importorskip("peft")

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny"
PROMPT = "The quick brown fox jumps over"
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    found = {
        "sql": make_adapter(tiny_llama_dir, root / "sql", rank=8, seed=1),
        "poem": make_adapter(
            tiny_llama_dir, root / "poem", rank=4, targets=["q_proj", "v_proj"], seed=2, std=0.5
        ),
        "big": make_adapter(tiny_llama_dir, root / "big", rank=32, seed=3),
    }
    corrupt = shutil.copytree(found["sql"], root / "corrupt")
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    found["corrupt"] = corrupt
    (root / "empty").mkdir()
    found["empty"] = root / "empty"
    odd = shutil.copytree(found["poem"], root / "odd")
    edit_config(odd, target_modules=["q_proj", "attn_out"])  # a module the model lacks
    found["odd"] = odd
    return found


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [
        *TINY_ARGS, "--quantization", "none", "--served-model-name", BASE, "--api-key", KEY,
        "--max-lora-rank", "16",
        "--max-loras", "2", "--lora-modules", f"sql={adapters['sql']}", "--log-stats-interval", "0",
    ]  # fmt: skip
    proc = ServerProcess(tiny_llama_dir, args, tmp_path_factory.mktemp("logs") / "lora.log")
    proc.wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(tiny_llama_dir).encode(PROMPT))


@pytest.fixture(scope="module")
def reference(
    tiny_llama_dir: Path, adapters: dict[str, Path], prompt_ids: list[int]
) -> dict[str | None, str]:
    """transformers + peft greedy continuations of the prompt, as text, per adapter (None: base);
    the server runs float weights (--quantization none) so that greedy tokens compare exactly."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    out: dict[str | None, str] = {}
    for name in (None, "sql", "poem"):
        (ids,) = peft_greedy(
            tiny_llama_dir, adapters[name] if name else None, [prompt_ids], MAX_NEW
        )
        out[name] = tokenizer.decode(ids, skip_special_tokens=True)
    assert len({out[None], out["sql"], out["poem"]}) == 3, "the adapters must change the tokens"
    return out


def complete(client: openai.OpenAI, model: str, prompt_ids: list[int], **extra: Any) -> Any:
    return client.completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def post(server: ServerProcess, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", AUTH)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def model_ids(client: openai.OpenAI) -> list[str]:
    return [m.id for m in client.models.list().data]


def test_models_lists_the_base_model_and_the_adapter(
    client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, "sql"]
    base, sql = (m.model_dump() for m in models)
    assert base["parent"] is None and sql["parent"] == BASE and sql["root"] == str(adapters["sql"])
    assert client.models.retrieve("sql").id == "sql"
    assert client.models.retrieve(f"{BASE}:sql").id == "sql"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_the_adapter_by_name_or_base_name_gives_the_peft_tokens(
    client: openai.OpenAI, prompt_ids: list[int], reference: dict[str | None, str]
) -> None:
    # The base runs first: the adapter's request must not reuse the base model's cached prompt KV.
    for model in (BASE, "sql", f"{BASE}:sql", BASE):
        out = complete(client, model, prompt_ids)
        assert out.model == model
        assert out.choices[0].text == reference[None if model == BASE else "sql"], model


def test_every_surface_runs_on_the_selected_adapter(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "Tell me a story"}]

    def chat(model: str) -> str:
        out = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0
        )
        assert out.model == model
        return out.choices[0].message.content or ""

    base, sql = chat(BASE), chat("sql")
    assert base != sql and chat(f"{BASE}:sql") == sql
    streamed = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == sql
    response = client.responses.create(
        model=f"{BASE}:sql", input="Tell me a story", max_output_tokens=6, temperature=0
    )
    assert response.model == f"{BASE}:sql" and response.output_text == sql
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    message = claude.messages.create(
        model="sql", max_tokens=6, messages=messages, extra_body={"temperature": 0}
    )
    assert message.model == "sql" and message.content[0].text == sql  # type: ignore[union-attr]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="prose", max_tokens=6, messages=messages)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "'sql'" in str(missing.value.body)

    def score(model: str) -> list[float]:
        body = {
            "model": model,
            "prompt": "The capital of France is",
            "choices": [" Paris", " Rome"],
        }
        r = post(server, "/v1/score", body)
        assert r.status_code == 200, r.text
        return [c["logprob"] for c in r.json()["choices"]]

    assert score("sql") == score(f"{BASE}:sql") != score(BASE)


def test_an_unknown_model_is_a_404_listing_what_is_served(
    client: openai.OpenAI, prompt_ids: list[int]
) -> None:
    for model in ("prose", "other:sql", f"{BASE}:prose"):
        with pytest.raises(openai.NotFoundError) as missing:
            complete(client, model, prompt_ids)
        error = missing.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found"
        assert error["param"] == "model" and f"'{BASE}', 'sql'" in error["message"]


def test_load_and_unload_at_run_time(
    server: ServerProcess,
    client: openai.OpenAI,
    adapters: dict[str, Path],
    prompt_ids: list[int],
    reference: dict[str | None, str],
) -> None:
    load = {"lora_name": "poem", "lora_path": str(adapters["poem"])}
    assert post(server, "/v1/load_lora_adapter", load, headers={}).status_code == 401
    r = post(server, "/v1/load_lora_adapter", load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'poem' added successfully."
    assert model_ids(client) == [BASE, "sql", "poem"]
    assert complete(client, "poem", prompt_ids).choices[0].text == reference["poem"]
    # Requests for both adapters and the base model at once share the engine's steps.
    models = [BASE, "sql", "poem"] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: complete(client, m, prompt_ids).choices[0].text, models))
    assert texts == [reference[None if m == BASE else m] for m in models]
    again = post(server, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    for name, why in (
        ("big", "rank 32"),
        ("corrupt", "safetensors"),
        ("empty", "adapter_config.json"),
        ("odd", "attn_out"),
    ):
        r = post(
            server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters[name])}
        )
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert error["param"] == "lora_path" and why in error["message"], (name, error)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post(
        server, "/v1/load_lora_adapter", {"lora_name": "a b", "lora_path": str(adapters["sql"])}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert model_ids(client) == [BASE, "sql", "poem"]  # nothing served changed
    assert complete(client, "poem", prompt_ids).choices[0].text == reference["poem"]
    assert complete(client, "sql", prompt_ids).choices[0].text == reference["sql"]

    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "poem"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'poem' removed successfully."
    assert model_ids(client) == [BASE, "sql"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "poem", prompt_ids)
    missing = post(server, "/v1/unload_lora_adapter", {"lora_name": "poem"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
    # Loaded again under the same name: its own tokens, nothing stale.
    assert post(server, "/v1/load_lora_adapter", load).status_code == 200
    assert complete(client, "poem", prompt_ids).choices[0].text == reference["poem"]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "poem"}).status_code == 200


def test_metrics_and_cost_sheet_name_the_adapter(
    server: ServerProcess, client: openai.OpenAI, prompt_ids: list[int]
) -> None:
    out = complete(client, "sql", prompt_ids, return_metrics=True)
    assert out.model_extra is not None and out.model_extra["metrics"]["lora"] == "sql"
    base = complete(client, BASE, prompt_ids, return_metrics=True)
    assert base.model_extra is not None and base.model_extra["metrics"]["lora"] is None
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    count = re.search(r'^kvserve_lora_requests_total\{adapter="sql"\} (\S+)$', text, re.M)
    assert count is not None and float(count.group(1)) >= 1
    info = re.search(r"^kvserve_lora_requests_info\{(.*)\} (\S+)$", text, re.M)
    assert info is not None and 'max_lora="2"' in info.group(1)
    assert 'running_lora_adapters=""' in info.group(1)  # idle now


def test_runtime_loading_is_off_without_an_api_key_or_the_flag(
    tiny_server: ServerProcess, adapters: dict[str, Path]
) -> None:
    load = {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    r = post(tiny_server, "/v1/load_lora_adapter", load, headers={})
    assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    models = httpx.get(tiny_server.url + "/v1/models", timeout=10).json()["data"]
    assert len(models) == 1 and models[0]["parent"] is None


def test_a_bad_lora_module_is_a_one_line_start_up_error(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    def start(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "server", "serve", str(tiny_llama_dir), *TINY_ARGS, *args]
        return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)

    # adapter_config.json is read before the model loads: a usage error at once.
    for module, why in ((f"x={tmp_path}", "adapter_config.json"), (f"x={adapters['big']}", "rank")):
        done = start("--max-lora-rank", "16", "--lora-modules", module)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        (line,) = [ln for ln in done.stderr.splitlines() if "error" in ln]
        assert "--lora-modules x" in line and why in line
    # The tensors are checked against the model when it loads: one error line, exit 1.
    done = start("--port", "0", "--lora-modules", f"x={adapters['corrupt']}")
    output = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in output, output
    (line,) = [ln for ln in output.splitlines() if "could not load" in ln]
    assert "LoRA adapter" in line and "safetensors" in line
    # An adapter named as the base model could never be selected: refused before the model loads.
    done = start(
        "--port", "0", "--served-model-name", "sql", "--lora-modules", f"sql={adapters['sql']}"
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output
    (line,) = [ln for ln in output.splitlines() if "error" in ln]
    assert "--lora-modules sql" in line and "base model's id" in line


# ----------------------------------------------------------------- embeddings of a decoder model


@pytest.fixture(scope="module")
def embedder(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[openai.OpenAI, str]]:
    from tests.st_folders import tiny_llama_config, write_embedding_folder

    vocab = int(json.loads((smollm2_dir / "config.json").read_text())["vocab_size"])
    root = tmp_path_factory.mktemp("decoder_embedder")
    folder = write_embedding_folder(root / "model", smollm2_dir, tiny_llama_config(vocab))
    adapter = make_adapter(folder, root / "emb", rank=4, seed=5, std=0.5)
    args = ["--device", "cpu", "--dtype", "float32", "--served-model-name", "emb-base",
            "--lora-modules", f"emb={adapter}", "--log-level", "warning"]  # fmt: skip
    proc = ServerProcess(folder, args, tmp_path_factory.mktemp("logs") / "embed.log")
    proc.wait_ready()
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0), "emb-base"
    proc.stop()


def test_decoder_embeddings_run_on_the_adapter(embedder: tuple[openai.OpenAI, str]) -> None:
    client, base = embedder

    def embed(model: str) -> list[float]:
        out = client.embeddings.create(model=model, input="LoRA adapters for embeddings")
        assert out.model == model
        return out.data[0].embedding

    plain, adapted = embed(base), embed("emb")
    assert plain != adapted and embed(f"{base}:emb") == adapted and embed(base) == plain
    with pytest.raises(openai.NotFoundError):
        embed("other")
