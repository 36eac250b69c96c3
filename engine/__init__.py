"""kvserve engine: paged KV cache, chunked prefill and continuous batching on a torch model runner."""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EngineDeadError,
    QueueFullError,
    RequestError,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "EmbeddingOutput",
    "EngineConfig",
    "EngineDeadError",
    "ModelConfig",
    "QueueFullError",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "SchedulerConfig",
    "TokenLogprob",
]
