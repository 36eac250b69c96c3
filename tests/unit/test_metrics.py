"""Prometheus metrics without a model: a synthetic StepStats moves exactly the right series; /metrics,
HTTP counts by route template, 429s as rejections, scrape-time gauges and per-app registries."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineSnapshot
from engine.core.stats import FinishedRequestStats, StepStats
from server.app import build_app
from server.metrics import ServerMetrics
from server.state import ServerConfig, ServerState
from tests.unit.server_fakes import FakeEngine


def _step(**overrides: object) -> StepStats:
    fields: dict[str, object] = dict(
        kind="mixed",
        duration=0.03,
        num_batched_tokens=21,
        num_prefill_tokens=19,
        num_decode_tokens=2,
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.25,
        num_preemptions=1,
        num_new_prompt_tokens=40,
        num_generation_tokens=3,
        prefix_cache_queries=40,
        prefix_cache_hits=16,
    )
    fields.update(overrides)
    return StepStats(**fields)  # type: ignore[arg-type]


def _finished(reason: str, first_token: float | None = 10.5) -> FinishedRequestStats:
    # arrival 10.0, scheduled 10.1, first token 10.5, finished 12.0
    return FinishedRequestStats("r", reason, 7, 4, 0, 10.0, 10.1, first_token, 12.0)


class Reader:
    """Sample values of one registry, with 0 for series that do not exist yet."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.registry = metrics.registry

    def __call__(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(ServerState(ServerConfig()))


def test_step_counters_and_step_histograms(metrics: ServerMetrics) -> None:
    value = Reader(metrics)
    metrics.on_step(_step())
    metrics.on_step(_step(kind="decode", duration=0.004, num_batched_tokens=3, num_preemptions=0))
    assert value("kvserve_prompt_tokens_total") == 80
    assert value("kvserve_generation_tokens_total") == 6
    assert value("kvserve_prefix_cache_queries_total") == 80
    assert value("kvserve_prefix_cache_hits_total") == 32
    assert value("kvserve_num_preemptions_total") == 1
    assert value("kvserve_step_duration_seconds_count", kind="mixed") == 1
    assert value("kvserve_step_duration_seconds_count", kind="decode") == 1
    assert value("kvserve_step_duration_seconds_count", kind="prefill") == 0
    assert value("kvserve_step_duration_seconds_sum", kind="mixed") == pytest.approx(0.03)
    assert value("kvserve_step_duration_seconds_bucket", kind="decode", le="0.005") == 1
    assert value("kvserve_step_duration_seconds_bucket", kind="decode", le="0.001") == 0
    assert value("kvserve_step_batch_tokens_count") == 2
    assert value("kvserve_step_batch_tokens_sum") == 24
    assert value("kvserve_step_batch_tokens_bucket", le="4.0") == 1


def test_token_latencies_and_finished_request_phases(metrics: ServerMetrics) -> None:
    value = Reader(metrics)
    stats = _step(first_tokens=[("a", 0.2), ("b", 0.3)], inter_token_latencies=[0.01, 0.02, 0.05])
    stats.finished = [
        _finished("length"),
        _finished("stop"),
        _finished("abort"),
        _finished("error"),
    ]
    metrics.on_step(stats)
    assert value("kvserve_time_to_first_token_seconds_count") == 2
    assert value("kvserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value("kvserve_inter_token_latency_seconds_count") == 3
    assert value("kvserve_inter_token_latency_seconds_sum") == pytest.approx(0.08)
    # Aborted and failed requests are not successes and leave the request histograms alone.
    assert value("kvserve_request_success_total", finish_reason="length") == 1
    assert value("kvserve_request_success_total", finish_reason="stop") == 1
    assert value("kvserve_request_success_total", finish_reason="abort") == 0
    assert value("kvserve_request_success_total", finish_reason="error") == 0
    for name, each in [
        ("kvserve_e2e_request_latency_seconds", 2.0),
        ("kvserve_request_queue_time_seconds", 0.1),
        ("kvserve_request_prefill_time_seconds", 0.4),
        ("kvserve_request_decode_time_seconds", 1.5),
    ]:
        assert value(name + "_count") == 2, name
        assert value(name + "_sum") == pytest.approx(2 * each), name


def test_scoring_only_request_has_no_decode_time(metrics: ServerMetrics) -> None:
    value = Reader(metrics)
    metrics.on_step(_step(finished=[_finished("length", first_token=None)]))
    assert value("kvserve_request_prefill_time_seconds_sum") == pytest.approx(1.9)
    assert value("kvserve_request_decode_time_seconds_sum") == 0
    assert value("kvserve_request_decode_time_seconds_count") == 1


def test_known_label_values_are_exported_before_traffic(metrics: ServerMetrics) -> None:
    text = metrics.render().decode()
    for series in (
        'kvserve_request_success_total{finish_reason="length"} 0.0',
        'kvserve_step_duration_seconds_count{kind="prefill"} 0.0',
        "kvserve_num_requests_running 0.0",
        "kvserve_kv_cache_usage_ratio 0.0",
        "kvserve_requests_rejected_total 0.0",
    ):
        assert series in text


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _http(samples: dict, route: str, status: int) -> float:
    key = ("kvserve_http_requests_total", (("route", route), ("status", str(status))))
    return samples.get(key, 0.0)


async def test_http_counts_by_route_template_and_429_is_a_rejection() -> None:
    engine = FakeEngine()
    app = build_app(ServerConfig(), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/v1/models/some-model")).status_code == 404
        assert (await c.get("/v1/models/other/name")).status_code == 404
        assert (await c.get("/no/such/path/123")).status_code == 404
        assert (await c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})).is_success
        engine.queue_full = True
        assert (await c.post("/v1/completions", json={"prompt": "ab"})).status_code == 429
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    assert _http(samples, "/v1/models/{model:path}", 404) == 2
    assert _http(samples, "unmatched", 404) == 1
    assert _http(samples, "/v1/completions", 200) == 1
    assert _http(samples, "/v1/completions", 429) == 1
    assert not any("some-model" in value for _, labels in samples for _, value in labels)
    assert samples[("kvserve_requests_rejected_total", ())] == 1


async def test_metrics_needs_the_api_key_and_401s_are_counted_by_route() -> None:
    app = build_app(ServerConfig(api_key="sekret"), FakeEngine())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.post("/v1/chat/completions", json={})).status_code == 401
        r = await c.get("/metrics", headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200
    samples = _samples(r.text)
    assert _http(samples, "/metrics", 401) == 1
    assert _http(samples, "/v1/chat/completions", 401) == 1


async def test_gauges_are_read_from_the_engine_at_scrape_time() -> None:
    engine = FakeEngine()
    app = build_app(ServerConfig(), None)  # the engine attaches later, as while a model loads
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        loading = _samples((await c.get("/metrics")).text)
        assert loading[("kvserve_num_requests_running", ())] == 0
        app.state.server.engine = engine
        engine.published = EngineSnapshot(
            task="generate",
            num_steps=7,
            time=0.0,
            num_requests_running=2,
            num_requests_waiting=5,
            kv_cache_usage=0.75,
        )
        busy = _samples((await c.get("/metrics")).text)
    assert busy[("kvserve_num_requests_running", ())] == 2
    assert busy[("kvserve_num_requests_waiting", ())] == 5
    assert busy[("kvserve_kv_cache_usage_ratio", ())] == 0.75


async def test_step_listener_attaches_once_to_a_later_engine() -> None:
    engine = FakeEngine()
    app = build_app(ServerConfig(), None)
    metrics: ServerMetrics = app.state.metrics
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        await c.get("/health")
        app.state.server.engine = engine
        await c.get("/health")
        await c.get("/v1/models")
    assert engine.step_listeners == [metrics.on_step]
    engine.step_listeners[0](_step())
    assert Reader(metrics)("kvserve_prompt_tokens_total") == 40


def test_each_app_has_its_own_registry() -> None:
    a, b = build_app(ServerConfig(), None), build_app(ServerConfig(), None)
    a.state.metrics.on_step(_step())
    assert Reader(a.state.metrics)("kvserve_generation_tokens_total") == 3
    assert Reader(b.state.metrics)("kvserve_generation_tokens_total") == 0


async def test_request_logs_carry_the_request_id_but_no_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine()
    app = build_app(ServerConfig(), engine)
    caplog.set_level(logging.DEBUG, logger="server")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "secret words", "max_tokens": 3},
            headers={"X-Request-Id": "trace-42"},
        )
        assert r.headers["x-request-id"] == "trace-42"
        engine.fail_after = 1
        r = await c.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 3},
            headers={"X-Request-Id": "t-9"},
        )
        assert r.status_code == 500
    lines = [rec.getMessage() for rec in caplog.records]
    mine = [line for line in lines if "trace-42" in line]
    assert any("finished" in line and "completion_tokens=3" in line for line in mine), lines
    assert any("12 prompt tokens" in line for line in mine), lines
    failed = [
        rec for rec in caplog.records if "t-9" in rec.getMessage() and "failed" in rec.getMessage()
    ]
    assert failed and failed[0].levelno == logging.WARNING
    assert not any("secret" in line for line in lines)


