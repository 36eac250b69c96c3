"""POST /v1/score on real servers: scores equal the sums an echo + logprobs completion gives for the
same strings (the real SmolLM2); the response shape, usage, metrics by request kind, and 400s."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ServerProcess


def score(server: ServerProcess, **body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/score", json=body, timeout=120)


def tokenize(server: ServerProcess, **body: object) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def echo_logprobs(client: openai.OpenAI, prompt: str | list[int]) -> list[float]:
    """The prompt's token logprobs from an echo completion (the first token has none)."""
    out = client.completions.create(
        model="smol", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lps = out.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None
    return [lp for lp in lps.token_logprobs[1:] if lp is not None]


@pytest.mark.parametrize("prefix", ["Question: what is the capital of France?\nAnswer:", "I like"])
def test_scores_equal_echo_completion_sums(smol_server: ServerProcess, prefix: str) -> None:
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    choices = [" Paris", " The capital of France is Paris.", " Berlin, I think"]
    r = score(smol_server, model="smol", prompt=prefix, choices=choices, token_logprobs=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "score" and body["model"] == "smol" and body["id"]
    assert isinstance(body["created"], int)
    total_tokens = 0
    for i, (choice, text) in enumerate(zip(body["choices"], choices, strict=True)):
        assert choice["index"] == i and choice["text"] == text
        echoed = echo_logprobs(client, prefix + text)
        expected = math.fsum(echoed[-choice["num_tokens"] :])
        assert abs(choice["logprob"] - expected) < 1e-4
        assert len(choice["token_logprobs"]) == len(choice["tokens"]) == choice["num_tokens"]
        assert "".join(choice["tokens"]) == text
        assert abs(choice["mean_logprob"] - choice["logprob"] / choice["num_tokens"]) < 1e-9
        total_tokens += choice["num_tokens"]
    probabilities = [c["probability"] for c in body["choices"]]
    assert abs(sum(probabilities) - 1) < 1e-9
    weights = [math.exp(c["logprob"]) for c in body["choices"]]
    assert all(
        abs(p - w / sum(weights)) < 1e-9 for p, w in zip(probabilities, weights, strict=True)
    )
    context_tokens = len(tokenize(smol_server, prompt=prefix))
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == context_tokens + total_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    assert "top_logprobs" not in body


def test_token_ids_chat_top_logprobs_and_greedy(smol_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    reply = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,  # type: ignore[arg-type]
    )
    greedy_text = reply.choices[0].message.content or ""
    r = score(
        smol_server,
        messages=messages,
        choices=[greedy_text, "London"],
        include_end_of_turn=reply.choices[0].finish_reason == "stop",
        top_logprobs=3,
        normalize="mean",
    )
    assert r.status_code == 200, r.text
    body = r.json()
    first, second = body["choices"]
    assert first["is_greedy"] is True and second["is_greedy"] is False
    assert first["probability"] > second["probability"]
    top = body["top_logprobs"]
    assert len(top) == 3 and top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and top[0]["token"] == content[0].token
    # Token ids bypass tokenization: the same context and choice as ids score the same.
    prompt_ids = tokenize(smol_server, messages=messages, add_generation_prompt=True)
    choice_ids = tokenize(smol_server, prompt="London")
    by_text = score(smol_server, messages=messages, choices=["London"], token_logprobs=True).json()
    by_ids = score(smol_server, prompt=prompt_ids, choices=[choice_ids], token_logprobs=True).json()
    (text_choice,), (ids_choice,) = by_text["choices"], by_ids["choices"]
    assert ids_choice["probability"] == 1.0 and ids_choice["text"] == "London"
    assert ids_choice["num_tokens"] == text_choice["num_tokens"] == len(choice_ids)
    assert abs(ids_choice["logprob"] - text_choice["logprob"]) < 1e-4


def test_score_is_counted_by_kind(tiny_server: ServerProcess) -> None:
    def requests_by_kind() -> dict[str, float]:
        text = httpx.get(tiny_server.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvserve_requests_total":
                    kind = s.labels["kind"]
                    out[kind] = out.get(kind, 0.0) + s.value
        return out

    before = requests_by_kind()
    r = score(tiny_server, prompt=[5, 6, 7, 8], choices=[[9, 10], [11], [12, 13, 14]])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4 + 6
    tiny_server.wait_idle()
    after = requests_by_kind()
    assert after["score"] - before.get("score", 0) == 1
    assert after.get("generate", 0) == before.get("generate", 0)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "Hi", "choices": []}, "choices", None),
        ({"prompt": "Hi", "choices": ["a", ""]}, "choices", None),
        ({"prompt": "Hi", "choices": [[1], []]}, "choices", None),
        ({"prompt": "Hi", "choices": ["x"] * 65}, "choices", None),
        ({"prompt": "Hi", "choices": ["a", [1]]}, "choices", None),
        ({"choices": ["a"]}, "prompt", None),
        (
            {"prompt": "Hi", "messages": [{"role": "user", "content": "x"}], "choices": ["a"]},
            "prompt",
            None,
        ),
        (
            {"prompt": "Hi", "choices": ["a"], "include_end_of_turn": True},
            "include_end_of_turn",
            None,
        ),
        ({"prompt": "Hi", "choices": ["a"], "normalize": "max"}, "normalize", None),
        ({"prompt": [1, 2], "choices": [[1] * 255]}, "choices", "context_length_exceeded"),
        ({"prompt": [10**6], "choices": ["a"]}, "prompt", None),
        ({"prompt": "Hi", "choices": ["a"], "model": "other"}, "model", "model_not_found"),
    ],
)
def test_bad_input_is_a_400_envelope(
    tiny_server: ServerProcess, body: dict, param: str, code: str | None
) -> None:
    r = score(tiny_server, **body)
    expected = 404 if code == "model_not_found" else 400
    assert r.status_code == expected, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    tiny_server.wait_idle()
