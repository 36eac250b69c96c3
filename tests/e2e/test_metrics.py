"""/metrics on a real server: every counter, gauge and histogram moves by the exact amount known requests
imply; 429s count as rejections; the dashboard names only live series; request ids and stats in the log."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import TINY_ARGS, ServerProcess

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvserve.json"
BLOCK_SIZE = 16  # the engine default; TINY_ARGS does not change it
STATS_LINE = re.compile(
    r"running=\d+ waiting=\d+ kv_usage=[\d.]+% prompt=[\d.]+ tok/s generation=[\d.]+ tok/s "
    r"prefix_cache_hit_rate=[\d.]+% preemptions=\d+"
)
REQUEST_HISTOGRAMS = (
    "kvserve_time_to_first_token_seconds",
    "kvserve_e2e_request_latency_seconds",
    "kvserve_request_queue_time_seconds",
    "kvserve_request_prefill_time_seconds",
    "kvserve_request_decode_time_seconds",
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """At most one queued request (so a burst gets 429s), a fast stats log, DEBUG request lines."""
    # Two running slots and one queued request: a concurrent burst overflows admission.
    args = [
        *TINY_ARGS,
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "1",
        "--log-stats-interval",
        "0.5",
    ]
    args += ["--log-level", "debug"]
    proc = ServerProcess(tiny_llama_dir, args, tmp_path_factory.mktemp("logs") / "metrics.log")
    proc.wait_ready()
    yield proc
    proc.stop()


def scrape(server: ServerProcess) -> Samples:
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Delta:
    def __init__(self, before: Samples, after: Samples) -> None:
        self.before, self.after = before, after

    def __call__(self, name: str, **labels: str) -> float:
        return value(self.after, name, **labels) - value(self.before, name, **labels)


def idle_scrape(server: ServerProcess) -> Samples:
    server.wait_idle()
    return scrape(server)


def assert_idle_gauges(samples: Samples) -> None:
    assert value(samples, "kvserve_num_requests_running") == 0
    assert value(samples, "kvserve_num_requests_waiting") == 0
    assert value(samples, "kvserve_kv_cache_usage_ratio") == 0


def unique_ids(start: int, count: int) -> list[int]:
    """Token ids no other test uses, so the prefix cache cannot serve them."""
    return list(range(start, start + count))


def test_completion_moves_each_metric_by_the_exact_amount(server: ServerProcess) -> None:
    prompt = unique_ids(1000, 20)
    before = idle_scrape(server)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0},
        headers={"X-Request-Id": "metrics-exact-1"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "metrics-exact-1"
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 20 and usage["completion_tokens"] == 8
    after = idle_scrape(server)
    d = Delta(before, after)
    assert d("kvserve_prompt_tokens_total") == usage["prompt_tokens"]
    assert d("kvserve_generation_tokens_total") == usage["completion_tokens"]
    assert d("kvserve_request_success_total", finish_reason="length") == 1
    assert d("kvserve_request_success_total", finish_reason="stop") == 0
    for name in REQUEST_HISTOGRAMS:
        assert d(name + "_count") == 1, name
        assert d(name + "_sum") >= 0, name
    assert d("kvserve_e2e_request_latency_seconds_sum") >= d(
        "kvserve_time_to_first_token_seconds_sum"
    )
    # One token per step after the first: 7 gaps between 8 tokens.
    assert d("kvserve_inter_token_latency_seconds_count") == 7
    # The whole prompt fits the step budget: one prefill step, then one decode step per token.
    assert d("kvserve_step_duration_seconds_count", kind="prefill") == 1
    assert d("kvserve_step_duration_seconds_count", kind="decode") == 7
    assert d("kvserve_step_duration_seconds_count", kind="mixed") == 0
    assert d("kvserve_step_batch_tokens_count") == 8
    assert d("kvserve_step_batch_tokens_sum") == 20 + 7
    assert d("kvserve_prefix_cache_queries_total") == 20
    assert d("kvserve_prefix_cache_hits_total") == 0
    assert d("kvserve_num_preemptions_total") == 0
    assert d("kvserve_requests_rejected_total") == 0
    assert d("kvserve_http_requests_total", route="/v1/completions", status="200") == 1
    assert_idle_gauges(after)


def test_streamed_chat_with_two_samples_is_one_request(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Count the fish in the sea, then the stars."}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=10).json()
    before = idle_scrape(server)
    body = {"messages": messages, "max_tokens": 6, "n": 2, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    after = idle_scrape(server)
    d = Delta(before, after)
    assert d("kvserve_prompt_tokens_total") == tokens["count"]  # once per request, not per sample
    assert d("kvserve_generation_tokens_total") == 2 * 6
    assert d("kvserve_request_success_total", finish_reason="length") == 1
    assert d("kvserve_time_to_first_token_seconds_count") == 1
    assert d("kvserve_e2e_request_latency_seconds_count") == 1
    assert d("kvserve_inter_token_latency_seconds_count") == 5  # the first sample's gaps
    assert d("kvserve_http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert_idle_gauges(after)


def test_prefix_cache_hits_count_whole_blocks(server: ServerProcess) -> None:
    shared = unique_ids(2000, 40)  # 2 full blocks and a partial third
    first, second = shared + unique_ids(5000, 10), shared + unique_ids(6000, 10)
    url = server.url + "/v1/completions"
    assert httpx.post(url, json={"prompt": first, "max_tokens": 1}, timeout=60).status_code == 200
    before = idle_scrape(server)
    r = httpx.post(url, json={"prompt": second, "max_tokens": 1}, timeout=60)
    after = idle_scrape(server)
    d = Delta(before, after)
    whole_blocks = len(shared) // BLOCK_SIZE * BLOCK_SIZE
    assert d("kvserve_prefix_cache_queries_total") == len(second)
    assert d("kvserve_prefix_cache_hits_total") == whole_blocks == 32
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == whole_blocks
    assert d("kvserve_prompt_tokens_total") == len(second)  # cached tokens are still prompt tokens


async def _burst(url: str, count: int) -> list[int]:
    body = {"prompt": "Tell me a long story.", "max_tokens": 16, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(url, json=body) for _ in range(count)))
    return [r.status_code for r in responses]


def test_burst_over_the_queue_cap_counts_rejections(server: ServerProcess) -> None:
    before = idle_scrape(server)
    statuses: list[int] = []
    for _ in range(3):  # one queued request allowed: a concurrent burst all but surely overflows it
        statuses += asyncio.run(_burst(server.url + "/v1/completions", 12))
        if 429 in statuses:
            break
    assert set(statuses) <= {200, 429} and 429 in statuses, statuses
    after = idle_scrape(server)
    d = Delta(before, after)
    rejected, served = statuses.count(429), statuses.count(200)
    assert d("kvserve_requests_rejected_total") == rejected
    assert d("kvserve_http_requests_total", route="/v1/completions", status="429") == rejected
    assert d("kvserve_http_requests_total", route="/v1/completions", status="200") == served
    assert d("kvserve_request_success_total", finish_reason="length") == served
    assert d("kvserve_generation_tokens_total") == 16 * served
    assert_idle_gauges(after)


def test_gauges_follow_a_running_request_and_return_to_zero_after_abort(
    server: ServerProcess,
) -> None:
    before = idle_scrape(server)
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "metrics-abort-7"}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.headers["x-request-id"] == "metrics-abort-7"
            lines = r.iter_lines()
            assert any(line.startswith("data: ") for line, _ in zip(lines, range(6), strict=False))
            busy = scrape(server)
            assert value(busy, "kvserve_num_requests_running") == 1
            assert value(busy, "kvserve_num_requests_waiting") == 0
            assert value(busy, "kvserve_kv_cache_usage_ratio") > 0
    after = idle_scrape(server)  # the client left mid-stream: aborted between engine steps
    assert_idle_gauges(after)
    d = Delta(before, after)
    assert d("kvserve_request_success_total", finish_reason="length") == 0
    assert 0 < d("kvserve_generation_tokens_total") < 240
    assert d("kvserve_e2e_request_latency_seconds_count") == 0
    abort_lines = [line for line in server.log().splitlines() if "metrics-abort-7" in line]
    assert any("INFO" in line and "aborted" in line for line in abort_lines), abort_lines


def test_dashboard_names_only_series_the_server_exports(server: ServerProcess) -> None:
    httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    live = {name for name, _ in idle_scrape(server)}
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    exprs = [t["expr"] for p in panels for t in p.get("targets", []) if "expr" in t]
    exprs += [str(v.get("query")) for v in dashboard.get("templating", {}).get("list", [])]
    used = {name for expr in exprs for name in re.findall(r"\bkvserve_[a-z0-9_]+", expr)}
    assert len(used) >= 15
    assert used <= live, f"dashboard series missing from /metrics: {sorted(used - live)}"


def test_log_has_request_ids_and_stats_lines_but_no_text(server: ServerProcess) -> None:
    secret = "zebra canary marmalade"
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": secret, "max_tokens": 12, "ignore_eos": True},
        headers={"X-Request-Id": "metrics-log-3"},
        timeout=60,
    )
    assert r.status_code == 200
    server.wait_idle()
    log = server.log()
    mine = [line for line in log.splitlines() if "metrics-log-3" in line]
    assert any("finished" in line and "completion_tokens=12" in line for line in mine), mine
    assert secret not in log
    # A busy period ends with a stats line (at most one interval after the line before, so
    # back-to-back requests share lines); an idle engine then stays silent.
    time.sleep(1.0)  # two stats intervals: the busy period's last line is written
    stats_lines = [line for line in server.log().splitlines() if STATS_LINE.search(line)]
    assert stats_lines and all(" INFO " in line for line in stats_lines)
    time.sleep(1.5)  # three more intervals with nothing to do
    assert len([ln for ln in server.log().splitlines() if STATS_LINE.search(ln)]) == len(
        stats_lines
    )
