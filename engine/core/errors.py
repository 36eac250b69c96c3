"""The request errors a caller can act on (no torch): each names the request field at fault, and the
server maps them to its 400 envelope by type. Any other exception from the engine is a bug (a 500)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is wrong (a bad value, the wrong kind of request for this model); `param`
    names the field at fault, or is None when no single field is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; `param` names it as the API spells it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param)
        self.param: str = param


class PromptError(InvalidRequestError):
    """The prompt (or embedding input) tokens are wrong: empty, or outside the vocabulary. `param` is the
    engine's name for the input; an API names its own field (prompt, messages, input) instead."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message, param)


class ContextLengthError(PromptError):
    """Prompt plus completion exceed the model's maximum length (or the KV pool)."""

    code = "context_length_exceeded"
