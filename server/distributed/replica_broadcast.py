"""One request sent to every replica's own port and its answers (no Ray here, so it is tested without
it): a replica's answer, the sender a deployment supplies, and the merged error of the replicas that
refused. The LoRA updates (lora_broadcast) and the prefix-cache reset (cache_reset) build on it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from server.distributed.asgi_call import ForwardRequest
from server.errors import APIError, service_unavailable


@dataclass(frozen=True)
class ReplicaAnswer:
    replica_id: str
    status: int
    body: bytes
    content_type: str = "application/json"

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def error(self) -> tuple[str, str | None]:
        """(message, param) of the replica's error envelope (its body text when not one)."""
        try:
            error = json.loads(self.body)["error"]
            return str(error["message"]), error.get("param")
        except (ValueError, KeyError, TypeError):
            return self.body.decode(errors="replace") or f"HTTP {self.status}", None

    def error_code(self) -> str | None:
        """The `code` of the replica's error envelope (None when it has none)."""
        try:
            code = json.loads(self.body)["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return code if isinstance(code, str) else None


# Sends one request to one replica (by id) and returns its whole answer; raising counts as a failure.
Send = Callable[[str, ForwardRequest], Awaitable[ReplicaAnswer]]


async def ask(send: Send, replica_id: str, request: ForwardRequest) -> ReplicaAnswer:
    try:
        return await send(replica_id, request)
    except Exception as e:  # noqa: BLE001 - an unreachable replica is one failed answer
        body = APIError(f"replica unreachable ({type(e).__name__}: {e})", status=503).body()
        return ReplicaAnswer(replica_id, 503, json.dumps(body).encode())


async def ask_every(
    send: Send, replica_ids: Sequence[str], request: ForwardRequest
) -> tuple[list[ReplicaAnswer], list[ReplicaAnswer]]:
    """Every replica's answer to `request`, at once, split into (ok, failed)."""
    answers = await asyncio.gather(*(ask(send, r, request) for r in replica_ids))
    return [a for a in answers if a.ok], [a for a in answers if not a.ok]


def no_replica() -> ReplicaAnswer:
    err = service_unavailable("No kvserve replica is running; retry when one is.")
    return ReplicaAnswer("", err.status, json.dumps(err.body()).encode())


def failure(failed: list[ReplicaAnswer], note: str) -> ReplicaAnswer:
    """The first refusal's status, words and code, naming every replica that failed, then `note`."""
    message, param = failed[0].error()
    status = failed[0].status
    err = APIError(
        f"replica {failed[0].replica_id} refused: {message} ({len(failed)} of the replicas "
        f"failed: {ids(failed)}; {note})",
        status=status,
        type="invalid_request_error" if status < 500 else "server_error",
        param=param,
        code=failed[0].error_code(),
    )
    return ReplicaAnswer("", status, json.dumps(err.body()).encode())


def ids(answers: Sequence[ReplicaAnswer]) -> str:
    return ", ".join(a.replica_id for a in answers)
