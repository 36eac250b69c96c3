"""What the async front drives (no torch): a synchronous core that takes adds (generation, scoring)
and aborts between steps, compiles constraints off the step thread, and publishes an EngineSnapshot
at the end of each step and whenever the front asks. LLMEngine (generation) and EmbeddingEngine
implement it; a request the core's task cannot serve is a WrongTaskError."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from engine.core.config import EngineConfig, Task
from engine.core.lora import LoRAInfo
from engine.core.outputs import EmbeddingOutput, RequestOutput
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.core.snapshot import EngineSnapshot
from engine.core.stats import StepStats

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer


class EngineCore(Protocol):
    config: EngineConfig
    model_name: str
    task: Task
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    last_step: StepStats | None
    # Written only by the core itself (publish(), step()), replaced whole (one attribute store), so
    # a reader on another thread always sees one consistent snapshot.
    snapshot: EngineSnapshot

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> None: ...
    def add_score_request(
        self,
        request_id: str,
        context_token_ids: list[int],
        choices: list[list[int]],
        num_top_logprobs: int = 0,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> None: ...
    def compile_constraint(self, constraint: StructuredOutputs) -> None:
        """Compile (and cache) a constraint; blocking, safe off the step thread."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    # LoRA adapters: read_lora reads and checks the files (blocking, safe off the step thread, serves
    # nothing); install_lora serves what it read and unload_lora stops serving a name (both between
    # steps). LoRAError / LoRANotFoundError say what is wrong.
    def loras(self) -> tuple[LoRAInfo, ...]: ...
    def read_lora(self, name: str, path: str) -> Any: ...
    def install_lora(self, adapter: Any) -> LoRAInfo: ...
    def unload_lora(self, name: str) -> None: ...
    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (between steps); False while requests hold blocks."""
        ...

    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> Sequence[RequestOutput | EmbeddingOutput]: ...
    def publish(self, detail: bool = False) -> EngineSnapshot:
        """Build the current state and publish it as `snapshot`; call it only from the thread that
        steps (or between steps)."""
        ...
