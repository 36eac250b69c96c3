"""The bounded in-memory store of Responses API responses (`store: true`), for `previous_response_id` and
`GET`/`DELETE /v1/responses/{id}`.

Each entry holds the response object and the whole conversation that led to it (turn messages, with the
response's output as the last assistant turn, without its `instructions`), so an entry never depends on
another one. At most `capacity` entries are kept; storing one more evicts the least recently used (a
retrieve or a continuation counts as a use). Entries live in this process only: a restart forgets them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.turn_request import TurnMessage


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as served
    conversation: list[TurnMessage]  # history, this input, this output


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("the response store size must not be negative")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            self._entries[entry.response["id"]] = entry
            self._entries.move_to_end(entry.response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None
