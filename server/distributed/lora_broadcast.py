"""A runtime LoRA load or unload sent to every replica (no Ray here, so it is tested without it):
answered 200 only when every replica did it. A load that some replica refused is unloaded again from
the replicas that took it, so no replica serves an adapter the others lack, and the answer names the
replica that refused and why; an unload is done when no replica serves the name any more."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from server.distributed.asgi_call import ForwardRequest
from server.errors import APIError, service_unavailable

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LORA_UPDATE_PATHS = (LOAD_PATH, UNLOAD_PATH)


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


# Sends one request to one replica (by id) and returns its whole answer; raising counts as a failure.
Send = Callable[[str, ForwardRequest], Awaitable[ReplicaAnswer]]


async def _ask(send: Send, replica_id: str, request: ForwardRequest) -> ReplicaAnswer:
    try:
        return await send(replica_id, request)
    except Exception as e:  # noqa: BLE001 - an unreachable replica is one failed answer
        body = APIError(f"replica unreachable ({type(e).__name__}: {e})", status=503).body()
        return ReplicaAnswer(replica_id, 503, json.dumps(body).encode())


def _lora_name(request: ForwardRequest) -> str | None:
    try:
        name = json.loads(request.body).get("lora_name")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


async def broadcast_lora_update(
    request: ForwardRequest, replica_ids: Sequence[str], send: Send
) -> ReplicaAnswer:
    """Send a load or unload to every replica and merge their answers into one (replica_id "")."""
    if not replica_ids:
        err = service_unavailable("No kvserve replica is running; retry when one is.")
        return ReplicaAnswer("", err.status, json.dumps(err.body()).encode())
    answers = await asyncio.gather(*(_ask(send, r, request) for r in replica_ids))
    ok = [a for a in answers if a.ok]
    failed = [a for a in answers if not a.ok]
    if not failed:
        return replace(ok[0], replica_id="")
    if request.path == UNLOAD_PATH:
        return _merge_unload(ok, failed)
    if not ok:  # every replica refused: nothing changed anywhere, their (first) answer says why
        return replace(failed[0], replica_id="")
    return await _roll_back_load(request, ok, failed, send)


def _merge_unload(ok: list[ReplicaAnswer], failed: list[ReplicaAnswer]) -> ReplicaAnswer:
    """A replica without the adapter (404) agrees with one that unloaded it; any other failure is
    reported with the replicas it happened on."""
    if ok and all(a.status == 404 for a in failed):
        return replace(ok[0], replica_id="")
    if not ok and len({a.status for a in failed}) == 1:
        return replace(failed[0], replica_id="")
    return _failure(failed, f"unloaded on {_ids(ok)}" if ok else "unloaded on no replica")


async def _roll_back_load(
    request: ForwardRequest, ok: list[ReplicaAnswer], failed: list[ReplicaAnswer], send: Send
) -> ReplicaAnswer:
    name = _lora_name(request)
    undo = replace(
        request, path=UNLOAD_PATH, body=json.dumps({"lora_name": name}).encode(), routing_text=""
    )
    undone = await asyncio.gather(*(_ask(send, a.replica_id, undo) for a in ok))
    stuck = [a for a in undone if not a.ok and a.status != 404]
    note = f"it was unloaded again from {_ids(ok)}, so no replica serves it"
    if stuck:
        note = f"unloading it again failed on {_ids(stuck)} ({stuck[0].error()[0]}): those replicas serve it"
    return _failure(failed, note)


def _failure(failed: list[ReplicaAnswer], note: str) -> ReplicaAnswer:
    message, param = failed[0].error()
    status = failed[0].status
    err = APIError(
        f"replica {failed[0].replica_id} refused: {message} ({len(failed)} of the replicas "
        f"failed: {_ids(failed)}; {note})",
        status=status,
        type="invalid_request_error" if status < 500 else "server_error",
        param=param,
        code=None,
    )
    return ReplicaAnswer("", status, json.dumps(err.body()).encode())


def _ids(answers: Sequence[ReplicaAnswer]) -> str:
    return ", ".join(a.replica_id for a in answers)
