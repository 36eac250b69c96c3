"""RayConfig: how many kvserve replicas, their resources, autoscaling bounds and request router."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROUTERS = ("prefix", "pow2")


@dataclass(frozen=True)
class RayConfig:
    replicas: int = 0  # 0: one process, no Ray
    ray_address: str | None = None  # None: start a local Ray cluster
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    min_replicas: int | None = None  # autoscaling is on when max_replicas > min_replicas
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 64
    request_router: str = "prefix"

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must not be negative, got {self.replicas}")
        if self.replica_cpus <= 0 or self.replica_gpus < 0:
            raise ValueError("replica-cpus must be positive and replica-gpus not negative")
        if self.min_replicas is not None and self.min_replicas < 0:
            raise ValueError("min-replicas must not be negative")
        low = self.min_replicas if self.min_replicas is not None else self.replicas
        if self.max_replicas is not None and self.max_replicas < max(low, 1):
            raise ValueError(
                f"max-replicas ({self.max_replicas}) must be at least min-replicas and 1"
            )
        if self.target_ongoing_requests <= 0:
            raise ValueError("target-ongoing-requests must be positive")
        if self.max_ongoing_requests < 1:
            raise ValueError("max-ongoing-requests must be at least 1")
        if self.request_router not in ROUTERS:
            raise ValueError(f"request-router must be one of {', '.join(ROUTERS)}")

    @property
    def enabled(self) -> bool:
        return self.replicas > 0 or self.ray_address is not None or self.max_replicas is not None

    def scaling_options(self) -> dict[str, Any]:
        """Ray Serve deployment options: a fixed replica count, or autoscaling bounds."""
        initial = max(self.replicas, 1)
        if self.max_replicas is None:
            return {"num_replicas": initial}
        low = self.min_replicas if self.min_replicas is not None else min(initial, 1)
        return {
            "autoscaling_config": {
                "min_replicas": low,
                "initial_replicas": min(max(initial, low), self.max_replicas),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        }
