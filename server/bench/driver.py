"""The request driver of `kvserve bench`: streamed (or plain) completions or chat requests against any
OpenAI-compatible URL, at a fixed concurrency or a Poisson arrival rate, each timed chunk by chunk."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from server.bench.metrics import RequestRecord, compute_metrics
from server.bench.prompts import load_tokenizer, synthetic_prompts

logger = logging.getLogger(__name__)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback URLs
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def first_model_id(base_url: str) -> str | None:
    """The first model the server lists at /v1/models, or None if it lists none."""
    try:
        status, body = http_get(base_url.rstrip("/") + "/v1/models")
        if status == 200:
            data = json.loads(body).get("data") or []
            return data[0]["id"] if data else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # completions | chat
    model: str | None = None  # None -> the first id of /v1/models, else omitted
    input_len: int = 128
    output_len: int = 64
    num_requests: int = 32
    max_seconds: float = 120.0
    concurrency: int | None = 8
    request_rate: float | None = None  # requests/s (Poisson); None -> as fast as concurrency allows
    ignore_eos: bool = True
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokenizer: str | None = "auto"
    warmup: int = 1
    seed: int = 0
    timeout: float = 600.0
    percentiles: tuple[float, ...] = (99,)
    progress: bool = True
    # The HTTP client library: "aiohttp" (where installed, what "auto" picks), "httpx". On a small
    # machine the client shares the CPUs with the server it measures: aiohttp spends about half
    # httpx's CPU per streamed chunk.
    http_client: str = "auto"


def build_body(config: BenchConfig, prompt: str, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": config.output_len, "temperature": 0.0}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if model:
        body["model"] = model
    if config.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


class HttpClient(Protocol):
    """What the driver needs of an HTTP client: a JSON POST read whole, and one read line by line
    (both raise RuntimeError on a status other than 200, with the start of the body)."""

    async def post(self, url: str, body: dict[str, Any]) -> Any: ...

    def post_lines(
        self, url: str, body: dict[str, Any]
    ) -> AbstractAsyncContextManager[AsyncIterator[str]]: ...


def _status_error(status: int, text: str) -> RuntimeError:
    return RuntimeError(f"HTTP {status}: {text[:200]}")


class HttpxClient:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def post(self, url: str, body: dict[str, Any]) -> Any:
        response = await self.client.post(url, json=body)
        if response.status_code != 200:
            raise _status_error(response.status_code, response.text)
        return response.json()

    @asynccontextmanager
    async def post_lines(self, url: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[str]]:
        async with self.client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                raise _status_error(response.status_code, text)
            yield response.aiter_lines()


class AiohttpClient:
    def __init__(self, session: Any, max_pooled: int = 8) -> None:  # aiohttp.ClientSession
        self.session = session
        self.max_pooled = max_pooled  # kept-alive connections the pool may hold (its limit)

    async def post(self, url: str, body: dict[str, Any]) -> Any:
        async with self._post(url, body) as response:
            return await response.json(content_type=None)

    @asynccontextmanager
    async def post_lines(self, url: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[str]]:
        async with self._post(url, body) as response:
            yield _lines(response.content.iter_any())

    @asynccontextmanager
    async def _post(self, url: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """The response (status 200) of a POST. A kept-alive connection the server has just
        closed fails before any response ("Can not write request body", "Server disconnected";
        llama.cpp's server closes them after streamed replies, and its close can reach the client
        after the pool hands the connection out again): each such failure drops that connection
        and the request goes again, on the next pooled one or a new one, as httpx does. A
        connection that cannot be made fails at once."""
        import aiohttp

        attempts = 1 + self.max_pooled
        for attempt in range(attempts):
            try:
                response = await self.session.post(url, json=body)
                break
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if attempt == attempts - 1:
                    raise
        try:
            if response.status != 200:
                raise _status_error(response.status, await response.text())
            yield response
        finally:
            response.release()


async def _lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of a byte stream (any line length; a last line without its newline too)."""
    rest = b""
    async for piece in pieces:
        *lines, rest = (rest + piece).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if rest:
        yield rest.rstrip(b"\r").decode("utf-8", "replace")


HTTP_CLIENTS = ("auto", "aiohttp", "httpx")  # BenchConfig.http_client, --http-client


def resolve_http_client(name: str) -> str:
    """The client library a name stands for: auto is aiohttp where it imports, else httpx; a name
    it does not know: ValueError."""
    if name not in HTTP_CLIENTS:
        raise ValueError(f"http client must be auto, aiohttp or httpx, not {name!r}")
    if name == "httpx":
        return name
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        if name == "aiohttp":
            raise ValueError("--http-client aiohttp: aiohttp is not installed") from None
        return "httpx"
    return "aiohttp"


