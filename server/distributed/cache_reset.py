"""POST /reset_prefix_cache on Ray Serve: sent to every replica (each has its own prefix cache), and
answered 200 only when every replica emptied its cache. A refusal every replica gave alike (the route
is off, a bad key, an unsupported option) is that answer; otherwise the first refusal, naming the
replicas that refused and those that did reset (a reset cannot be undone, and a busy replica's 409
says to retry). No Ray here, so it is tested without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from server.distributed.asgi_call import ForwardRequest
from server.distributed.replica_broadcast import (
    ReplicaAnswer,
    Send,
    ask_every,
    failure,
    ids,
    no_replica,
)

RESET_PATH = "/reset_prefix_cache"


async def broadcast_cache_reset(
    request: ForwardRequest, replica_ids: Sequence[str], send: Send
) -> ReplicaAnswer:
    """Send the reset to every replica and merge their answers into one (replica_id "")."""
    if not replica_ids:
        return no_replica()
    ok, failed = await ask_every(send, replica_ids, request)
    if not failed:
        return replace(ok[0], replica_id="")
    if not ok and len({a.status for a in failed}) == 1:
        return replace(failed[0], replica_id="")
    return failure(failed, f"reset on {ids(ok)}" if ok else "reset on no replica")
