"""The opt-in per-request cost sheet (`metrics`) on a real server: cached tokens equal usage's, times add
up and match what the Prometheus request histograms observed for the same request, tokens are
recomputed after a forced preemption (tiny KV pool), and every surface and the final SSE chunk carry it."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess

PROMPT = list(range(3000, 3040))  # 40 tokens: 2 full blocks of 16 can come from the prefix cache
HISTOGRAMS = {
    "queued_time": "kvserve_request_queue_time_seconds",
    "prefill_time": "kvserve_request_prefill_time_seconds",
    "decode_time": "kvserve_request_decode_time_seconds",
    "e2e_latency": "kvserve_e2e_request_latency_seconds",
    "time_to_first_token": "kvserve_time_to_first_token_seconds",
}


def _histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for name in [*HISTOGRAMS.values(), "kvserve_inter_token_latency_seconds"]:
        total = float(re.search(rf"^{name}_sum (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
        count = float(re.search(rf"^{name}_count (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
        out[name] = (total, count)
    return out


def _completion(url: str, **body: object) -> dict:
    payload = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0, **body}
    r = httpx.post(url + "/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_cost_sheet_matches_usage_and_prometheus(tiny_server: ServerProcess) -> None:
    url = tiny_server.url
    _completion(url)  # warm the prefix cache
    tiny_server.wait_idle()
    before = _histogram_sums(url)
    body = _completion(url, return_metrics=True)
    after = _histogram_sums(url)
    m, usage = body["metrics"], body["usage"]
    assert m["num_cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert m["num_prompt_tokens"] == usage["prompt_tokens"] == 40
    assert m["num_computed_prompt_tokens"] == 8
    assert m["num_generation_tokens"] == usage["completion_tokens"] == 12
    assert m["num_recomputed_tokens"] == 0 and m["num_preemptions"] == 0
    assert m["kv_block_seconds"] > 0
    assert m["e2e_latency"] == pytest.approx(
        m["queued_time"] + m["prefill_time"] + m["decode_time"], abs=1e-6
    )
    assert m["time_to_first_token"] == pytest.approx(m["queued_time"] + m["prefill_time"], abs=1e-6)
    assert m["inference_time"] == pytest.approx(m["prefill_time"] + m["decode_time"], abs=1e-6)
    for field, name in HISTOGRAMS.items():
        total, count = (a - b for a, b in zip(after[name], before[name], strict=True))
        assert count == 1, name
        assert total == pytest.approx(m[field], rel=1e-6, abs=1e-9), field
    itl_total, itl_count = (
        a - b
        for a, b in zip(
            after["kvserve_inter_token_latency_seconds"],
            before["kvserve_inter_token_latency_seconds"],
            strict=True,
        )
    )
    assert itl_count == 11
    assert m["mean_time_per_output_token"] == pytest.approx(itl_total / itl_count, rel=1e-6)


def test_cost_sheet_is_opt_in_by_field_or_header(tiny_server: ServerProcess) -> None:
    url = tiny_server.url
    assert "metrics" not in _completion(url)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert "metrics" not in r.json()
    r = httpx.post(
        url + "/v1/chat/completions", json=chat, headers={"X-KVServe-Metrics": "true"}, timeout=60
    )
    m = r.json()["metrics"]
    assert m["num_cached_tokens"] == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert m["num_generation_tokens"] == r.json()["usage"]["completion_tokens"]
    # The field wins over the header.
    r = httpx.post(
        url + "/v1/chat/completions",
        json={**chat, "return_metrics": False},
        headers={"X-KVServe-Metrics": "true"},
        timeout=60,
    )
    assert "metrics" not in r.json()
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "return_metrics": "yes"}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "return_metrics"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_final_stream_chunk_carries_the_cost_sheet(tiny_server: ServerProcess, route: str) -> None:
    body: dict = {"max_tokens": 6, "ignore_eos": True, "stream": True, "return_metrics": True}
    if route == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "count"}]
    chunks = []
    with httpx.stream("POST", tiny_server.url + route, json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert all("metrics" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["metrics"]["num_generation_tokens"] == 6
    assert last["metrics"]["e2e_latency"] >= last["metrics"]["time_to_first_token"] > 0


@pytest.fixture(scope="module")
def tiny_pool_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # 8 blocks of 16 tokens: each request (40 + 60 tokens = 7 blocks) fits alone, never two at once.
    args = [
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "8",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--log-level", "warning",
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    server = ServerProcess(tiny_llama_dir, args, tmp_path_factory.mktemp("logs") / "pool.log")
    server.wait_ready()
    yield server
    server.stop()


def test_preempted_requests_report_recomputed_tokens(tiny_pool_server: ServerProcess) -> None:
    results: list[dict] = []

    def run(i: int) -> None:
        body = {
            "prompt": [4000 + i] * 40,
            "max_tokens": 60,
            "ignore_eos": True,
            "return_metrics": True,
        }
        r = httpx.post(tiny_pool_server.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        results.append(r.json()["metrics"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    preempted = [m for m in results if m["num_preemptions"] > 0]
    assert preempted, results
    assert all(m["num_recomputed_tokens"] > 0 for m in preempted)
    assert all(m["num_generation_tokens"] == 60 for m in results)
    assert all(m["kv_block_seconds"] > 0 for m in results)


def test_score_responses_carry_the_cost_sheet_too(tiny_server: ServerProcess) -> None:
    body = {"prompt": [5, 6, 7, 8], "choices": [[9, 10], [11]], "return_metrics": True}
    r = httpx.post(tiny_server.url + "/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    m = r.json()["metrics"]
    assert m["num_cached_tokens"] == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert m["e2e_latency"] >= m["queued_time"] >= 0
    r = httpx.post(tiny_server.url + "/v1/score", json={**body, "return_metrics": None}, timeout=60)
    assert "metrics" not in r.json()
