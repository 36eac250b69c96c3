"""vLLM's request extras through the official `openai` SDK (`extra_body`) against a real server:
`cache_salt` keeps prefix-cache blocks to one salt (usage's cached tokens on completions, chat,
Responses and Messages; KV events), vLLM's
`prompt_logprobs`, `guided_*`, `return_tokens_as_token_ids` and `truncate_prompt_tokens` on
completions and chat, clear 400s for what kvserve cannot honour, and POST /reset_prefix_cache
behind the API key with its AllBlocksCleared event."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import TINY_ARGS, KVEventPorts, ServerProcess, running_server
from tests.kv_event_subscriber import CacheView, decode

KEY = "extras-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# About 100 tokens: six full blocks of 16 in the prefix cache.
PROMPT = "The harbour master of Port Ellis counts the boats at dawn and writes them down. " * 5


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, kv_event_ports: KVEventPorts
) -> Iterator[ServerProcess]:
    args = [*TINY_ARGS, "--api-key", KEY, *kv_event_ports.server_args()]
    log = tmp_path_factory.mktemp("extras") / "server.log"
    with running_server(tiny_llama_dir, args, log) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _complete(client: openai.OpenAI, model: str, salt: str | None, prompt: str = PROMPT):
    extra = {"cache_salt": salt} if salt is not None else None
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
    )


def _cached(response) -> int:
    details = response.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_cache_salt_keeps_prefix_blocks_to_its_own_salt(
    client: openai.OpenAI, model: str, server: ServerProcess
) -> None:
    prompt = "salt test: " + PROMPT
    first = _complete(client, model, "tenant-a", prompt)
    assert _cached(first) == 0
    server.wait_idle(AUTH)
    other = _complete(client, model, "tenant-b", prompt)  # the same prompt, another salt
    plain = _complete(client, model, None, prompt)  # and no salt at all
    assert _cached(other) == 0 and _cached(plain) == 0
    again = _complete(client, model, "tenant-a", prompt)
    assert _cached(again) >= 64, "the same salt shares the blocks it computed"
    texts = {r.choices[0].text for r in (first, other, plain, again)}
    assert len(texts) == 1, "greedy output does not depend on the salt"
    chat = [{"role": "user", "content": prompt}]
    a = client.chat.completions.create(
        model=model, messages=chat, max_tokens=4, temperature=0, extra_body={"cache_salt": "c1"}
    )
    b = client.chat.completions.create(
        model=model, messages=chat, max_tokens=4, temperature=0, extra_body={"cache_salt": "c2"}
    )
    c = client.chat.completions.create(
        model=model, messages=chat, max_tokens=4, temperature=0, extra_body={"cache_salt": "c1"}
    )
    assert _cached(b) == 0 and _cached(c) >= 16
    assert a.choices[0].message.content == c.choices[0].message.content


def test_cache_salt_on_responses_and_messages(
    client: openai.OpenAI, model: str, server: ServerProcess
) -> None:
    prompt = "surfaces test: " + PROMPT

    def respond(salt: str) -> int:
        r = client.responses.create(
            model=model, input=prompt, max_output_tokens=2, extra_body={"cache_salt": salt}
        )
        return r.usage.input_tokens_details.cached_tokens  # type: ignore[union-attr]

    def message(salt: str) -> int:
        body = {
            "model": model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": prompt}],
            "cache_salt": salt,
        }
        r = httpx.post(server.url + "/v1/messages", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"] or 0

    for ask, salt in ((respond, "resp"), (message, "msg")):
        assert ask(salt + "-a") == 0
        server.wait_idle(AUTH)
        assert ask(salt + "-b") == 0, "another salt shares no block"
        assert ask(salt + "-a") >= 64, "the same salt shares the blocks it computed"
    bad = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(
        server.url + "/v1/messages", json={**bad, "cache_salt": ""}, headers=AUTH, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("cache_salt")


def test_an_empty_cache_salt_is_a_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _complete(client, model, "")
    assert err.value.body["param"] == "cache_salt"  # type: ignore[index]


def test_salted_blocks_publish_the_salt_in_their_first_block_extra_keys(
    client: openai.OpenAI, model: str, kv_event_ports: KVEventPorts
) -> None:
    sub = kv_event_ports.subscriber()
    try:
        sub.poll(0.5)
        _complete(client, model, "tenant-events", "events test: " + PROMPT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not sub.received:
            sub.poll(0.2)
        history = sub.replay(0)
        view = CacheView()
        salted = []
        for seq in sorted(history):
            _, events, _ = decode(history[seq])
            view.apply(events)  # every hash recomputes from its parent, tokens and extra keys
            for e in events:
                extra = e.fields[8] if e.kind == "BlockStored" and len(e.fields) > 8 else None
                if extra and extra[0] == ["tenant-events"]:
                    salted.append(extra)
        assert salted, "the salted chain's first block carries the salt"
        assert all(k is None for extra in salted for k in extra[1:]), "only the first block"
    finally:
        sub.close()


def test_prompt_logprobs_in_vllm_shape(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt="one two three four",
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    entries = r.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(entries) == r.usage.prompt_tokens and entries[0] is None
    for position in entries[1:]:
        assert 1 <= len(position) <= 3  # the prompt's token and the top 2
        for token_id, info in position.items():
            assert token_id.isdigit() and info["rank"] >= 1 and info["logprob"] <= 0
            assert isinstance(info["decoded_token"], str)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    chat_entries = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(chat_entries) == chat.usage.prompt_tokens and chat_entries[0] is None
    assert all(len(p) == 1 for p in chat_entries[1:])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=model, prompt="x", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert err.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_guided_fields_constrain_the_output(client: openai.OpenAI, model: str) -> None:
    choice = client.completions.create(
        model=model,
        prompt="Pick a colour:",
        max_tokens=8,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    assert choice.choices[0].text in ("red", "green", "blue")
    regex = client.completions.create(
        model=model, prompt="A number:", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me JSON."}],
        max_tokens=40,
        extra_body={"guided_json": schema},
    )
    content = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content or "")["n"], int)
    else:
        assert (content or "").startswith('{"n":')
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=model,
            prompt="x",
            max_tokens=2,
            extra_body={"guided_regex": "a+", "structured_outputs": {"regex": "b+"}},
        )
    assert err.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_token_ids_as_tokens_and_truncation(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "truncate_prompt_tokens": 10},
    )
    assert r.usage.prompt_tokens == 10
    tokens = r.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "truncate_prompt_tokens": 12},
    )
    assert chat.usage.prompt_tokens == 12
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content or [])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["boat"]),
        ("priority", 3),
        ("use_beam_search", True),
        ("guided_decoding_backend", "xgrammar"),
        ("truncate_prompt_tokens", 0),
    ],
)
def test_what_kvserve_cannot_honour_is_a_400_naming_the_field(
    client: openai.OpenAI, model: str, field: str, value: object
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={field: value})
    assert err.value.body["param"] == field  # type: ignore[index]
    neutral = client.completions.create(
        model=model, prompt="x", max_tokens=1, extra_body={"priority": 0, "use_beam_search": False}
    )
    assert neutral.choices


def test_reset_prefix_cache_is_behind_the_key_and_clears_the_cache(
    client: openai.OpenAI, model: str, server: ServerProcess, kv_event_ports: KVEventPorts
) -> None:
    prompt = "reset test: " + PROMPT
    _complete(client, model, None, prompt)
    server.wait_idle(AUTH)
    assert _cached(_complete(client, model, None, prompt)) >= 64
    server.wait_idle(AUTH)
    assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 401
    bad = httpx.post(
        server.url + "/reset_prefix_cache?reset_external=true", headers=AUTH, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reset_external"
    sub = kv_event_ports.subscriber()
    try:
        sub.poll(0.5)
        r = httpx.post(server.url + "/reset_prefix_cache", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        assert _cached(_complete(client, model, None, prompt)) == 0
        deadline = time.monotonic() + 10
        cleared = 0
        while time.monotonic() < deadline and not cleared:
            sub.poll(0.2)
            cleared = sum(
                e.kind == "AllBlocksCleared"
                for payload in sub.received.values()
                for e in decode(payload)[1]
            )
        assert cleared == 1
    finally:
        sub.close()
