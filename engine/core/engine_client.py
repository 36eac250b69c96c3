"""The one typed boundary between an API front end (server/) and the engine (no torch): requests in,
outputs out, the served model's facts, health, and immutable state snapshots. AsyncLLMEngine implements
it for a generative or an embedding core; the server holds nothing of the engine but this protocol."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Protocol

from engine.core.lora import LoRAInfo
from engine.core.outputs import EmbeddingOutput, RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.snapshot import EngineHealth, EngineSnapshot
from engine.core.stats import StepStats

if TYPE_CHECKING:
    from engine.embeddings.prompts import EmbeddingPrompts
    from engine.text.tokenizer import Tokenizer


class EngineClient(Protocol):
    # -- the served model's facts ----------------------------------------------------------------
    @property
    def model_name(self) -> str: ...
    @property
    def task(self) -> str:
        """ "generate" or "embed": which requests this engine serves."""
        ...

    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def embedding_prompts(self) -> EmbeddingPrompts:
        """An embedding model's named instruction prompts (none for a generative model)."""
        ...

    @property
    def max_queued_requests(self) -> int:
        """A request batch (prompts or inputs) larger than this can never be admitted."""
        ...

    @property
    def max_queued_tokens(self) -> int | None:
        """The prompt tokens the queue holds at most (None: unbounded)."""
        ...

    # -- requests ----------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int:
        """Check a request against the model before submitting it: InvalidRequestError subclasses
        (PromptError, ContextLengthError, SamplingParamsError) name the fault. Returns the resolved
        max output tokens (0 for an embedding input)."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as the engine produces them; closing the iterator aborts it.
        `lora` names the LoRA adapter to run on (LoRANotFoundError when it is not served);
        `cache_salt` (vLLM's field) keeps its prefix-cache blocks to requests of the same salt."""
        ...

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], lora: str | None = None
    ) -> EmbeddingOutput: ...
    async def score(
        self,
        request_id: str,
        context_token_ids: list[int],
        choices: list[list[int]],
        num_top_logprobs: int = 0,
        prompt: str | None = None,
        lora: str | None = None,
    ) -> RequestOutput:
        """Every choice scored as the continuation of the context (one CompletionOutput each, with
        its tokens' logprobs); InvalidRequestError for bad input or an embedding engine."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error` (their engine work aborted), e.g. when the
        server's shutdown drain time runs out; returns how many were ended."""
        ...

    # -- LoRA adapters -----------------------------------------------------------------------------
    def loras(self) -> tuple[LoRAInfo, ...]:
        """The adapters served now."""
        ...

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Read and check a PEFT folder off the step thread, then serve it from the next step on
        (LoRAError: nothing served changes)."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Stop serving `name` (LoRANotFoundError if absent): new requests naming it fail, running
        ones finish on the weights they started with."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (vLLM's reset_prefix_cache); False, and nothing dropped,
        while running requests hold blocks."""
        ...

    # -- health and state --------------------------------------------------------------------------
    def health(self) -> EngineHealth: ...
    def snapshot(self) -> EngineSnapshot:
        """The state published after the latest step (cheap; safe from any thread)."""
        ...

    async def detailed_snapshot(self) -> EngineSnapshot:
        """A snapshot that also carries the per-block detail, built between steps."""
        ...

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call `listener` with every step's stats (on the event loop; once per listener)."""
        ...

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
