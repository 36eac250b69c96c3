"""Every error the engine raises to its callers (no torch). A request's own fault is an
InvalidRequestError with structured fields (`param` in the engine's names, limits) that a front end
words for its API; the others say the engine cannot take or finish the request. Any other exception
from the engine is a bug."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is wrong (a bad value, the wrong kind of request for this model); `param`
    names the field at fault in the engine's terms (a SamplingParams field, "prompt", "choices"), or
    is None when no single field is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)
        self.param: str = param


class ConstraintError(SamplingParamsError):
    """The constrained decoder cannot follow a constraint (it gave up mid-generation: a limit of the
    matcher); `param` is the constraint's `source`, `reason` the decoder's own words."""

    def __init__(self, reason: str, param: str) -> None:
        super().__init__(f"the constrained decoder cannot follow {param}: {reason}", param)
        self.reason = reason


class WrongTaskError(InvalidRequestError):
    """The request needs a kind of model (`needed`: "generate" or "embed") that this engine does not
    serve (`served`)."""

    def __init__(self, served: str, needed: str) -> None:
        what = {"generate": "a generative model", "embed": "an embedding model"}
        super().__init__(
            f"this engine runs {what.get(served, served)}: the request needs {what.get(needed, needed)}"
        )
        self.served = served
        self.needed = needed


class PromptError(InvalidRequestError):
    """The prompt (or embedding input) tokens are wrong: empty, or outside the vocabulary. `param` is the
    engine's name for the input; an API names its own field (prompt, messages, input) instead."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param)


class ContextLengthError(PromptError):
    """Prompt plus completion exceed the model's maximum length, or the KV cache pool (`kv_pool`):
    `needed` tokens, of which the model or the pool holds `limit`."""

    code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        param: str = "prompt",
        *,
        limit: int | None = None,
        needed: int | None = None,
        kv_pool: bool = False,
    ) -> None:
        super().__init__(message, param)
        self.limit = limit
        self.needed = needed
        self.kv_pool = kv_pool


class LoRAError(InvalidRequestError):
    """A LoRA adapter cannot be served: not a PEFT LoRA folder, a rank above the maximum, target
    modules the model lacks, a dtype mismatch, a corrupt weights file, or a name already loaded.
    `param` is "lora_path" (the folder is at fault) or "lora_name"."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message, param)
        self.param: str = param


class LoRANotFoundError(InvalidRequestError):
    """A request or an unload names an adapter (`name`) that is not served; `served` lists those that
    are."""

    def __init__(self, name: str, served: tuple[str, ...]) -> None:
        listed = ", ".join(served) if served else "none"
        super().__init__(f"LoRA adapter {name!r} is not loaded (served adapters: {listed})", "lora")
        self.name = name
        self.served = served


class StartupError(ValueError):
    """A part of the engine other than the model itself cannot start (the KV events socket, the
    speculative draft model, the KV offload tiers); the message names the part."""


class EngineDeadError(RuntimeError):
    """The engine loop died; no further requests can be served."""


class ShuttingDownError(RuntimeError):
    """The server ended this request while shutting down (its drain time ran out, or a second
    signal cut the drain short)."""


class QueueFullError(RuntimeError):
    """Admission control refused the request; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestError(RuntimeError):
    """One request failed inside the engine (others keep running)."""
