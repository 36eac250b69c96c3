"""The work the event loop hands the engine core between steps (no torch): adds and aborts as small
typed records, queued in arrival order with running counts, so admitting a request costs O(1)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None for an embedding input
    prompt: str | None  # the text, when the caller gave text
    arrival_time: float  # time.monotonic() when the caller submitted it
    # A score request: the continuations of the prompt to score (None: generation or embedding).
    choices: list[list[int]] | None = None
    num_top_logprobs: int = 0
    lora: str | None = None  # the LoRA adapter's name (None: the base model)
    cache_salt: str | None = None  # shares prefix-cache blocks only with requests of this salt

    @property
    def num_tokens(self) -> int:
        """Input tokens: the prompt, plus every choice of a score request."""
        return len(self.prompt_token_ids) + sum(len(c) for c in self.choices or [])


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


PendingItem = AddRequest | AbortRequest


class PendingWork:
    """Adds and aborts waiting for the next step, with the counts admission control needs."""

    def __init__(self) -> None:
        self._items: list[PendingItem] = []
        self.num_adds = 0
        self.num_add_tokens = 0

    def add(self, item: AddRequest) -> None:
        self._items.append(item)
        self.num_adds += 1
        self.num_add_tokens += item.num_tokens

    def abort(self, request_id: str) -> None:
        self._items.append(AbortRequest(request_id))

    def take(self) -> list[PendingItem]:
        """Everything queued so far, in order; the queue starts again empty."""
        items, self._items = self._items, []
        self.num_adds = self.num_add_tokens = 0
        return items

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)
