"""A runtime LoRA load or unload sent to every replica (no Ray here, so it is tested without it):
answered 200 only when every replica did it. A load that some replica refused is unloaded again from
the replicas that took it, so no replica serves an adapter the others lack, and the answer names the
replica that refused and why; an unload is done when no replica serves the name any more."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace

from server.distributed.asgi_call import ForwardRequest
from server.distributed.replica_broadcast import (
    ReplicaAnswer,
    Send,
    ask,
    ask_every,
    failure,
    ids,
    no_replica,
)

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
LORA_UPDATE_PATHS = (LOAD_PATH, UNLOAD_PATH)


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
        return no_replica()
    ok, failed = await ask_every(send, replica_ids, request)
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
    return failure(failed, f"unloaded on {ids(ok)}" if ok else "unloaded on no replica")


async def _roll_back_load(
    request: ForwardRequest, ok: list[ReplicaAnswer], failed: list[ReplicaAnswer], send: Send
) -> ReplicaAnswer:
    name = _lora_name(request)
    undo = replace(
        request, path=UNLOAD_PATH, body=json.dumps({"lora_name": name}).encode(), routing_text=""
    )
    undone = await asyncio.gather(*(ask(send, a.replica_id, undo) for a in ok))
    stuck = [a for a in undone if not a.ok and a.status != 404]
    note = f"it was unloaded again from {ids(ok)}, so no replica serves it"
    if stuck:
        note = f"unloading it again failed on {ids(stuck)} ({stuck[0].error()[0]}): those replicas serve it"
    return failure(failed, note)
