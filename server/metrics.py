"""Prometheus metrics for one app: engine step stats fed by a step listener, queue and KV gauges read at
scrape time from the engine's published snapshot, and HTTP request counts by route template;
`GET /metrics` serves them."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.kv_offload_metrics import KVOffloadCollector
from server.state import ServerState

if TYPE_CHECKING:
    from engine import EngineClient, EngineSnapshot, FinishedRequestStats, StepStats

logger = logging.getLogger(__name__)

# Request-level latencies span milliseconds (TTFT on a GPU) to minutes (long CPU generations).
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
# Per-token and per-step times: sub-millisecond on a GPU, up to seconds for big CPU prefills.
STEP_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0,
)  # fmt: skip
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_KINDS = ("prefill", "decode", "mixed")
SUCCESS_REASONS = ("stop", "length")  # aborted and failed requests are not successes
REQUEST_KINDS = ("generate", "score")
UNMATCHED_ROUTE = "unmatched"  # one label for every unknown path, so cardinality stays bounded


class _QueueGauges:
    """Running/waiting requests and KV usage from the engine's latest snapshot, read at scrape time
    (the core republishes it after every step and after adds and aborts, so it is exact when idle)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        snapshot = engine.snapshot() if engine is not None else None
        yield GaugeMetricFamily(
            "kvserve_num_requests_running",
            "Requests with sequences in the running batch.",
            snapshot.num_requests_running if snapshot else 0,
        )
        yield GaugeMetricFamily(
            "kvserve_num_requests_waiting",
            "Requests waiting to be scheduled (including preempted ones).",
            snapshot.num_requests_waiting if snapshot else 0,
        )
        yield GaugeMetricFamily(
            "kvserve_kv_cache_usage_ratio",
            "Fraction of KV cache blocks held by live sequences (0 to 1).",
            snapshot.kv_cache_usage if snapshot else 0.0,
        )
        events = snapshot.kv_events if snapshot else None
        if events is not None:  # --kv-events-config: the publisher's counts since start-up
            for name, text, value in (
                ("kv_events_published", "KV cache events published.", events.num_events),
                ("kv_event_batches_published", "KV event batches published.", events.num_batches),
                (
                    "kv_event_batches_dropped",
                    "KV event batches dropped (queue full).",
                    events.num_dropped,
                ),
            ):
                yield CounterMetricFamily(f"kvserve_{name}", text, value)
        yield _lora_info(snapshot)


