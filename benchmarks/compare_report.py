"""compare.py's per-file summary for the llama.cpp side-by-side: the headline figures of each GGUF
file (throughput at concurrency 8 and 32, ITL and TTFT at concurrency 1, long-prompt TTFTs) with the
kvserve/peer ratio, and batch-1 ITL against the file's weight-streaming limit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from benchmarks.gguf_files import streaming_limit_ms
from server.bench import ratio

# (label, level key or None for each long level, metrics key, stat)
HEADLINES: list[tuple[str, str, str, str | None]] = [
    ("output tok/s c=32", "32", "output_throughput", None),
    ("output tok/s c=8", "8", "output_throughput", None),
    ("ITL median c=1 ms", "1", "itl_ms", "median"),
    ("TTFT median c=1 ms", "1", "ttft_ms", "median"),
]


@dataclass(frozen=True)
class StreamingLimit:
    """Batch-1 decode can be no faster than streaming its bytes once: bytes / read bandwidth."""

    bytes_per_token: float
    read_gbps: float  # the median of the probes
    context_len: int
    probes_gbps: tuple[float, ...] = ()  # read bandwidth measured before and after the file's run

    @property
    def itl_ms(self) -> float:
        return streaming_limit_ms(self.bytes_per_token, self.read_gbps)


def figure(metrics: dict[str, Any] | None, key: str, stat: str | None) -> float:
    if not metrics or "error" in metrics or key not in metrics:
        return math.nan
    value = metrics[key] if stat is None else metrics[key].get(stat, math.nan)
    return float(value)


def headline_rows(
    kv: dict[str, dict[str, Any]], peer: dict[str, dict[str, Any]]
) -> list[tuple[str, float, float]]:
    """(label, kvserve, peer) for each headline figure both sides may have, long prompts included."""
    rows = []
    for label, level, key, stat in HEADLINES:
        if level in kv or level in peer:
            rows.append(
                (label, figure(kv.get(level), key, stat), figure(peer.get(level), key, stat))
            )
    longs = sorted(
        {k for k in (*kv, *peer) if k.startswith("long")}, key=lambda k: int(k.removeprefix("long"))
    )
    for level in longs:
        label = f"TTFT {level.removeprefix('long')}-token prompt ms"
        a, b = (
            figure(kv.get(level), "ttft_ms", "median"),
            figure(peer.get(level), "ttft_ms", "median"),
        )
        rows.append((label, a, b))
    return rows


def format_file_summary(
    title: str,
    kv: dict[str, dict[str, Any]],
    peer: dict[str, dict[str, Any]],
    peer_name: str,
    limit: StreamingLimit | None,
) -> str:
    lines = [
        f"\n==== {title} ====",
        f"{'figure':<30}{'kvserve':>11}{peer_name:>11}{'kvserve/peer':>14}",
    ]
    for label, a, b in headline_rows(kv, peer):
        lines.append(f"{label:<30}{fmt_value(a):>11}{fmt_value(b):>11}{fmt_ratio(ratio(a, b)):>14}")
    if limit is not None:
        lines.append(
            f"weight-streaming limit at c=1: {limit.bytes_per_token / 1e6:.1f} MB per token "
            f"(context {limit.context_len}) / {limit.read_gbps:.1f} GB/s read = "
            f"{limit.itl_ms:.2f} ms"
            + (
                f" (read bandwidth probes before and after: "
                f"{', '.join(f'{g:.1f}' for g in limit.probes_gbps)} GB/s)"
                if len(limit.probes_gbps) > 1
                else ""
            )
        )
        a = figure(kv.get("1"), "itl_ms", "median")
        b = figure(peer.get("1"), "itl_ms", "median")
        lines.append(
            f"ITL c=1 / limit: kvserve {fmt_ratio(a / limit.itl_ms)}, "
            f"{peer_name} {fmt_ratio(b / limit.itl_ms)}"
        )
    return "\n".join(lines)


def format_markdown(
    files: list[
        tuple[str, dict[str, dict[str, Any]], dict[str, dict[str, Any]], StreamingLimit | None]
    ],
) -> str:
    """One markdown row per file and figure: kvserve, peer, ratio (the README's side-by-side)."""
    lines = ["| file | figure | kvserve | llama.cpp | kvserve/llama.cpp |", "|---|---|---|---|---|"]
    for name, kv, peer, limit in files:
        for label, a, b in headline_rows(kv, peer):
            lines.append(
                f"| {name} | {label} | {fmt_value(a)} | {fmt_value(b)} | {fmt_ratio(ratio(a, b))} |"
            )
        if limit is not None:
            a = figure(kv.get("1"), "itl_ms", "median") / limit.itl_ms
            b = figure(peer.get("1"), "itl_ms", "median") / limit.itl_ms
            lines.append(
                f"| {name} | ITL c=1 / streaming limit ({limit.itl_ms:.2f} ms) | "
                f"{fmt_ratio(a)} | {fmt_ratio(b)} | |"
            )
    return "\n".join(lines)


def fmt_value(value: float, digits: int = 1) -> str:
    """A figure, or "n/a" where it is missing."""
    return "n/a" if math.isnan(value) else f"{value:,.{digits}f}"


def fmt_ratio(value: float) -> str:
    """A ratio as "1.23x", or "n/a" (never "n/ax") where a figure is missing."""
    return "n/a" if math.isnan(value) else f"{value:,.2f}x"
