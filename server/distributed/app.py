"""The kvserve Ray Serve application, for `kvserve serve --replicas N` and for `serve run` /
`serve deploy` with a config file (import path `server.distributed.app:build`, `args` = any
`kvserve serve` option names and values, e.g. `{replicas: 2, threads: 1}`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ray import serve

from server.distributed.config import RayConfig
from server.distributed.deployments import KvserveIngress, KvserveReplica
from server.state import ServerConfig

logger = logging.getLogger(__name__)


def build_application(
    values: Mapping[str, Any], ray_config: RayConfig, server_config: ServerConfig
) -> Any:
    """Ingress (one replica, no CPU reserved) -> N kvserve replicas behind the chosen router."""
    options: dict[str, Any] = {
        "ray_actor_options": {
            "num_cpus": ray_config.replica_cpus,
            "num_gpus": ray_config.replica_gpus,
        },
        "max_ongoing_requests": ray_config.max_ongoing_requests,
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        **ray_config.scaling_options(),
    }
    if ray_config.request_router == "prefix":
        options["request_router_config"] = {
            "request_router_class": "server.distributed.router.PrefixAffinityRouter"
        }
    replica = serve.deployment(name="KvserveReplica", **options)(KvserveReplica)
    ingress = serve.deployment(
        name="KvserveIngress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,  # queueing and backpressure belong to the replicas
    )(KvserveIngress)
    return ingress.bind(
        replica.bind(dict(values)),
        server_config.max_request_body_bytes,
        server_config.api_key,
        dict(values),
    )


def build(args: dict[str, Any]) -> Any:
    """Application builder for `serve run` / `serve deploy`: `args` are `kvserve serve` options
    (merged over KVSERVE_* environment variables and an optional `config` YAML file)."""
    from server.settings import build_configs, build_ray_config, resolve

    cli = {str(k).replace("-", "_"): v for k, v in args.items()}
    values = resolve(cli)
    _, server_config = build_configs(values)
    return build_application(values, build_ray_config(values), server_config)