def _lora_info(snapshot: EngineSnapshot | None) -> Metric:
    """vLLM's lora_requests_info: the adapters of running and of waiting requests (comma-separated)
    and the adapters one step runs at most, as labels; the value is the scrape's unix time."""
    info = GaugeMetricFamily(
        "kvserve_lora_requests_info",
        "LoRA adapters of running and waiting requests, and the most one step runs (labels).",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running = ",".join(snapshot.running_loras) if snapshot else ""
    waiting = ",".join(snapshot.waiting_loras) if snapshot else ""
    max_lora = str(snapshot.max_loras) if snapshot else "0"
    info.add_metric([running, waiting, max_lora], time.time())
    return info


class ServerMetrics:
    """Every kvserve metric, in a registry of its own (several apps in one process never collide)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.registry = CollectorRegistry()
        self._engine: EngineClient | None = None
        r = self.registry
        r.register(_QueueGauges(state))
        r.register(KVOffloadCollector(state))
        self.prompt_tokens = Counter(
            "kvserve_prompt_tokens", "Prompt tokens of requests admitted to the engine.", registry=r
        )
        self.generation_tokens = Counter(
            "kvserve_generation_tokens", "Tokens generated (all samples).", registry=r
        )
        self.prefix_cache_queries = Counter(
            "kvserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "kvserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.preemptions = Counter(
            "kvserve_num_preemptions", "Sequences preempted to free KV cache blocks.", registry=r
        )
        self.request_success = Counter(
            "kvserve_request_success",
            "Requests that finished normally, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.requests = Counter(
            "kvserve_requests",
            "Requests the engine finished, by kind (generate, score) and finish reason.",
            ["kind", "finish_reason"],
            registry=r,
        )
        self.lora_requests = Counter(
            "kvserve_lora_requests",
            "Requests the engine finished on each LoRA adapter (any finish reason).",
            ["adapter"],
            registry=r,
        )
        self.requests_rejected = Counter(
            "kvserve_requests_rejected",
            "Requests refused by admission control (answered 429).",
            registry=r,
        )
        self.http_requests = Counter(
            "kvserve_http_requests",
            "HTTP requests by route template and status code.",
            ["route", "status"],
            registry=r,
        )
        # Speculative decoding, with vLLM's names (vllm:spec_decode_*).
        self.spec_num_drafts = Counter(
            "kvserve_spec_decode_num_drafts",
            "Verification steps of sequences with speculative draft tokens.",
            registry=r,
        )
        self.spec_num_draft_tokens = Counter(
            "kvserve_spec_decode_num_draft_tokens", "Speculative tokens proposed.", registry=r
        )
        self.spec_num_accepted_tokens = Counter(
            "kvserve_spec_decode_num_accepted_tokens",
            "Speculative tokens accepted by verification.",
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            "kvserve_spec_decode_num_accepted_tokens_per_pos",
            "Speculative tokens accepted, by their position in the draft (0 = first).",
            ["position"],
            registry=r,
        )
        self.ttft = self._histogram(
            "kvserve_time_to_first_token_seconds", "From arrival to the first generated token."
        )
        self.itl = self._histogram(
            "kvserve_inter_token_latency_seconds",
            "Between consecutive tokens of a request's first sample.",
            STEP_LATENCY_BUCKETS,
        )
        self.e2e = self._histogram(
            "kvserve_e2e_request_latency_seconds", "From arrival to the last token."
        )
        self.queue_time = self._histogram(
            "kvserve_request_queue_time_seconds", "From arrival to first being scheduled."
        )
        self.prefill_time = self._histogram(
            "kvserve_request_prefill_time_seconds",
            "From first being scheduled to the first generated token.",
        )
        self.decode_time = self._histogram(
            "kvserve_request_decode_time_seconds", "From the first generated token to the last."
        )
        self.step_duration = Histogram(
            "kvserve_step_duration_seconds",
            "Engine step time (schedule, forward, sample, outputs) by step kind.",
            ["kind"],
            buckets=STEP_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_batch_tokens = Histogram(
            "kvserve_step_batch_tokens",
            "Tokens computed in one engine step (prefill chunks plus decodes).",
            buckets=BATCH_TOKEN_BUCKETS,
            registry=r,
        )
        # Known label values exist from the start, so rate() and dashboards see them before traffic.
        for reason in SUCCESS_REASONS:
            self.request_success.labels(reason)
            for request_kind in REQUEST_KINDS:
                self.requests.labels(request_kind, reason)
        # Each step kind's child, looked up once (labels() costs a lock and a dict per call).
        self._step_duration_by_kind = {kind: self.step_duration.labels(kind) for kind in STEP_KINDS}

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float] = REQUEST_LATENCY_BUCKETS
    ) -> Histogram:
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    # -- feeding ---------------------------------------------------------------------------------
    def attach(self) -> None:
        """Listen to the steps of the state's engine (once it exists; a replaced engine is re-attached)."""
        engine = self.state.engine
        if engine is self._engine:
            return
        if engine is not None:
            engine.add_step_listener(self.on_step)
        self._engine = engine

    def on_step(self, stats: StepStats) -> None:
        # Once per step on the event loop, beside every stream's tokens: counters that did not
        # move are left alone (most steps are pure decodes).
        if stats.num_new_prompt_tokens:
            self.prompt_tokens.inc(stats.num_new_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        step = self._step_duration_by_kind.get(stats.kind)
        if step is None:
            step = self._step_duration_by_kind[stats.kind] = self.step_duration.labels(stats.kind)
        step.observe(stats.duration)
        self.step_batch_tokens.observe(stats.num_batched_tokens)
        if stats.spec_num_drafts:
            self.spec_num_drafts.inc(stats.spec_num_drafts)
            self.spec_num_draft_tokens.inc(stats.spec_num_draft_tokens)
            self.spec_num_accepted_tokens.inc(stats.spec_num_accepted_tokens)
            for position, count in enumerate(stats.spec_accepted_per_position):
                self.spec_accepted_per_pos.labels(str(position)).inc(count)
        for _, ttft in stats.first_tokens:
            self.ttft.observe(ttft)
        for latency in stats.inter_token_latencies:
            self.itl.observe(latency)
        for finished in stats.finished:
            self._on_finished(finished)

    def _on_finished(self, f: FinishedRequestStats) -> None:
        self.requests.labels(f.kind, f.finish_reason).inc()
        if f.lora is not None:
            self.lora_requests.labels(f.lora).inc()
        if f.finish_reason not in SUCCESS_REASONS:
            return
        self.request_success.labels(f.finish_reason).inc()
        self.e2e.observe(f.finished_time - f.arrival_time)
        scheduled = f.first_scheduled_time if f.first_scheduled_time is not None else f.arrival_time
        # A scoring-only request (echo, max_tokens=0) has no token: all its time after the queue is prefill.
        first_token = f.first_token_time if f.first_token_time is not None else f.finished_time
        self.queue_time.observe(scheduled - f.arrival_time)
        self.prefill_time.observe(first_token - scheduled)
        self.decode_time.observe(f.finished_time - first_token)

    def on_http_response(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()
        if status == 429:
            self.requests_rejected.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_template(scope: Scope, routes: Iterable[BaseRoute]) -> str:
    """The path template of the route serving `scope` (e.g. "/v1/models/{model:path}"), never the raw
    path; responses sent before routing (401, 413, draining 503) are matched here."""
    route = scope.get("route")
    if route is None:
        for candidate in routes:
            if not isinstance(getattr(candidate, "path", None), str):
                continue  # a wrapper around included routes; their own routes are listed too
            match, _ = candidate.matches(scope)
            if match is not Match.NONE:  # PARTIAL: the path exists but not for this method
                route = candidate
                break
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE


class MetricsMiddleware:
    """Pure ASGI: counts each HTTP request by route template and status once its response is done, and
    hooks the step listener onto the engine as soon as one is attached (every step follows a request)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.metrics.attach()
        status = 500  # what the client gets when the app raises before responding

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.on_http_response(route_template(scope, self.routes), status)


router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's metrics."""
    server_metrics: ServerMetrics = request.app.state.metrics
    server_metrics.attach()
    return Response(server_metrics.render(), media_type=CONTENT_TYPE_LATEST)
