"""Benchmark metric math on synthetic timestamps: percentiles, TTFT, TPOT, ITL, throughput."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable

import httpx
import pytest

from server.bench import (
    BenchConfig,
    RequestRecord,
    build_body,
    compute_metrics,
    format_table,
    percentile,
    ratio,
    send_request,
    summarize,
    synthetic_prompts,
)
from server.bench.driver import AiohttpClient, HttpxClient, open_client, resolve_http_client


def _record(
    start: float, chunks: list[float], end: float, out: int, prompt: int = 10
) -> RequestRecord:
    return RequestRecord(
        start=start, end=end, ok=True, prompt_tokens=prompt, output_tokens=out, chunk_times=chunks
    )


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summarize_reports_milliseconds() -> None:
    stats = summarize([0.001, 0.002, 0.003, 0.010], percentiles=(99,))
    assert stats["mean"] == pytest.approx(4.0)
    assert stats["median"] == pytest.approx(2.5)
    assert stats["p99"] == pytest.approx(9.79)


def test_ttft_tpot_itl_from_timestamps() -> None:
    # sent at 10.0; tokens at 10.5, 10.6, 10.8, 11.1; finished at 11.1
    rec = _record(10.0, [10.5, 10.6, 10.8, 11.1], 11.1, out=4)
    assert rec.ttft == pytest.approx(0.5)
    assert rec.e2e == pytest.approx(1.1)
    assert rec.tpot == pytest.approx(0.6 / 3)
    assert rec.itls == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_uses_token_count_when_chunks_carry_several_tokens() -> None:
    rec = _record(0.0, [1.0, 2.0], 2.0, out=11)  # 2 chunks, 11 tokens
    assert rec.tpot == pytest.approx(0.1)
    assert rec.itls == pytest.approx([1.0])


def test_single_token_and_non_streamed_requests() -> None:
    one = _record(0.0, [0.4], 0.5, out=1)
    assert one.tpot is None and one.itls == []
    unstreamed = _record(0.0, [], 2.0, out=5)
    assert unstreamed.ttft == pytest.approx(2.0)


def test_compute_metrics_throughput_and_failures() -> None:
    records = [
        _record(0.0, [0.1, 0.2, 0.3], 0.3, out=3, prompt=100),
        _record(0.0, [0.2, 0.4, 0.6], 0.6, out=3, prompt=100),
        RequestRecord(start=0.0, end=0.1, error="HTTP 500: boom"),
        RequestRecord(start=0.0, error="cancelled"),
    ]
    m = compute_metrics(records, duration=2.0)
    assert (m["completed"], m["failed"], m["cancelled"]) == (2, 1, 1)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["streamed_output_throughput"] == pytest.approx(3.0)
    cut = RequestRecord(start=0.0, error="cancelled", chunk_times=[0.1, 0.2])
    assert compute_metrics([*records, cut], 2.0)["streamed_output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(103.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert m["itl_ms"]["median"] == pytest.approx(150.0)  # gaps 100, 100, 200, 200
    assert m["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert m["errors"] == ["HTTP 500: boom"]
    assert "n/a" not in format_table({**m, "config": {}})


def test_empty_run_gives_nan_not_crash() -> None:
    m = compute_metrics([], duration=0.0)
    assert m["completed"] == 0 and math.isnan(m["output_throughput"])
    assert "n/a" in format_table({**m, "config": {}})


def test_ratio_handles_missing_figures() -> None:
    assert ratio(6.0, 3.0) == 2.0
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))


class _CharTokenizer:
    """One token per character: lengths are exact and easy to check."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_synthetic_prompts_have_the_requested_length_and_differ() -> None:
    prompts = synthetic_prompts(5, 40, _CharTokenizer(), seed=1)
    assert all(len(p) == 40 for p in prompts)
    assert len(set(prompts)) == 5
    assert synthetic_prompts(5, 40, _CharTokenizer(), seed=1) == prompts
    words = synthetic_prompts(2, 17, None)
    assert all(len(p.split()) == 17 for p in words)


def test_request_body_honours_ignore_eos_and_extra_fields() -> None:
    cfg = BenchConfig(output_len=7, extra_body={"top_k": 1})
    body = build_body(cfg, "hi", "m")
    assert body["ignore_eos"] is True and body["max_tokens"] == 7 and body["top_k"] == 1
    assert body["stream_options"] == {"include_usage": True}
    chat = build_body(BenchConfig(endpoint="chat", ignore_eos=False), "hi", None)
    assert "ignore_eos" not in chat and "model" not in chat
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def test_send_request_parses_a_stream_with_usage() -> None:
    chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "", "c")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=_sse(chunks)))

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(
                HttpxClient(client), "http://x/v1/completions", {"stream": True}, RequestRecord(0.0)
            )

    rec = asyncio.run(go())
    assert rec.ok and rec.output_tokens == 3 and rec.prompt_tokens == 5
    assert len(rec.chunk_times) == 3  # the empty chunk is not a token


