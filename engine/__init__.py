"""kvserve engine: paged KV cache, chunked prefill and continuous batching on a torch model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.config import (
    DTYPES,
    POOLINGS,
    TASKS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from engine.core.engine_client import EngineClient
from engine.core.errors import (
    ContextLengthError,
    InvalidRequestError,
    PromptError,
    SamplingParamsError,
)
from engine.core.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EngineDeadError,
    QueueFullError,
    RequestError,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.core.sampling_params import OutputKind, SamplingParams, StructuredOutputs
from engine.core.scoring import NORMALIZATIONS, ChoiceScore, ScoreResult, summarize_scores
from engine.core.snapshot import (
    BlockHolders,
    EngineHealth,
    EngineSnapshot,
    RequestProgress,
    SnapshotDetail,
    StepRecord,
)
from engine.embeddings.prompts import EmbeddingPrompts
from engine.text.schema_regex import ecma_pattern_error
from engine.text.score_inputs import ScoreInputs, build_score_inputs
from engine.text.tool_parsers import TOOL_PARSERS, ToolCallStreamer, ToolParser
from engine.text.tool_use import ToolPlan, plan_tool_use, render_messages

if TYPE_CHECKING:  # the lazy exports, spelled out for type checkers
    from engine.async_engine import AsyncLLMEngine
    from engine.core.stats import FinishedRequestStats, StepStats
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.models.loader import resolve_model
    from engine.text.tokenizer import Tokenizer

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLMEngine": "engine.async_engine",
    "StepStats": "engine.core.stats",
    "FinishedRequestStats": "engine.core.stats",
    "Tokenizer": "engine.text.tokenizer",
    "resolve_model": "engine.models.loader",
}


def __getattr__(name: str) -> object:
    """Import the torch-heavy parts on first use, so config and protocol types stay cheap to import."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "DTYPES",
    "NORMALIZATIONS",
    "POOLINGS",
    "TASKS",
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "BlockHolders",
    "ContextLengthError",
    "EngineClient",
    "EngineHealth",
    "EngineSnapshot",
    "InvalidRequestError",
    "PromptError",
    "RequestProgress",
    "SnapshotDetail",
    "StepRecord",
    "StepStats",
    "FinishedRequestStats",
    "Tokenizer",
    "CacheConfig",
    "ChoiceScore",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingPrompts",
    "EngineConfig",
    "EngineDeadError",
    "ModelConfig",
    "OutputKind",
    "QueueFullError",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SamplingParamsError",
    "SchedulerConfig",
    "StructuredOutputs",
    "TOOL_PARSERS",
    "ScoreInputs",
    "ScoreResult",
    "TokenLogprob",
    "build_score_inputs",
    "ecma_pattern_error",
    "resolve_model",
    "ToolCallStreamer",
    "ToolParser",
    "ToolPlan",
    "plan_tool_use",
    "render_messages",
    "summarize_scores",
]
