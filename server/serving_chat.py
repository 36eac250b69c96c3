"""POST /v1/chat/completions: chat template, n, chat-format logprobs with bytes, SSE with role deltas."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import RequestOutput
from server.errors import invalid_request, to_api_error
from server.generation import (
    ClientDisconnected,
    build_sampling_params,
    check_prompt_ids,
    check_stream_options,
    finish_reason,
    merge_outputs,
    start_streams,
)
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest, ChatMessage
from server.sse import DONE_FRAME, sse_frame, sse_response
from server.state import ServerState


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """API messages -> the plain {role, content} dicts chat templates expect."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        entry = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def apply_template(
    tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    try:
        return list(
            tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=add_generation_prompt
            )
        )
    except ValueError as e:
        raise invalid_request(
            f"Cannot apply the chat template: {e}. Serve the model with --chat-template FILE.",
            "messages",
        ) from None


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, state: ServerState
) -> Response:
    engine = state.require_engine()
    model = state.check_model(req.model)
    tokenizer = engine.tokenizer
    check_stream_options(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    if max_tokens == 0:
        raise invalid_request(f"{param} must be at least 1 for chat completions", param)
    n = req.n or 1
    prompt_ids = apply_template(tokenizer, req.messages, req.add_generation_prompt is not False)
    check_prompt_ids(prompt_ids, tokenizer.vocab_size, engine.max_model_len, max_tokens, "messages")
    num_top = req.top_logprobs or 0
    params = build_sampling_params(
        req,
        n=n,
        best_of=None,
        max_tokens=max_tokens,
        logprobs=num_top if req.logprobs else None,
        prompt_logprobs=None,
        output_kind="delta" if req.stream else "final",
        vocab_size=tokenizer.vocab_size,
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outputs = merge_outputs(
        start_streams(engine, request_id, [(None, prompt_ids)], params, raw), raw
    )
    try:
        first = await anext(outputs)
    except StopAsyncIteration:
        first = None
    except ClientDisconnected:
        return Response(status_code=499)
    except BaseException:
        await outputs.aclose()
        raise
    if req.stream:
        stream = _ChatStream(
            req, tokenizer, model, request_id, created, len(prompt_ids), n, num_top
        )
        return sse_response(stream.frames(first, outputs))
    final = first[1] if first is not None else None
    try:
        async for _, output in outputs:
            final = output
    except ClientDisconnected:
        return Response(status_code=499)
    assert final is not None, "the engine ended a request without output"
    choices = []
    completion_tokens = 0
    for out in sorted(final.outputs, key=lambda o: o.index):
        completion_tokens += out.num_output_tokens or len(out.token_ids)
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": chat_logprobs(tokenizer, out.logprobs or [], num_top),
                "refusal": None,
            }
        choices.append(
            {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text, "refusal": None},
                "logprobs": logprobs,
                "finish_reason": finish_reason(out.finish_reason) or "length",
                "stop_reason": out.stop_reason,
            }
        )
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(len(prompt_ids), completion_tokens, final.num_cached_tokens),
        "system_fingerprint": None,
    }
    return JSONResponse(body)


class _ChatStream:
    """Delta RequestOutputs -> chat.completion.chunk frames; the first delta of each choice has the role."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        tokenizer: Any,
        model: str,
        request_id: str,
        created: int,
        prompt_tokens: int,
        n: int,
        num_top: int,
    ) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.model = model
        self.request_id = request_id
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.num_top = num_top
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.output_tokens: dict[int, int] = {}
        self.pending_logprobs: dict[int, list[Any]] = {}  # tokens whose text is still held back
        self.cached = 0

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, last: bool = False
    ) -> str:
        payload: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.include_usage:
            payload["usage"] = usage
        return sse_frame(payload)

    def _frames_for(self, output: RequestOutput) -> list[str]:
        frames = []
        self.cached = output.num_cached_tokens
        for out in output.outputs:
            self.output_tokens[out.index] = out.num_output_tokens or self.output_tokens.get(
                out.index, 0
            ) + len(out.token_ids)
            reason = finish_reason(out.finish_reason)
            pending = self.pending_logprobs.setdefault(out.index, [])
            pending.extend(out.logprobs or [])
            if not out.text and reason is None:
                continue
            delta = {"content": out.text} if out.text else {}
            logprobs = None
            if self.req.logprobs:
                logprobs = {
                    "content": chat_logprobs(self.tokenizer, pending, self.num_top),
                    "refusal": None,
                }
            self.pending_logprobs[out.index] = []
            choice = {
                "index": out.index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            if reason is not None:
                choice["stop_reason"] = out.stop_reason
            frames.append(self._chunk([choice]))
        return frames

    async def frames(
        self,
        first: tuple[int, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncIterator[str]:
        try:
            for index in range(self.n):
                role = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield self._chunk([role])
            if first is not None:
                for frame in self._frames_for(first[1]):
                    yield frame
            async for _, output in outputs:
                for frame in self._frames_for(output):
                    yield frame
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - reported in-band: the 200 status is already sent
            yield sse_frame(to_api_error(e, "messages").body())
            return
        finally:
            await outputs.aclose()
        if self.include_usage:
            usage = _usage(self.prompt_tokens, sum(self.output_tokens.values()), self.cached)
            yield self._chunk([], usage)
        yield DONE_FRAME
