"""PrefixAffinityRouter: a Ray Serve request router (the public `ray.serve.request_router` API)
that sends a request to the replica that already served its longest prompt prefix, unless that
replica is busier than the least loaded one by more than `imbalance_threshold` requests; requests
without a known prefix fall back to power-of-two choices on the router's own in-flight counts."""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from server.distributed.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes

logger = logging.getLogger(__name__)


def _routing_text(pending_request: PendingRequest | None) -> str:
    if pending_request is None or not pending_request.args:
        return ""
    text = getattr(pending_request.args[0], "routing_text", "")
    return text if isinstance(text, str) else ""


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
        self.index = PrefixIndex()
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
        hashes = block_hashes(_routing_text(pending_request), self.block_chars)
        loads = {r.replica_id: self._load(r) for r in candidate_replicas}
        least = min(loads.values())
        if hashes:
            best = max(
                candidate_replicas,
                key=lambda r: (self.index.match(r.replica_id, hashes), -loads[r.replica_id]),
            )
            matched = self.index.match(best.replica_id, hashes)
            balanced = loads[best.replica_id] - least <= self.imbalance_threshold
            if matched and matched >= self.min_match_ratio * len(hashes) and balanced:
                others = sorted(
                    (r for r in candidate_replicas if r is not best),
                    key=lambda r: loads[r.replica_id],
                )
                return [[best], others] if others else [[best]]
        return [self._power_of_two(candidate_replicas, loads)]

    @staticmethod
    def _power_of_two(
        candidates: list[RunningReplica], loads: dict[ReplicaID, int]
    ) -> list[RunningReplica]:
        pair = random.sample(candidates, k=min(2, len(candidates)))
        return sorted(pair, key=lambda r: loads[r.replica_id])

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        hashes = block_hashes(_routing_text(pending_request), self.block_chars)
        if hashes:
            self.index.insert(replica_id, hashes)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.request_replica[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.request_replica.pop(internal_request_id, None) is None:
            return
        self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)
