"""What the async front drives (no torch): a synchronous core that takes adds and aborts between
steps and publishes an EngineSnapshot at the end of each step. LLMEngine (generation) and
EmbeddingEngine implement it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.core.config import EngineConfig
from engine.core.outputs import EmbeddingOutput, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.snapshot import EngineSnapshot
from engine.core.stats import StepStats

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer


class EngineCore(Protocol):
    config: EngineConfig
    model_name: str
    task: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    last_step: StepStats | None
    # Replaced whole (one attribute store) at the end of each step and after adds/aborts, so a
    # reader on another thread always sees one consistent snapshot.
    snapshot: EngineSnapshot

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> Sequence[RequestOutput | EmbeddingOutput]: ...
    def build_snapshot(self, detail: bool = False) -> EngineSnapshot:
        """The current state; call it only from the thread that steps (or between steps)."""
        ...
