"""POST /v1/completions: prompts (text, ids, or lists of them), n/best_of, echo, legacy logprobs, SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import CompletionOutput, RequestOutput
from server.cost_sheet import cost_sheet, wants_metrics
from server.errors import invalid_request
from server.generation import (
    ClientDisconnected,
    build_sampling_params,
    check_prompts,
    check_stream_options,
    finish_reason,
    first_output,
    merge_outputs,
    start_streams,
)
from server.logprobs import CompletionLogprobsBuilder
from server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from server.sse import sse_response
from server.state import ServerState
from server.streaming import ChunkStream, usage_block
from server.structured_outputs import request_constraint

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


if TYPE_CHECKING:
    from engine import Tokenizer


def _prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[Prompt]:
    p: Any = req.prompt
    if isinstance(p, str):
        return [(p, tokenizer.encode(p))]
    if all(isinstance(x, str) for x in p):
        return [(text, tokenizer.encode(text)) for text in p]
    if all(isinstance(x, int) for x in p):
        return [(None, list(p))]
    return [(None, list(ids)) for ids in p]


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Response:
    engine = state.require_engine()
    model = state.check_model(req.model)
    tokenizer = engine.tokenizer
    check_stream_options(req)
    n = req.n or 1
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    prompts = _prompts(req, tokenizer)
    max_prompts = engine.max_queued_requests
    if len(prompts) > max_prompts:
        raise invalid_request(
            f"Too many prompts ({len(prompts)}); this server takes at most {max_prompts} per request.",
            "prompt",
        )
    want_prompt_logprobs = bool(req.echo) and req.logprobs is not None
    params = build_sampling_params(
        req,
        n=n,
        best_of=req.best_of,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if want_prompt_logprobs else None,
        output_kind="delta" if req.stream else "final",
        structured_outputs=request_constraint(req),
    )
    check_prompts(engine, [ids for _, ids in prompts], params, "prompt")
    with_metrics = wants_metrics(req.return_metrics, raw)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outputs = merge_outputs(start_streams(engine, request_id, prompts, params, raw), raw)
    try:
        first = await first_output(outputs)
    except ClientDisconnected:
        return Response(status_code=499)
    if req.stream:
        stream = _CompletionStream(
            req, tokenizer, model, request_id, created, prompts, n, with_metrics
        )
        return sse_response(stream.frames(first, outputs))
    try:
        finals = await _collect(first, outputs, len(prompts))
    except ClientDisconnected:
        return Response(status_code=499)
    body = _full_response(req, tokenizer, model, request_id, created, prompts, finals, n)
    if with_metrics:
        body["metrics"] = cost_sheet(finals)
    return JSONResponse(body)


async def _collect(
    first: tuple[int, RequestOutput] | None,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    count: int,
) -> list[RequestOutput]:
    latest: dict[int, RequestOutput] = {}
    if first is not None:
        latest[first[0]] = first[1]
    async for index, output in outputs:
        latest[index] = output
    return [latest[i] for i in range(count)]


def _prompt_text(prompt: Prompt, tokenizer: Tokenizer) -> str:
    text, ids = prompt
    return text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)


def _logprobs_builder(
    req: CompletionRequest, tokenizer: Tokenizer, num_top: int
) -> CompletionLogprobsBuilder:
    return CompletionLogprobsBuilder(
        tokenizer, num_top, skip_special_tokens=req.skip_special_tokens is not False
    )


def _echo_logprobs(
    builder: CompletionLogprobsBuilder,
    prompt: Prompt,
    prompt_text: str,
    output: RequestOutput,
    out: CompletionOutput,
) -> dict[str, list[Any]]:
    """Logprobs of the echoed prompt, then of the generated tokens (built in that order: offsets run on)."""
    ids = prompt[1]
    echoed = builder.build_prompt(ids, output.prompt_logprobs or [None] * len(ids), prompt_text)
    generated = builder.build(out.token_ids, out.logprobs)
    return {k: echoed[k] + generated[k] for k in echoed}


def _full_response(
    req: CompletionRequest,
    tokenizer: Tokenizer,
    model: str,
    request_id: str,
    created: int,
    prompts: list[Prompt],
    finals: list[RequestOutput],
    n: int,
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for prompt_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
        prompt_text = _prompt_text(prompt, tokenizer) if req.echo else ""
        for out in sorted(final.outputs, key=lambda o: o.index):
            completion_tokens += out.num_output_tokens or len(out.token_ids)
            logprobs: dict[str, list[Any]] | None = None
            if req.logprobs is not None:
                builder = _logprobs_builder(req, tokenizer, req.logprobs)
                if req.echo:
                    logprobs = _echo_logprobs(builder, prompt, prompt_text, final, out)
                else:
                    logprobs = builder.build(out.token_ids, out.logprobs)
            choices.append(
                {
                    "index": prompt_index * n + out.index,
                    "text": prompt_text + out.text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(out.finish_reason) or "length",
                    "stop_reason": out.stop_reason,
                }
            )
    choices.sort(key=lambda c: c["index"])
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    cached = sum(f.num_cached_tokens for f in finals)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_block(prompt_tokens, completion_tokens, cached),
        "system_fingerprint": None,
    }


class _CompletionStream(ChunkStream):
    """Turns delta RequestOutputs into OpenAI completion chunks, one choice per chunk."""

    object_name = "text_completion"
    req: CompletionRequest

    def __init__(
        self,
        req: CompletionRequest,
        tokenizer: Tokenizer,
        model: str,
        request_id: str,
        created: int,
        prompts: list[Prompt],
        n: int,
        with_metrics: bool,
    ) -> None:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        super().__init__(req, tokenizer, model, request_id, created, prompt_tokens, n, with_metrics)
        self.prompts = prompts
        self.builders: dict[int, CompletionLogprobsBuilder] = {}
        self.echoed: set[int] = set()

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        frames = []
        self.cached[prompt_index] = output.num_cached_tokens
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            self._count(index, out)
            text = out.text
            logprobs = None
            builder = self.builders.get(index)
            if self.req.logprobs is not None and builder is None:
                builder = self.builders[index] = _logprobs_builder(
                    self.req, self.tokenizer, self.req.logprobs
                )
            if self.req.echo and index not in self.echoed:
                self.echoed.add(index)
                prompt = self.prompts[prompt_index]
                prompt_text = _prompt_text(prompt, self.tokenizer)
                text = prompt_text + text
                if builder is not None:
                    logprobs = _echo_logprobs(builder, prompt, prompt_text, output, out)
            elif builder is not None:
                logprobs = builder.build(out.token_ids, out.logprobs)
            reason = finish_reason(out.finish_reason)
            if not text and reason is None and not (logprobs and logprobs["tokens"]):
                continue  # e.g. half a multi-byte character: nothing to show yet
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": out.stop_reason,
            }
            frames.append(self._chunk([choice]))
        return frames
