"""PrefixAffinityRouter: a Ray Serve request router (the public `ray.serve.request_router` API)
that sends a request to the replica whose KV cache holds the longest run of the request's leading
blocks, as the replicas' own KV events say (each replica publishes them, engine.kv_event_publisher;
the router follows them, server.distributed.kv_feed), unless that replica is busier than the least
loaded one by more than `imbalance_threshold` requests. Until a replica's events show a prefix
(its first request is still prefilling), and for requests the ingress could not tokenize, the
text of recently routed prompts stands in; a request nobody holds goes to the less loaded of two
random replicas (power-of-two choices) on the router's own in-flight counts. Both hash under the
request's cache salt (vLLM's `cache_salt`), as the engine does: salted blocks draw only that salt.
A LoRA adapter's requests match the blocks the replicas' events stored under that adapter."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from server.distributed.kv_feed import KVEventFeed
from server.distributed.kv_index import KVIndex, ReplicaEvents, kv_matches, route
from server.distributed.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes

logger = logging.getLogger(__name__)
REFRESH_S = (
    2.0  # how often the replica directory is read again while a replica's events are unknown
)


def _routing_text(pending_request: PendingRequest | None) -> str:
    if pending_request is None or not pending_request.args:
        return ""
    text = getattr(pending_request.args[0], "routing_text", "")
    return text if isinstance(text, str) else ""


def _routing_tokens(pending_request: PendingRequest | None) -> list[int] | None:
    if pending_request is None or not pending_request.args:
        return None
    tokens = getattr(pending_request.args[0], "routing_tokens", None)
    return tokens if isinstance(tokens, list) else None


def _forwarded(pending_request: PendingRequest | None, name: str) -> str | None:
    """A non-empty string field of the forwarded request (its cache salt, its model)."""
    if pending_request is None or not pending_request.args:
        return None
    value = getattr(pending_request.args[0], name, None)
    return value if isinstance(value, str) and value else None


def _cache_salt(pending_request: PendingRequest | None) -> str | None:
    return _forwarded(pending_request, "cache_salt")


def _model(pending_request: PendingRequest | None) -> str | None:
    return _forwarded(pending_request, "model")


def _text_hashes(pending_request: PendingRequest | None, block_chars: int) -> list[bytes]:
    """The routed text's block hashes, under the request's cache salt."""
    text = _routing_text(pending_request)
    return block_hashes(text, block_chars, _cache_salt(pending_request))


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(
        self,
        block_chars: int = BLOCK_CHARS,
        imbalance_threshold: int = 4,
        min_match_ratio: float = 0.1,
        **kwargs: Any,
    ) -> None:
        self.block_chars = block_chars
        self.imbalance_threshold = imbalance_threshold
        self.min_match_ratio = min_match_ratio
        self.index = PrefixIndex()  # the text of recently routed prompts
        self.kv_index = KVIndex()
        self.feed: KVEventFeed | None = None  # started with the first tokenized request
        self._refreshed = 0.0
        self.in_flight: dict[ReplicaID, int] = {}
        self.request_replica: dict[str, ReplicaID] = {}

    def _load(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        own = self.in_flight.get(replica.replica_id, 0)
        return max(own, cached) if cached is not None else own

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self.index.retain(self._replicas.keys())
        loads: dict[Hashable, int] = {r.replica_id: self._load(r) for r in candidate_replicas}
        matches: dict[Hashable, int] = {}
        total = 0
        tokens = _routing_tokens(pending_request)
        if tokens:
            by_unique = await self._kv_matches(
                candidate_replicas, tokens, _cache_salt(pending_request), _model(pending_request)
            )
            matches = {
                r.replica_id: by_unique[0].get(r.replica_id.unique_id, 0)
                for r in candidate_replicas
            }
            total = by_unique[1]
        if not any(matches.values()):  # nobody's events show it (yet): the routed text guesses
            hashes = _text_hashes(pending_request, self.block_chars)
            matches = {
                r.replica_id: self.index.match(r.replica_id, hashes) for r in candidate_replicas
            }
            total = len(hashes)
        return route(
            candidate_replicas,
            lambda r: r.replica_id,
            loads,
            matches,
            total,
            self.imbalance_threshold,
            self.min_match_ratio,
        )

    async def _kv_matches(
        self,
        candidates: list[RunningReplica],
        tokens: list[int],
        cache_salt: str | None,
        model: str | None,
    ) -> tuple[dict[Hashable, int], int]:
        if self.feed is None:
            self.feed = KVEventFeed(self.kv_index)
        sources = self.feed.sources()
        ids = [r.replica_id.unique_id for r in candidates]
        if any(i not in sources for i in ids) and time.monotonic() - self._refreshed > REFRESH_S:
            self._refreshed = time.monotonic()
            sources = await self._refresh_sources()
        return kv_matches(self.kv_index, sources, ids, tokens, cache_salt, model)

    async def _refresh_sources(self) -> dict[Hashable, ReplicaEvents]:
        """Follow the events of every current replica that registered an events endpoint."""
        from server.distributed.deployments import directory

        assert self.feed is not None
        try:
            known: dict[str, dict[str, Any]] = await asyncio.wait_for(
                directory().list.remote(), timeout=5
            )
        except Exception as e:  # noqa: BLE001 - routing goes on with what it knows
            logger.warning("cannot read the replica directory: %s", e)
            return self.feed.sources()
        current = {r.unique_id for r in self._replicas}
        sources = [
            ReplicaEvents(
                replica_id,
                ev["endpoint"],
                ev.get("replay_endpoint"),
                int(ev["block_size"]),
                str(ev["hash_seed"]),
                str(ev.get("topic", "")),
            )
            for replica_id, info in known.items()
            if replica_id in current and (ev := info.get("kv_events"))
        ]
        self.feed.set_replicas(sources)
        return self.feed.sources()

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hashes = _text_hashes(pending_request, self.block_chars)
        if hashes:
            self.index.insert(replica_id, hashes)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.request_replica[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.request_replica.pop(internal_request_id, None) is None:
            return
        self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)