def test_exported_families_are_the_ones_the_dashboard_test_knows(metrics: ServerMetrics) -> None:
    from tests.unit.test_dashboard import COUNTERS_AND_GAUGES, HISTOGRAMS

    metrics.on_http_response("/health", 200)  # labelled families appear once they have a child
    exposed = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in metrics.registry.collect()
    }
    assert exposed == COUNTERS_AND_GAUGES | HISTOGRAMS


def test_speculative_decoding_counters_use_vllm_names(metrics: ServerMetrics) -> None:
    value = Reader(metrics)
    metrics.on_step(_step())  # no verification in this step: the counters stay at 0
    spec = dict(spec_num_drafts=2, spec_num_draft_tokens=7, spec_num_accepted_tokens=4)
    metrics.on_step(_step(**spec, spec_accepted_per_position=[2, 1, 1, 0]))
    metrics.on_step(_step(**spec, spec_accepted_per_position=[2, 2]))
    assert value("kvserve_spec_decode_num_drafts_total") == 4
    assert value("kvserve_spec_decode_num_draft_tokens_total") == 14
    assert value("kvserve_spec_decode_num_accepted_tokens_total") == 8
    per_pos = "kvserve_spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, position=str(p)) for p in range(4)] == [4, 3, 1, 0]


async def test_kv_offload_tiers_are_exported_only_with_tiers() -> None:
    from engine.core.kv_offload import KVOffloadStats

    engine = FakeEngine()
    app = build_app(ServerConfig(), None)
    app.state.server.engine = engine
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        engine.published = EngineSnapshot(task="generate", num_steps=1, time=0.0)
        assert "kvserve_kv_offload" not in (await c.get("/metrics")).text
        tiers = KVOffloadStats(memory_hits=4, disk_hits=2, misses=3, saved_bytes=1000)
        tiers.disk_enabled, tiers.disk_capacity, tiers.disk_bytes = True, 5000, 700
        tiers.memory_capacity = 2000
        engine.published = EngineSnapshot(task="generate", num_steps=2, time=1.0, kv_offload=tiers)
        samples = _samples((await c.get("/metrics")).text)
        disk_only = KVOffloadStats(disk_hits=2, misses=3, disk_capacity=5000, disk_enabled=True)
        engine.published = EngineSnapshot(
            task="generate", num_steps=3, time=2.0, kv_offload=disk_only
        )
        no_host = _samples((await c.get("/metrics")).text)
    assert no_host[("kvserve_kv_offload_misses_total", (("tier", "memory"),))] == 0  # no host tier
    assert no_host[("kvserve_kv_offload_misses_total", (("tier", "disk"),))] == 3
    assert samples[("kvserve_kv_offload_hits_total", (("tier", "memory"),))] == 4
    assert samples[("kvserve_kv_offload_hits_total", (("tier", "disk"),))] == 2
    assert samples[("kvserve_kv_offload_misses_total", (("tier", "memory"),))] == 5
    assert samples[("kvserve_kv_offload_misses_total", (("tier", "disk"),))] == 3
    assert samples[("kvserve_kv_offload_bytes_total", (("direction", "saved"),))] == 1000
    assert samples[("kvserve_kv_offload_capacity_bytes", (("tier", "disk"),))] == 5000
    assert samples[("kvserve_kv_offload_used_bytes", (("tier", "disk"),))] == 700
