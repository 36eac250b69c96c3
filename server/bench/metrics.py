"""Load-generator statistics as pure functions: what the client saw of each request (RequestRecord)
and the throughput / TTFT / TPOT / ITL / end-to-end summary of a run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """What the client saw of one request; times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token; a non-streamed request's first token arrives with its last."""
        if not self.ok:
            return None
        return (self.chunk_times[0] if self.chunk_times else self.end) - self.start

    @property
    def e2e(self) -> float | None:
        return self.end - self.start if self.ok else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.ttft is not None and self.e2e is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed chunks (one chunk is usually one token)."""
        if not self.ok:
            return []
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics; NaN if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], percentiles: Sequence[float] = (99,)) -> dict[str, float]:
    """mean, median and each requested percentile of `values` (seconds in, milliseconds out)."""
    ms = [v * 1000.0 for v in values]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan, "median": percentile(ms, 50)}
    for q in percentiles:
        if q != 50:
            out[f"p{q:g}"] = percentile(ms, q)
    return out


def compute_metrics(
    records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float] = (99,)
) -> dict[str, Any]:
    """Aggregate throughput and latency figures over a run that lasted `duration` seconds."""
    done = [r for r in records if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    return {
        "completed": len(done),
        "failed": sum(1 for r in records if not r.ok and r.error != "cancelled"),
        "cancelled": sum(1 for r in records if r.error == "cancelled"),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        # also counts tokens streamed by requests the deadline cut off (a time-bounded slow server)
        "streamed_output_throughput": per_second(
            output_tokens + sum(len(r.chunk_times) for r in records if not r.ok)
        ),
        "total_token_throughput": per_second(prompt_tokens + output_tokens),
        "ttft_ms": summarize([r.ttft for r in done if r.ttft is not None], percentiles),
        "tpot_ms": summarize([r.tpot for r in done if r.tpot is not None], percentiles),
        "itl_ms": summarize([gap for r in done for gap in r.itls], percentiles),
        "e2e_ms": summarize([r.e2e for r in done if r.e2e is not None], percentiles),
        "errors": sorted({r.error for r in records if r.error and r.error != "cancelled"})[:5],
    }


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either side is missing or b is zero."""
    if b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
