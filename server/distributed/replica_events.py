"""A Ray replica's KV events: each replica publishes on ports of its own (any free ones, as N
replicas may share a node) under the topic `kv@<replica id>@<model>` (llm-d's convention), and
registers where, so the router (and any other consumer) can follow it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine import KVEventsConfig, KVEventsState

ANY_PORT = "tcp://*:*"


def with_replica_events(values: Mapping[str, Any], replica_id: str) -> dict[str, Any]:
    """`values` with KV events on for this replica when the prefix router reads them or the
    user asked for events (their settings kept, the ports made the replica's own)."""
    out = dict(values)
    given: KVEventsConfig | None = KVEventsConfig.parse(values.get("kv_events_config"))
    if values.get("request_router", "prefix") != "prefix" and not (given and given.enabled):
        return out
    model = values.get("served_model_name") or values.get("model") or "kvserve"
    base = given if given is not None else KVEventsConfig()
    out["kv_events_config"] = dataclasses.replace(
        base,
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=ANY_PORT,
        replay_endpoint=ANY_PORT,
        topic=base.topic or f"kv@{replica_id}@{model}",
    )
    return out


def events_info(state: KVEventsState | None, node_ip: str) -> dict[str, Any] | None:
    """What the replica directory lists: endpoints reachable from other nodes."""
    if state is None:
        return None

    def reachable(endpoint: str | None) -> str | None:
        return None if endpoint is None else endpoint.replace("0.0.0.0", node_ip)

    return {
        "endpoint": reachable(state.endpoint),
        "replay_endpoint": reachable(state.replay_endpoint),
        "topic": state.topic,
        "block_size": state.block_size,
        "hash_seed": state.hash_seed,
    }
