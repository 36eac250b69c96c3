"""kvserve engine: paged KV cache, chunked prefill and continuous batching on a torch model runner.

Its face is what an application embedding the engine needs: `LLM` (offline), `AsyncLLMEngine` (the
EngineClient an API front end serves from), configs, sampling params, outputs, errors, snapshots
and stats. Text helpers a front end shares (tool plans, schema checks) are engine.text's face."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.block_hashes import DEFAULT_SEED as BLOCK_HASH_SEED
from engine.core.block_hashes import external_block_hashes
from engine.core.cache_namespace import cache_namespace
from engine.core.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    POOLINGS,
    TASKS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    model_id,
)
from engine.core.engine_client import EngineClient
from engine.core.errors import (
    ConstraintError,
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    LoRAError,
    LoRANotFoundError,
    PromptError,
    QueueFullError,
    RequestError,
    SamplingParamsError,
    ShuttingDownError,
    StartupError,
    WrongTaskError,
)
from engine.core.kv_events import KVEventsConfig, KVEventsState
from engine.core.lora import LoRAConfig, LoRAInfo
from engine.core.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.core.sampling_params import (
    OutputKind,
    ReasoningFormat,
    SamplingParams,
    StructuredOutputs,
)
from engine.core.scoring import NORMALIZATIONS, ChoiceScore, ScoreResult, summarize_scores
from engine.core.snapshot import (
    BlockHolders,
    EngineHealth,
    EngineSnapshot,
    RequestProgress,
    SnapshotDetail,
    StepRecord,
)
from engine.core.spec_config import SpeculativeConfig
from engine.embeddings.prompts import EmbeddingPrompts
from engine.openmp_policy import set_openmp_wait_policy

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
    "KV_CACHE_DTYPES",
    "NORMALIZATIONS",
    "POOLINGS",
    "TASKS",
    "LLM",
    "LLMEngine",
    "AsyncLLMEngine",
    "BlockHolders",
    "ConstraintError",
    "ContextLengthError",
    "EngineClient",
    "EngineHealth",
    "EngineSnapshot",
    "InvalidRequestError",
    "LoRAConfig",
    "LoRAError",
    "LoRAInfo",
    "LoRANotFoundError",
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
    "ShuttingDownError",
    "set_openmp_wait_policy",
    "StartupError",
    "SchedulerConfig",
    "SpeculativeConfig",
    "KVEventsConfig",
    "KVEventsState",
    "BLOCK_HASH_SEED",
    "external_block_hashes",
    "cache_namespace",
    "model_id",
    "StructuredOutputs",
    "WrongTaskError",
    "ReasoningFormat",
    "ScoreResult",
    "TokenLogprob",
    "resolve_model",
    "summarize_scores",
]
