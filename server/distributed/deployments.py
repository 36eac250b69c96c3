"""The two Ray Serve deployments: `KvserveReplica` (one engine and the whole kvserve FastAPI app,
driven in-process) and `KvserveIngress` (reads an HTTP request, hands it to a replica through a
deployment handle whose request router picks the replica, and streams the replica's answer back).
A replica's own /metrics, /health and stats are also served on a port of its node, listed by the
ingress at GET /v1/internal/replicas and as Prometheus HTTP service discovery at /v1/internal/sd.
A runtime LoRA load or unload goes to every replica's own port (server/distributed/lora_broadcast.py),
and the directory keeps the loaded ones, so a replica Ray starts later loads them too; so does
POST /reset_prefix_cache (server/distributed/cache_reset.py), as every replica has its own cache."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.distributed.asgi_call import ForwardRequest, ResponseStart, call_asgi
from server.distributed.cache_reset import RESET_PATH, broadcast_cache_reset
from server.distributed.lora_broadcast import LOAD_PATH, LORA_UPDATE_PATHS, broadcast_lora_update
from server.distributed.prefix_index import routing_model, routing_salt, routing_text
from server.distributed.replica_broadcast import ReplicaAnswer
from server.distributed.replica_events import events_info, with_replica_events
from server.distributed.routing_tokens import RoutingTokenizer
from server.errors import APIError, service_unavailable
from server.middleware import key_ok

logger = logging.getLogger(__name__)
DIRECTORY_NAME = "kvserve-replica-directory"


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    """Replica id -> where its own HTTP port is; replicas register at start, dead ones are pruned."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}
        self.loras: dict[str, str] = {}  # LoRA adapters loaded at run time: name -> path

    def register(self, replica_id: str, info: dict[str, Any]) -> None:
        self.replicas[replica_id] = info

    def unregister(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def list(self) -> dict[str, dict[str, Any]]:
        return dict(self.replicas)

    def set_lora(self, name: str, path: str | None) -> None:
        """Record a runtime load (path) or unload (None) that every replica did."""
        if path is None:
            self.loras.pop(name, None)
        else:
            self.loras[name] = path

    def runtime_loras(self) -> dict[str, str]:
        return dict(self.loras)


def directory() -> Any:
    return ReplicaDirectory.options(  # type: ignore[attr-defined]
        name=DIRECTORY_NAME, namespace="kvserve", get_if_exists=True, lifetime="detached"
    ).remote()


class KvserveReplica:
    """One kvserve engine and app. `values` are the resolved `kvserve serve` options."""

    async def __init__(self, values: dict[str, Any]) -> None:  # type: ignore[misc]  # Ray awaits it
        import uvicorn

        from engine import AsyncLLMEngine
        from server.app import build_app
        from server.logging_setup import configure_logging
        from server.settings import build_configs

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        values = with_replica_events(values, self.replica_id)
        engine_config, server_config = build_configs(values)
        configure_logging(server_config.log_level)
        self.app = build_app(server_config)
        engine = await asyncio.to_thread(AsyncLLMEngine.from_config, engine_config)
        await engine.start()
        self.app.state.server.engine = engine
        await self._load_runtime_loras(engine)
        # The same app on a port of this node, for Prometheus and per-replica probes.
        uv = uvicorn.Config(self.app, host="0.0.0.0", port=0, log_config=None, lifespan="off")
        sock = uv.bind_socket()
        self.http = uvicorn.Server(uv)
        self.http_task = asyncio.create_task(self.http.serve(sockets=[sock]))
        node_ip = ray.util.get_node_ip_address()
        self.info = {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "node_ip": node_ip,
            "url": f"http://{node_ip}:{sock.getsockname()[1]}",
            "started": time.time(),
            "kv_events": events_info(engine.snapshot().kv_events, node_ip),
        }
        await directory().register.remote(self.replica_id, self.info)

    async def _load_runtime_loras(self, engine: Any) -> None:
        """The adapters loaded at run time before this replica started (a restart, a scale-up)."""
        loaded = {info.name for info in engine.loras()}
        for name, path in (await directory().runtime_loras.remote()).items():
            if name in loaded:
                continue
            try:
                await engine.load_lora(name, path)
            except Exception as e:  # noqa: BLE001 - it serves the rest; the log says which
                logger.error(
                    "replica %s: cannot load LoRA adapter %r: %s", self.replica_id, name, e
                )

    async def forward(self, request: ForwardRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in call_asgi(self.app, request):
            yield item

    def replica_info(self) -> dict[str, Any]:
        return self.info

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes Ray replace the replica."""
        engine = self.app.state.server.engine
        health = engine.health()
        if health.state == "dead":
            raise RuntimeError(f"kvserve engine is dead: {health.error}")

    async def __del__(self) -> None:
        with contextlib.suppress(Exception):
            await directory().unregister.remote(self.replica_id)
        with contextlib.suppress(Exception):
            self.http.should_exit = True
            await self.app.state.server.engine.shutdown()


def _error(err: APIError) -> Response:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class KvserveIngress:
    """HTTP in, one replica call out; no protocol logic lives here (the replica's app has it all)."""

    def __init__(
        self,
        replica: Any,
        max_request_body_bytes: int,
        api_key: str | None,
        values: dict[str, Any] | None = None,
    ) -> None:
        self.replica = replica
        self.max_body = max_request_body_bytes
        self.api_key = api_key
        # The prefix router matches prompt token ids against the replicas' KV events.
        by_kv = values is not None and values.get("request_router", "prefix") == "prefix"
        self.tokenizer = RoutingTokenizer.load(values) if values is not None and by_kv else None

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path in ("/v1/internal/replicas", "/v1/internal/sd") and not self._authorized(request):
            return _error(
                APIError(
                    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                    status=401,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            )
        if path == "/v1/internal/replicas":
            return JSONResponse({"data": await self._replicas()})
        if path == "/v1/internal/sd":
            return JSONResponse(
                [
                    {
                        "targets": [r["url"].removeprefix("http://")],
                        "labels": {"replica_id": r["replica_id"]},
                    }
                    for r in await self._replicas()
                ]
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return _error(
                    APIError(
                        f"The request body exceeds the limit of {self.max_body} bytes.",
                        status=413,
                    )
                )
        client = (request.client.host, request.client.port) if request.client else None
        if path in (*LORA_UPDATE_PATHS, RESET_PATH) and request.method == "POST":
            return await self._broadcast(request, bytes(body))
        tokens = None
        if self.tokenizer is not None:
            tokens = await asyncio.to_thread(self.tokenizer.tokens, path, bytes(body))
        forward = ForwardRequest(
            method=request.method,
            path=path,
            query_string=request.url.query.encode(),
            headers=list(request.scope["headers"]),
            body=bytes(body),
            client=client,
            routing_text=routing_text(path, bytes(body)),
            routing_tokens=tokens,
            cache_salt=routing_salt(bytes(body)),
            model=routing_model(bytes(body)),
        )
        stream = self.replica.forward.options(stream=True).remote(forward)
        try:
            start = await stream.__anext__()
        except StopAsyncIteration:
            return _error(service_unavailable("The replica closed the request without a response."))
        except Exception as e:  # noqa: BLE001 - the replica died or was unreachable
            logger.warning("replica call failed: %s", e)
            return _error(_replica_failed(e))
        assert isinstance(start, ResponseStart)
        # Ray's proxy adds its own x-request-id (the same id: the replica echoes the incoming one).
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in start.headers
            if k.lower() != b"x-request-id"
        }
        media = headers.get("content-type", "")
        if not media.startswith("text/event-stream"):
            chunks = [chunk async for chunk in _safe(stream)]
            if any(isinstance(c, APIError) for c in chunks):
                return _error(next(c for c in chunks if isinstance(c, APIError)))
            return Response(
                b"".join(c for c in chunks if isinstance(c, bytes)), start.status, headers
            )
        headers.pop("content-length", None)
        return StreamingResponse(_sse(stream), status_code=start.status, headers=headers)

    async def _broadcast(self, request: Request, body: bytes) -> Response:
        """A LoRA load or unload, or a prefix-cache reset, to every live replica's own port (one
        answer: see lora_broadcast and cache_reset)."""
        import httpx

        urls = {r["replica_id"]: r["url"] for r in await self._replicas()}
        headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length")}
        query = request.url.query.encode()
        forward = ForwardRequest(request.method, request.url.path, query, [], body)

        async def send(replica_id: str, req: ForwardRequest) -> ReplicaAnswer:
            url = urls[replica_id] + req.path
            if req.query_string:
                url += "?" + req.query_string.decode()
            async with httpx.AsyncClient(timeout=600.0) as client:
                r = await client.post(url, content=req.body, headers=headers)
            kind = r.headers.get("content-type", "application/json")
            return ReplicaAnswer(replica_id, r.status_code, r.content, kind)

        if request.url.path == RESET_PATH:
            answer = await broadcast_cache_reset(forward, list(urls), send)
            kind = answer.content_type if answer.body else None  # vLLM's empty 200 has none
            return Response(answer.body, answer.status, media_type=kind)
        answer = await broadcast_lora_update(forward, list(urls), send)
        if answer.ok:
            fields = json.loads(body)
            path = fields.get("lora_path") if request.url.path == LOAD_PATH else None
            await directory().set_lora.remote(fields["lora_name"], path)
        return Response(answer.body, answer.status, media_type=answer.content_type)

    def _authorized(self, request: Request) -> bool:
        return self.api_key is None or key_ok(request.headers, self.api_key)

    async def _replicas(self) -> list[dict[str, Any]]:
        """Registered replicas that still answer on their own port (dead ones are dropped)."""
        import httpx

        known: dict[str, dict[str, Any]] = await directory().list.remote()
        alive = []
        async with httpx.AsyncClient(timeout=2.0) as client:
            for replica_id, info in sorted(known.items(), key=lambda kv: kv[1]["started"]):
                try:
                    await client.get(info["url"] + "/version")
                except httpx.HTTPError:
                    await directory().unregister.remote(replica_id)
                    continue
                alive.append(info)
        return alive


def _replica_failed(exc: BaseException) -> APIError:
    return service_unavailable(
        f"The kvserve replica serving this request failed ({type(exc).__name__}); "
        "Ray is replacing it, retry the request."
    )


async def _safe(stream: Any) -> AsyncIterator[bytes | APIError]:
    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:  # noqa: BLE001
        yield _replica_failed(e)


async def _sse(stream: Any) -> AsyncIterator[bytes]:
    """The replica's event stream; a replica that dies mid-stream ends it with an error event."""
    try:
        async for item in _safe(stream):
            if isinstance(item, APIError):
                yield f"data: {json.dumps(item.body())}\n\n".encode()
                return
            yield item
    finally:
        with contextlib.suppress(Exception):
            stream.cancel()