@asynccontextmanager
async def open_client(config: BenchConfig) -> AsyncIterator[HttpClient]:
    """The run's client, with the per-request timeout (30 s to connect); aiohttp's pool holds at
    most one connection per request in flight, httpx's is unbounded."""
    if resolve_http_client(config.http_client) == "aiohttp":
        import aiohttp

        session_timeout = aiohttp.ClientTimeout(total=config.timeout, connect=30.0)
        # at most one connection per request in flight (none waits for a pooled one to free)
        connector = aiohttp.TCPConnector(limit=config.concurrency or 0)
        # trust_env: proxies and .netrc from the environment, as httpx reads them
        async with aiohttp.ClientSession(
            timeout=session_timeout, connector=connector, trust_env=True
        ) as session:
            yield AiohttpClient(session, max_pooled=config.concurrency or 64)
        return
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        yield HttpxClient(client)


async def send_request(
    client: HttpClient, url: str, body: dict[str, Any], record: RequestRecord
) -> RequestRecord:
    """POST one request and fill `record` with chunk arrival times and token counts."""
    try:
        if body.get("stream"):
            await _send_streaming(client, url, body, record)
        else:
            response = await client.post(url, body)
            _read_usage((response or {}).get("usage") or {}, record)
        record.end = time.perf_counter()
        record.ok = record.error is None
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as e:  # noqa: BLE001 - every failure is counted, never fatal to the run
        record.error = f"{type(e).__name__}: {e}"[:300]
        record.end = time.perf_counter()
    return record


async def _send_streaming(
    client: HttpClient, url: str, body: dict[str, Any], record: RequestRecord
) -> None:
    usage: dict[str, Any] | None = None
    async with client.post_lines(url, body) as lines:
        async for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            if _chunk_text(chunk):
                record.chunk_times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if usage:
        _read_usage(usage, record)
    else:  # no usage: count one token per text chunk
        record.output_tokens = len(record.chunk_times)
    if record.output_tokens and not record.chunk_times:
        raise RuntimeError("the stream carried no text")


def _read_usage(usage: dict[str, Any], record: RequestRecord) -> None:
    record.prompt_tokens = usage.get("prompt_tokens") or 0
    record.output_tokens = usage.get("completion_tokens") or 0
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens") or 0


def _endpoint_url(config: BenchConfig) -> str:
    path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
    return config.base_url.rstrip("/") + path


async def run_benchmark_async(config: BenchConfig) -> dict[str, Any]:
    """Run the workload and return the metrics dict (also carries the config and prompt length)."""
    if config.concurrency is None and config.request_rate is None:
        raise ValueError("give a --concurrency, a --request-rate, or both")
    tokenizer = load_tokenizer(config.tokenizer)
    prompts = synthetic_prompts(
        config.num_requests + config.warmup, config.input_len, tokenizer, config.seed
    )
    model = config.model or first_model_id(config.base_url)
    url = _endpoint_url(config)
    async with open_client(config) as client:
        for prompt in prompts[: config.warmup]:
            warm = await send_request(
                client, url, build_body(config, prompt, model), RequestRecord(time.perf_counter())
            )
            if not warm.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {warm.error}")
        records, duration = await _drive(client, url, config, prompts[config.warmup :], model)
    metrics = compute_metrics(records, duration, config.percentiles)
    metrics["config"] = {
        **asdict(config),
        "model": model,
        "url": url,
        "http_client": resolve_http_client(config.http_client),
    }
    return metrics


async def _drive(
    client: HttpClient,
    url: str,
    config: BenchConfig,
    prompts: Sequence[str],
    model: str | None,
) -> tuple[list[RequestRecord], float]:
    """Issue requests under the concurrency cap and arrival process until done or out of time."""
    rng = random.Random(config.seed + 1)
    semaphore = asyncio.Semaphore(config.concurrency or len(prompts) or 1)
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord]] = []
    progress = _progress_bar(config, len(prompts))
    start = time.perf_counter()
    deadline = start + config.max_seconds

    async def one(prompt: str) -> RequestRecord:
        async with semaphore:
            record = RequestRecord(time.perf_counter())
            records.append(record)
            if time.perf_counter() >= deadline:
                record.error = "cancelled"
                return record
            await send_request(client, url, build_body(config, prompt, model), record)
            if progress is not None:
                progress.update(1)
            return record

    for prompt in prompts:
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(one(prompt)))
        if config.request_rate:
            await asyncio.sleep(rng.expovariate(config.request_rate))
        else:
            await asyncio.sleep(0)
    remaining = max(0.0, deadline - time.perf_counter())
    _done, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    unsent = len(prompts) - len(records)  # never started: cut off by the deadline
    records.extend(RequestRecord(start, error="cancelled") for _ in range(unsent))
    finished = [r.end for r in records if r.ok]
    duration = (max(finished) if finished else time.perf_counter()) - start
    if pending:
        duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return records, duration


def _progress_bar(config: BenchConfig, total: int) -> Any:
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr, leave=False)


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    return asyncio.run(run_benchmark_async(config))
