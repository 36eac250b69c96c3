"""Server-side settings and the live state the routes share: the engine (once loaded), draining, in-flight."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine import EngineClient
from engine.text import ReasoningParser, get_reasoning_parser
from server.errors import service_unavailable
from server.models_registry import ServedModel, resolve_model
from server.response_store import ResponseStore

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    tool_call_parser: str = "auto"  # auto: from the chat template (see engine.text.tool_parsers)
    reasoning_parser: str = "auto"  # auto: from the chat template (see engine.text.reasoning)
    # Variables for every chat template render (a request's chat_template_kwargs override them).
    chat_template_kwargs: Mapping[str, Any] | None = None
    max_score_choices: int = 64  # choices one /v1/score request may hold
    responses_store_size: int = 1024
    engine_page: bool = True  # serve the live /engine page and its snapshot stream
    enable_lora: bool = False  # vLLM's --enable-lora, accepted: adapters are always available
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (None: on exactly when api_key is set).
    allow_runtime_lora_updating: bool | None = None
    # vLLM's VLLM_SERVER_DEV_MODE: POST /reset_prefix_cache without an API key.
    server_dev_mode: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.max_score_choices < 1:
            raise ValueError("max_score_choices must be at least 1")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must not be negative")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must not be negative")
        if self.chat_template_kwargs is not None and not isinstance(
            self.chat_template_kwargs, Mapping
        ):
            raise ValueError("chat_template_kwargs must be a JSON object of template variables")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty; leave it unset to disable authentication")

    @property
    def runtime_lora_updating(self) -> bool:
        """Whether adapters may be loaded and unloaded at run time."""
        if self.allow_runtime_lora_updating is not None:
            return self.allow_runtime_lora_updating
        return self.api_key is not None

    @property
    def dev_routes(self) -> bool:
        """Whether POST /reset_prefix_cache is served: in dev mode, or behind an API key."""
        return self.server_dev_mode or self.api_key is not None


class ServerState:
    """What every route needs; `engine` is None until the model has loaded. The engine is reached only
    through the EngineClient protocol."""

    def __init__(self, config: ServerConfig, engine: EngineClient | None = None) -> None:
        self.config = config
        self.engine: EngineClient | None = engine
        self.draining = False
        self.in_flight = 0
        self.created = int(time.time())
        self.responses = ResponseStore(config.responses_store_size)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.health().ready

    def require_engine(self) -> EngineClient:
        if self.draining:
            raise service_unavailable("The server is shutting down.")
        if self.engine is None:
            raise service_unavailable(
                "The model is still loading; retry when GET /health answers 200."
            )
        health = self.engine.health()
        if health.state == "dead":
            raise service_unavailable(f"The engine is not running: {health.error}")
        return self.engine

    def reasoning_parser(self, chat_template: str | None) -> ReasoningParser | None:
        """The configured reasoning parser for this chat template (None: reasoning not parsed)."""
        return get_reasoning_parser(self.config.reasoning_parser, chat_template)

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.engine.model_name if self.engine is not None else "kvserve"

    def resolve_model(self, requested: str | None) -> ServedModel:
        """What a request's `model` runs on: the base model (its id, or None) or a LoRA adapter
        (its name, or "<base>:<name>"); an unknown name is a 404 listing what is served."""
        return resolve_model(requested, self.model_name, self.engine)

    def check_model(self, requested: str | None) -> str:
        """The served name for a request's `model` (None means the base model)."""
        return self.resolve_model(requested).name
