"""Frozen engine configuration: built once (by the CLI or `LLM(...)`) and passed down explicitly."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.core.kv_events import KVEventsConfig
from engine.core.lora import LoRAConfig
from engine.core.spec_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
Task = Literal["generate", "embed"]  # what a built engine does
TASKS: tuple[Task, ...] = ("generate", "embed")
POOLINGS = ("auto", "mean", "cls", "last")
QUANTIZATIONS = ("auto", "int8", "int4", "gguf")  # and "none" (stored as None)
# auto: on CPU under block-quantized weights bfloat16 where the hardware bf16 attention runs, else
# float16 (half the bytes a long context's attention reads); otherwise the model's dtype
# (engine.kernels.kv_dtype)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ModelConfig:
    # A local HF folder, a .gguf file, a hub id already in the local HF cache, or None (bundled default).
    model: str | None = None
    # auto -> bfloat16 on CUDA; on CPU float32 (the int8 kernels' activations), or a bf16
    # checkpoint's bfloat16 where the CPU has native bf16 and no int8 format is chosen
    dtype: str = "auto"
    device: str = "auto"  # auto -> cuda when available, else cpu
    max_model_len: int | None = None  # None -> the model's own maximum
    task: str = "auto"  # auto | generate | embed
    pooling: str = "auto"  # for embedding models: auto | mean | cls | last
    chat_template: str | None = None  # a file path or an inline Jinja template
    cache_dir: str | None = None  # conversion cache for .gguf models; None -> ~/.cache/kvserve
    seed: int = 0  # torch.manual_seed once at start-up; a request seeds its own samples
    # auto: a .gguf file's own blocks (gguf) or int8 blocks on x86 CPUs with AVX2, else none |
    # none (None) | int8 (Q8_0 blocks) | int4 (Q4_1 blocks) | gguf (a .gguf file's stored blocks)
    quantization: str | None = "auto"
    compile: bool = False  # torch.compile the dense part of each layer (slow start-up)
    num_threads: int | None = None  # torch intra-op threads; None -> torch's default
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (CUDA only)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.task not in ("auto", *TASKS):
            raise ValueError(f"task must be auto, generate or embed; got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {self.pooling!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be a positive integer")
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be auto, none, int8, int4 or gguf; got {self.quantization!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be at least 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # explicit pool size; wins over kv_cache_memory
    kv_cache_memory: int | None = (
        None  # bytes for K+V of all layers; None -> a default for the device
    )
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # KV offload tiers of evicted prefix blocks (engine.core.kv_offload): host-memory bytes (None or
    # 0: no host tier), a directory for the disk tier (None: none) and its bytes (None: 10 GiB).
    kv_offload_memory: int | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}"
            )
        for name in ("kv_offload_memory", "kv_offload_disk"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be a size of at least 0 bytes")
        if self.kv_offload_disk is not None and self.kv_offload_dir is None:
            raise ValueError(
                "--kv-offload-disk sizes a disk tier, which needs --kv-offload-dir (a directory)"
            )
        if (self.kv_offload_memory or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise ValueError(
                "KV offload tiers keep evicted prefix blocks: they need prefix caching"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")


QUEUED_TOKENS_PER_BATCH = 32  # default max_queued_tokens = this x max_num_batched_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # token budget per step (decode + prefill chunks)
    max_queued_requests: int = 256  # waiting requests beyond which admission fails
    # Waiting prompt tokens beyond which admission fails; None -> QUEUED_TOKENS_PER_BATCH steps' worth.
    max_queued_tokens: int | None = None
    # CPU: the step time the prefill budget aims at while streams decode (engine.core.step_budget);
    # 0: off, max_num_batched_tokens every step; None (auto): AUTO_TARGET_STEP_MS on CPU under the
    # chunk-invariant block formats, else off (resolve_target_step_ms). GPUs run the fixed budget.
    target_step_ms: float | None = None

    def __post_init__(self) -> None:
        if self.target_step_ms is not None and self.target_step_ms < 0:
            raise ValueError("target_step_ms must be >= 0 (0: a fixed token budget)")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be at least 1")
        if self.max_queued_tokens is None:
            # Bounded by default: the queue holds about as much prefill as 32 full engine steps.
            limit = QUEUED_TOKENS_PER_BATCH * self.max_num_batched_tokens
            object.__setattr__(self, "max_queued_tokens", limit)
        elif self.max_queued_tokens < 1:
            raise ValueError("max_queued_tokens must be at least 1")


# from_options keys (vLLM's flag names) -> LoRAConfig fields
_LORA_OPTIONS = {
    "lora_modules": "modules",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    log_stats_interval: float = 5.0  # seconds between INFO stats lines while busy (0 disables)
    # Speculative decoding (None: off). Given as vLLM's JSON text or a dict, parsed here.
    speculative_config: SpeculativeConfig | None = None
    # KV cache events for external routers (None: off). vLLM's JSON text or a dict, parsed here.
    kv_events_config: KVEventsConfig | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapters (engine/core/lora.py)

    def __post_init__(self) -> None:
        parsed = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", parsed)
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))

    @classmethod
    def from_options(cls, model: str | None = None, **options: object) -> EngineConfig:
        """Build from flat keyword options (`LLM(model, dtype=..., max_num_seqs=...)`)."""
        # Values are checked by each dataclass's __post_init__, not by the type checker.
        groups: dict[type, dict[str, Any]] = {
            ModelConfig: {},
            CacheConfig: {},
            SchedulerConfig: {},
        }
        top: dict[str, Any] = {}
        lora: dict[str, Any] = {}
        for key, value in options.items():
            if key in _LORA_OPTIONS:
                lora[_LORA_OPTIONS[key]] = value
                continue
            for group_cls, bucket in groups.items():
                if key in {f.name for f in dataclasses.fields(group_cls)}:
                    bucket[key] = value
                    break
            else:
                if key in {f.name for f in dataclasses.fields(cls)}:
                    top[key] = value
                else:
                    raise ValueError(f"unknown engine option {key!r}")
        return cls(
            model=ModelConfig(model=model, **groups[ModelConfig]),
            cache=CacheConfig(**groups[CacheConfig]),
            scheduler=SchedulerConfig(**groups[SchedulerConfig]),
            lora=top.pop("lora") if "lora" in top and not lora else LoRAConfig(**lora),
            **top,
        )


BUNDLED_MODEL_ID = "SmolLM2-135M-Instruct"
BUNDLED_EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"


def served_model_name(model: str | None) -> str:
    """The name clients use: the bundled model's, a hub id, or the folder / file stem."""
    if model is None:
        return BUNDLED_MODEL_ID
    if "/" in model and not Path(model).expanduser().exists():
        return model  # a hub id
    return Path(model).expanduser().name.removesuffix(".gguf")


def model_id(config: EngineConfig) -> str:
    """The id the engine serves its model under, known before the model loads."""
    mc = config.model
    if mc.model is None and mc.task == "embed":
        return BUNDLED_EMBEDDING_MODEL_ID
    return served_model_name(mc.model)
