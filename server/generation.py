"""Shared request plumbing: sampling params from API fields, the engine's prompt checks mapped to this
API's field names, and the engine-stream fan-in that aborts every engine request when the client
disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from engine import (
    EngineClient,
    InvalidRequestError,
    OutputKind,
    QueueFullError,
    ReasoningFormat,
    RequestOutput,
    SamplingParams,
    StructuredOutputs,
)
from server.errors import invalid_request, to_api_error
from server.field_map import FieldMap
from server.protocol import SamplingFields
from server.turn_request import Sampling

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests have been aborted."""


def check_stream_options(req: SamplingFields) -> None:
    """stream_options only means something for a streamed response; OpenAI rejects it otherwise."""
    if req.stream_options is not None and not req.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", "stream_options"
        )


def check_prompt_logprobs(req: SamplingFields) -> None:
    """vLLM's rule: prompt logprobs come with the whole response, never in a stream."""
    if req.prompt_logprobs is not None and req.stream:
        raise invalid_request(
            "prompt_logprobs are not available when stream is true", "prompt_logprobs"
        )


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as the model takes)."""
    if keep is None:
        return ids
    if keep == 0:
        raise invalid_request(
            "truncate_prompt_tokens must be -1 (the model's length) or at least 1",
            "truncate_prompt_tokens",
        )
    if keep > max_model_len:
        raise invalid_request(
            f"truncate_prompt_tokens ({keep}) is greater than the model's maximum length "
            f"({max_model_len}); choose a smaller truncation size",
            "truncate_prompt_tokens",
        )
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:]


def build_sampling_params(
    req: Sampling,
    *,
    n: int,
    best_of: int | None,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    output_kind: OutputKind,
    structured_outputs: StructuredOutputs | None = None,
    reasoning: ReasoningFormat | None = None,
) -> SamplingParams:
    """SamplingParams from the API fields; the engine's range checks (SamplingParamsError) become
    400s naming the field, through the error handlers."""
    logit_bias: dict[int, float] | None = None
    if req.logit_bias:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            # ASCII digits only: int() would also take " 5", "+5", "1_0" and other scripts' digits.
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise invalid_request(
                    f"logit_bias keys must be token ids written as strings, got {key!r}",
                    "logit_bias",
                )
            logit_bias[int(key)] = bias
    return SamplingParams(
        n=n,
        best_of=best_of,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k in (None, -1) else req.top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        output_kind=output_kind,
        structured_outputs=structured_outputs,
        reasoning=reasoning,
    )


def check_prompts(
    engine: EngineClient,
    prompts: Sequence[list[int]],
    params: SamplingParams | None,
    fields: FieldMap,
) -> None:
    """The engine's own checks of each prompt (tokens, context length, the params against the
    vocabulary) before anything starts, so a bad prompt is a 400 naming this API's fields."""
    try:
        for ids in prompts:
            engine.validate(ids, params)
    except InvalidRequestError as e:
        raise to_api_error(e, fields) from None


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_DONE = object()
_DISCONNECTED = object()


