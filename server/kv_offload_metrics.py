"""Prometheus metrics of the KV offload tiers, read at scrape time from the engine's snapshot: blocks
loaded back per tier, misses, bytes moved, load-back time (counters since start-up) and each tier's
fill (gauges). Nothing is exported when the engine runs without tiers."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.state import ServerState

TIERS = ("memory", "disk")


class KVOffloadCollector:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        engine = self.state.engine
        t = engine.snapshot().kv_offload if engine is not None else None
        if t is None:
            return
        hits = CounterMetricFamily(
            "kvserve_kv_offload_hits",
            "KV blocks loaded back from an offload tier instead of being recomputed, by tier.",
            labels=["tier"],
        )
        hits.add_metric(["memory"], t.memory_hits)
        hits.add_metric(["disk"], t.disk_hits)
        yield hits
        tokens = CounterMetricFamily(
            "kvserve_kv_offload_hit_tokens",
            "Prompt tokens an offload tier supplied, by tier.",
            labels=["tier"],
        )
        tokens.add_metric(["memory"], t.memory_hit_tokens)
        tokens.add_metric(["disk"], t.disk_hit_tokens)
        yield tokens
        misses = CounterMetricFamily(
            "kvserve_kv_offload_misses",
            "Full prompt blocks the prefix cache lacked and this tier did not supply, by tier "
            "(the host tier's misses include the disk tier's hits).",
            labels=["tier"],
        )
        misses.add_metric(["memory"], t.misses + t.disk_hits if t.memory_capacity else 0)
        misses.add_metric(["disk"], t.misses)
        yield misses
        moved = CounterMetricFamily(
            "kvserve_kv_offload_bytes",
            "Bytes moved: saved (pool to tiers), loaded (tiers to pool), disk written and read.",
            labels=["direction"],
        )
        for direction, value in (
            ("saved", t.saved_bytes),
            ("loaded", t.loaded_bytes),
            ("disk_written", t.disk_written_bytes),
            ("disk_read", t.disk_read_bytes),
        ):
            moved.add_metric([direction], value)
        yield moved
        yield CounterMetricFamily(
            "kvserve_kv_offload_load_seconds",
            "Seconds spent loading blocks back (disk reads and copies into the pool).",
            value=t.load_seconds,
        )
        yield CounterMetricFamily(
            "kvserve_kv_offload_corrupt_entries",
            "Disk entries that failed their checksum or were cut short (served as misses).",
            value=t.corrupt_entries,
        )
        used = GaugeMetricFamily(
            "kvserve_kv_offload_used_bytes", "Bytes each offload tier holds.", labels=["tier"]
        )
        capacity = GaugeMetricFamily(
            "kvserve_kv_offload_capacity_bytes",
            "Each offload tier's budget (0: off).",
            labels=["tier"],
        )
        blocks = GaugeMetricFamily(
            "kvserve_kv_offload_blocks", "KV blocks each offload tier holds.", labels=["tier"]
        )
        disk_capacity = t.disk_capacity if t.disk_enabled else 0
        for tier, u, c, n in (
            ("memory", t.memory_bytes, t.memory_capacity, t.memory_entries),
            ("disk", t.disk_bytes, disk_capacity, t.disk_entries),
        ):
            used.add_metric([tier], u)
            capacity.add_metric([tier], c)
            blocks.add_metric([tier], n)
        yield used
        yield capacity
        yield blocks