def test_send_request_records_http_errors() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(422, text="Unexpected fields"))

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(
                HttpxClient(client), "http://x", {"stream": True}, RequestRecord(0.0)
            )

    rec = asyncio.run(go())
    assert not rec.ok and "422" in (rec.error or "")


def _drive_with(
    handler: Callable[[httpx.Request], Awaitable[httpx.Response]], config: BenchConfig, n: int
) -> tuple[list[RequestRecord], float]:
    from server.bench.driver import _drive

    async def go() -> tuple[list[RequestRecord], float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _drive(
                HttpxClient(client), "http://x/v1/completions", config, ["p"] * n, None
            )

    return asyncio.run(go())


def test_load_generator_respects_concurrency_and_count() -> None:
    in_flight, peak, seen = 0, 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak, seen
        in_flight += 1
        seen += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        chunks = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
        return httpx.Response(200, content=_sse(chunks))

    config = BenchConfig(concurrency=3, progress=False, max_seconds=60)
    records, duration = _drive_with(handler, config, 10)
    assert seen == 10 and peak == 3
    assert sum(r.ok for r in records) == 10 and duration > 0


def test_load_generator_stops_at_the_deadline() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.2)
        return httpx.Response(200, content=_sse([{"choices": [{"text": "x"}]}]))

    config = BenchConfig(concurrency=1, progress=False, max_seconds=0.3)
    records, _ = _drive_with(handler, config, 5)
    m = compute_metrics(records, 1.0)
    assert m["completed"] < 5 and m["completed"] + m["cancelled"] == 5


def test_the_aiohttp_client_reads_streams_split_anywhere_and_long_lines() -> None:
    """The default client where installed, against a real aiohttp server: an SSE stream written in
    pieces that cut lines (and a CRLF) anywhere, a 200 KB line, a plain JSON reply, an error status."""
    aiohttp = pytest.importorskip("aiohttp")
    from aiohttp import web

    long_text = "y" * 200_000
    chunks = [{"choices": [{"text": t}]} for t in ("a", "", long_text, "c")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    stream = _sse(chunks).replace(b"\n\n", b"\r\n\r\n", 1)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("bad"):
            return web.Response(status=422, text="Unexpected fields")
        if not body.get("stream"):
            return web.json_response({"usage": {"prompt_tokens": 4, "completion_tokens": 2}})
        response = web.StreamResponse()
        await response.prepare(request)
        for i in range(0, len(stream), 7777):  # pieces that end mid-line
            await response.write(stream[i : i + 7777])
        await response.write_eof()
        return response

    async def go() -> list[RequestRecord]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            async with open_client(BenchConfig(http_client="aiohttp")) as client:
                assert isinstance(client, AiohttpClient)
                bodies = ({"stream": True}, {"stream": False}, {"stream": True, "bad": 1})
                return [await send_request(client, url, b, RequestRecord(0.0)) for b in bodies]
        finally:
            await runner.cleanup()

    streamed, whole, bad = asyncio.run(go())
    assert aiohttp is not None
    assert streamed.ok and streamed.output_tokens == 3 and streamed.prompt_tokens == 5
    assert len(streamed.chunk_times) == 3  # the empty chunk is not a token
    assert whole.ok and whole.output_tokens == 2 and whole.chunk_times == []
    assert not bad.ok and "HTTP 422: Unexpected fields" in (bad.error or "")


def test_the_http_client_choice() -> None:
    assert resolve_http_client("httpx") == "httpx"
    try:
        import aiohttp  # noqa: F401

        assert resolve_http_client("auto") == "aiohttp"
    except ImportError:
        assert resolve_http_client("auto") == "httpx"
    with pytest.raises(ValueError, match="auto, aiohttp or httpx"):
        resolve_http_client("curl")


def test_the_aiohttp_client_sends_again_when_a_kept_alive_connection_was_closed() -> None:
    """llama.cpp's server closes kept-alive connections: the next request on one fails before any
    response ("Can not write request body", "Server disconnected"). The client sends it again on a
    new connection (a raw server here drops every connection at its second request)."""
    pytest.importorskip("aiohttp")
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            for nth in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if nth == 1:
                    return  # dropped without an answer
                served += 1
                reply = json.dumps({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(reply)}\r\n\r\n{reply}".encode()
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> list[RequestRecord]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            async with open_client(BenchConfig(http_client="aiohttp")) as client:
                return [
                    await send_request(client, url, {"stream": False}, RequestRecord(0.0))
                    for _ in range(4)
                ]
        finally:
            server.close()
            await server.wait_closed()

    records = asyncio.run(go())
    assert [r.error for r in records] == [None] * 4
    assert all(r.ok and r.output_tokens == 1 for r in records) and served == 4
