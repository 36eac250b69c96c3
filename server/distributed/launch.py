"""`kvserve serve --replicas N` / `--ray-address ADDR`: start (or join) a Ray cluster, run the
kvserve application on Ray Serve's HTTP proxy at --host/--port, and shut it down on SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping
from typing import Any

from server.distributed.config import RayConfig
from server.state import ServerConfig

logger = logging.getLogger("kvserve")


def serve_on_ray(
    values: Mapping[str, Any], ray_config: RayConfig, server_config: ServerConfig
) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        logger.error("--replicas and --ray-address need Ray: pip install 'kvserve[ray]'")
        return 1
    from server.distributed.app import build_application

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if ray_config.ray_address:
        ray.init(address=ray_config.ray_address, namespace="kvserve")
    else:
        ray.init(include_dashboard=False, namespace="kvserve")
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        app = build_application(values, ray_config, server_config)
        logger.info(
            "starting kvserve replicas on Ray Serve (router: %s)", ray_config.request_router
        )
        serve.run(app, name="kvserve", route_prefix="/", blocking=False)
        logger.info(
            "serving on http://%s:%d through Ray Serve", server_config.host, server_config.port
        )
        while not stop.wait(0.5):
            pass
        logger.info("shutting down the kvserve application")
        if ray_config.ray_address:
            serve.delete("kvserve")
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
    logger.info("bye")
    return 0