async def merge_outputs(
    streams: Sequence[AsyncIterator[RequestOutput]], request: Request | None
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield (stream index, output) from all engine streams as they arrive.

    Each stream is driven by its own task, so closing this generator, an error in any stream, or the
    client disconnecting cancels all of them, which makes the engine abort those requests. The
    streams and the disconnect watcher all feed one queue, so an output costs one queue hand-off
    (no task or wait set per output).
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    log = _RequestLog(request, len(streams))

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((index, e))
            return
        queue.put_nowait((index, _DONE))

    async def watch(request: Request) -> None:
        with contextlib.suppress(Exception):  # a failing receive() also means the client is gone
            await wait_for_disconnect(request)
        queue.put_nowait((-1, _DISCONNECTED))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    watcher = asyncio.create_task(watch(request)) if request is not None else None
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif item is _DISCONNECTED:
                log.outcome = "client disconnected"
                raise ClientDisconnected()
            elif isinstance(item, Exception):
                log.outcome = item
                raise item
            else:
                log.saw(index, item)
                yield index, item
        log.outcome = "finished"
    finally:
        log.done()
        if watcher is not None:
            watcher.cancel()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def first_output(
    outputs: AsyncGenerator[tuple[int, RequestOutput], None], fields: FieldMap
) -> tuple[int, RequestOutput] | None:
    """Await the first (stream index, output) before answering, so that a refused request (queue full,
    bad params) still gets an HTTP error status; closes `outputs` on any failure but a disconnect. An
    engine error names the field through `fields`, this API's names."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None
    except ClientDisconnected:
        raise
    except InvalidRequestError as e:
        await outputs.aclose()
        raise to_api_error(e, fields) from None
    except BaseException:
        await outputs.aclose()
        raise


def log_id(request: Request | None) -> str:
    """The X-Request-Id the middleware gave this HTTP request ("-" outside HTTP)."""
    state = request.scope.get("state", {}) if request is not None else {}
    return str(state.get("request_id", "-"))


class _RequestLog:
    """Log lines about one HTTP request's engine work, tagged with its X-Request-Id: start and finish at
    DEBUG, aborts at INFO, failures at WARNING. Counts and reasons only, never prompt or output text."""

    def __init__(self, request: Request | None, num_streams: int) -> None:
        self.request_id = log_id(request)
        self.started = time.monotonic()
        self.latest: dict[int, RequestOutput] = {}
        self.num_streams = num_streams
        self.outcome: str | BaseException = "closed early"  # e.g. a streaming client went away
        # (stream index, choice index) -> (output tokens so far, finish reason)
        self.tokens: dict[tuple[int, int], tuple[int, str | None]] = {}

    def saw(self, index: int, output: RequestOutput) -> None:
        self.latest[index] = output
        for c in output.outputs:  # delta outputs carry only the choices that moved
            self.tokens[(index, c.index)] = (c.num_output_tokens, c.finish_reason)

    def done(self) -> None:
        elapsed = time.monotonic() - self.started
        outcome = self.outcome
        outs_finished = len(self.latest) == self.num_streams
        if outcome == "finished" or (
            outs_finished and all(o.finished for o in self.latest.values())
        ):
            outs = self.latest.values()
            logger.debug(
                "request %s: finished in %.3fs: prompt_tokens=%d completion_tokens=%d finish_reasons=%s",
                self.request_id,
                elapsed,
                sum(len(o.prompt_token_ids) for o in outs),
                sum(n for n, _ in self.tokens.values()),
                ",".join(sorted({str(reason) for _, reason in self.tokens.values()})),
            )
        elif isinstance(outcome, (QueueFullError, InvalidRequestError)):
            logger.debug("request %s: refused: %s", self.request_id, outcome)
        elif isinstance(outcome, BaseException):
            logger.warning("request %s: failed after %.3fs: %s", self.request_id, elapsed, outcome)
        else:
            logger.info(
                "request %s: %s after %.3fs; engine work aborted", self.request_id, outcome, elapsed
            )


def start_streams(
    engine: EngineClient,
    request_id: str,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    request: Request | None = None,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[AsyncGenerator[RequestOutput, None]]:
    """One engine request per prompt, ids `<request_id>-<prompt index>`, on the LoRA adapter `lora`
    (None: the base model), its prefix-cache blocks salted with `cache_salt`."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "request %s: engine request(s) %s-0..%d, %d prompt tokens, max_tokens=%s, n=%d, lora=%s",
            log_id(request),
            request_id,
            len(prompts) - 1,
            sum(len(ids) for _, ids in prompts),
            params.max_tokens,
            params.n,
            lora,
        )
    streams: list[AsyncGenerator[RequestOutput, None]] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            streams.append(
                engine.generate(
                    f"{request_id}-{i}", ids, params, prompt=text, lora=lora, cache_salt=cache_salt
                )
            )
    except BaseException:
        for stream in streams:
            asyncio.ensure_future(stream.aclose())
        raise
    return streams
