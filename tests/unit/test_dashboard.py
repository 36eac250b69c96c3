"""The provisioned Grafana dashboard and Prometheus config name only metrics kvserve exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvserve.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources"
PROVIDERS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"

# The metric families of issue 7 (names as exposed; counters keep their `_total`).
COUNTERS_AND_GAUGES = {
    "kvserve_num_requests_running",
    "kvserve_num_requests_waiting",
    "kvserve_kv_cache_usage_ratio",
    "kvserve_prefix_cache_queries_total",
    "kvserve_prefix_cache_hits_total",
    "kvserve_prompt_tokens_total",
    "kvserve_generation_tokens_total",
    "kvserve_request_success_total",
    "kvserve_requests_total",
    "kvserve_requests_rejected_total",
    "kvserve_num_preemptions_total",
    "kvserve_http_requests_total",
    "kvserve_spec_decode_num_drafts_total",
    "kvserve_spec_decode_num_draft_tokens_total",
    "kvserve_spec_decode_num_accepted_tokens_total",
    "kvserve_spec_decode_num_accepted_tokens_per_pos_total",
    "kvserve_lora_requests_total",
    "kvserve_lora_requests_info",
}
HISTOGRAMS = {
    "kvserve_time_to_first_token_seconds",
    "kvserve_inter_token_latency_seconds",
    "kvserve_e2e_request_latency_seconds",
    "kvserve_request_queue_time_seconds",
    "kvserve_request_prefill_time_seconds",
    "kvserve_request_decode_time_seconds",
    "kvserve_step_duration_seconds",
    "kvserve_step_batch_tokens",
}
METRIC_RE = re.compile(r"\bkvserve_[a-z0-9_]+")


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return out


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if "expr" in t]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else str(query or ""))
    return exprs


def exported_name(series: str) -> str:
    """Map a series name used in PromQL to its metric family, or raise if it is not exported."""
    if series in COUNTERS_AND_GAUGES:
        return series
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if base != series and base in HISTOGRAMS:
            return base
    raise KeyError(series)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_loads_with_panels(dashboard: dict) -> None:
    assert dashboard["title"] == "kvserve"
    assert dashboard["uid"]
    graphs = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(graphs) >= 10
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in graphs:
        assert panel["targets"], f"panel {panel['title']!r} has no query"


def test_every_expr_names_only_exported_metrics(dashboard: dict) -> None:
    exprs = _exprs(dashboard)
    assert exprs
    unknown = set()
    for expr in exprs:
        names = METRIC_RE.findall(expr)
        assert names, f"query names no kvserve metric: {expr}"
        for name in names:
            try:
                exported_name(name)
            except KeyError:
                unknown.add(name)
    assert not unknown, f"dashboard names metrics kvserve does not export: {sorted(unknown)}"


def test_exported_name_rejects_unknown_series() -> None:
    assert exported_name("kvserve_step_batch_tokens_bucket") == "kvserve_step_batch_tokens"
    for bad in ("kvserve_prompt_tokens", "kvserve_num_requests_running_bucket", "kvserve_ttft"):
        with pytest.raises(KeyError):
            exported_name(bad)


def test_histogram_quantiles_read_buckets_by_le(dashboard: dict) -> None:
    quantile_exprs = [e for e in _exprs(dashboard) if "histogram_quantile" in e]
    assert quantile_exprs
    for expr in quantile_exprs:
        assert "_bucket" in expr and re.search(r"by \([^)]*\ble\b", expr), expr


def test_dashboard_covers_throughput_latency_queue_and_kv(dashboard: dict) -> None:
    used = {exported_name(n) for e in _exprs(dashboard) for n in METRIC_RE.findall(e)}
    required = {
        "kvserve_prompt_tokens_total",
        "kvserve_generation_tokens_total",
        "kvserve_time_to_first_token_seconds",
        "kvserve_inter_token_latency_seconds",
        "kvserve_e2e_request_latency_seconds",
        "kvserve_num_requests_running",
        "kvserve_num_requests_waiting",
        "kvserve_kv_cache_usage_ratio",
        "kvserve_prefix_cache_hits_total",
        "kvserve_prefix_cache_queries_total",
        "kvserve_num_preemptions_total",
        "kvserve_requests_rejected_total",
    }
    assert required <= used, f"missing panels for {sorted(required - used)}"
    latency = [e for e in _exprs(dashboard) if "histogram_quantile" in e]
    for hist in (
        "kvserve_time_to_first_token_seconds",
        "kvserve_inter_token_latency_seconds",
        "kvserve_e2e_request_latency_seconds",
    ):
        quantiles = {
            m for e in latency if hist in e for m in re.findall(r"histogram_quantile\(([\d.]+)", e)
        }
        assert {"0.5", "0.99"} <= quantiles, f"{hist}: p50 and p99 expected, got {quantiles}"


def test_panels_use_the_provisioned_datasource(dashboard: dict) -> None:
    sources = []
    for path in DATASOURCES.glob("*.yml"):
        sources += yaml.safe_load(path.read_text())["datasources"]
    uids = {s["uid"] for s in sources if s["type"] == "prometheus"}
    assert uids
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        refs = [panel["datasource"]] + [t["datasource"] for t in panel["targets"]]
        assert all(r["uid"] in uids for r in refs), panel["title"]


def test_provisioning_points_at_the_mounted_dashboards() -> None:
    providers = yaml.safe_load(next(PROVIDERS.glob("*.yml")).read_text())["providers"]
    paths = {p["options"]["path"] for p in providers}
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    for path in paths:
        assert mounts.get(path) == "./deploy/grafana/dashboards", f"{path} is not mounted"


def test_prometheus_scrapes_kvserve_metrics() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs["kvserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert "kvserve:8000" in targets
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for target in targets:
        assert target.split(":")[0] in services, f"{target} is not a compose service"
