"""The per-request cost sheet: an opt-in `metrics` object (request field `return_metrics: true` or header
`X-KVServe-Metrics: true`) that every generating API surface adds to its response and final stream chunk.
Times use the same definitions as the Prometheus request histograms; names follow vLLM's where vLLM
reports the same figure (queued_time, prefill_time, decode_time, inference_time, e2e_latency,
mean_time_per_output_token, num_cached_tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request

from engine import RequestOutput

METRICS_HEADER = "x-kvserve-metrics"
_TRUE = ("1", "true", "yes", "on")


def wants_metrics(field: bool | None, raw: Request) -> bool:
    """The request field wins when given; otherwise the header decides."""
    if field is not None:
        return field
    return raw.headers.get(METRICS_HEADER, "").strip().lower() in _TRUE


def _sheet(out: RequestOutput) -> dict[str, Any]:
    m = out.metrics
    num_prompt = len(out.prompt_token_ids)
    sheet: dict[str, Any] = {
        "num_prompt_tokens": num_prompt,
        "num_cached_tokens": out.num_cached_tokens,
        "num_computed_prompt_tokens": num_prompt - out.num_cached_tokens,
        "lora": out.lora,  # the LoRA adapter it ran on (None: the base model)
    }
    if m is None:
        return sheet
    arrival = m.arrival_time
    finished = m.finished_time if m.finished_time is not None else m.last_token_time or arrival
    scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else arrival
    first_token = m.first_token_time if m.first_token_time is not None else finished
    num_gaps = m.num_token_gaps  # the gaps the inter-token-latency histogram observed
    last_token = m.last_token_time if m.last_token_time is not None else first_token
    sheet.update(
        {
            "queued_time": scheduled - arrival,
            "time_to_first_token": (first_token - arrival) if m.first_token_time else None,
            "prefill_time": first_token - scheduled,
            "decode_time": finished - first_token,
            "inference_time": finished - scheduled,
            "e2e_latency": finished - arrival,
            "mean_time_per_output_token": (
                (last_token - first_token) / num_gaps if num_gaps else None
            ),
            "num_generation_tokens": m.num_generation_tokens,
            "num_preemptions": m.num_preemptions,
            "num_recomputed_tokens": m.num_recomputed_tokens,
            "kv_block_seconds": m.kv_block_seconds,
            "num_draft_tokens": m.num_draft_tokens,  # speculative decoding: proposed
            "num_accepted_tokens": m.num_accepted_tokens,  # ... and accepted
            # Of num_cached_tokens, those the KV offload tiers loaded back (the rest: the pool).
            "num_memory_tier_tokens": m.num_memory_tier_tokens,
            "num_disk_tier_tokens": m.num_disk_tier_tokens,
        }
    )
    return sheet


_SUMMED = (
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_computed_prompt_tokens",
    "num_generation_tokens",
    "num_preemptions",
    "num_recomputed_tokens",
    "kv_block_seconds",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_memory_tier_tokens",
    "num_disk_tier_tokens",
)


def cost_sheet(finals: Sequence[RequestOutput]) -> dict[str, Any]:
    """The `metrics` object for a response built from the final outputs of its engine requests. With
    several prompts the counts are summed, the times are the slowest prompt's, and `prompts` lists
    each prompt's own sheet."""
    sheets = [_sheet(out) for out in finals]
    if len(sheets) == 1:
        return sheets[0]
    slowest = max(sheets, key=lambda s: s.get("e2e_latency") or 0.0)
    merged = dict(slowest)
    for key in _SUMMED:
        if key in slowest:
            merged[key] = sum(s.get(key, 0) for s in sheets)
    merged["prompts"] = sheets
    return merged
