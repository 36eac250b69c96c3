"""POST /v1/chat/completions: chat template, n, chat-format logprobs with bytes, SSE with role deltas."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import InvalidRequestError, RequestOutput
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
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest, ChatMessage
from server.sse import sse_response
from server.state import ServerState
from server.streaming import ChunkStream, usage_block

if TYPE_CHECKING:
    from engine import Tokenizer


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
    tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    try:
        return list(
            tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=add_generation_prompt
            )
        )
    except InvalidRequestError as e:
        raise invalid_request(
            f"Cannot apply the chat template: {e}. Serve the model with --chat-template FILE.",
            "messages",
        ) from None


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
    num_top = req.top_logprobs or 0
    params = build_sampling_params(
        req,
        n=n,
        best_of=None,
        max_tokens=max_tokens,
        logprobs=num_top if req.logprobs else None,
        prompt_logprobs=None,
        output_kind="delta" if req.stream else "final",
    )
    check_prompts(engine, [prompt_ids], params, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    outputs = merge_outputs(
        start_streams(engine, request_id, [(None, prompt_ids)], params, raw), raw
    )
    try:
        first = await first_output(outputs, "messages")
    except ClientDisconnected:
        return Response(status_code=499)
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
        "usage": usage_block(len(prompt_ids), completion_tokens, final.num_cached_tokens),
        "system_fingerprint": None,
    }
    return JSONResponse(body)


class _ChatStream(ChunkStream):
    """Delta RequestOutputs -> chat.completion.chunk frames; the first delta of each choice has the role."""

    object_name = "chat.completion.chunk"
    error_param = "messages"
    req: ChatCompletionRequest

    def __init__(
        self,
        req: ChatCompletionRequest,
        tokenizer: Tokenizer,
        model: str,
        request_id: str,
        created: int,
        prompt_tokens: int,
        n: int,
        num_top: int,
    ) -> None:
        super().__init__(req, tokenizer, model, request_id, created, prompt_tokens, n)
        self.num_top = num_top
        self.pending_logprobs: dict[int, list[Any]] = {}  # tokens whose text is still held back

    def _opening_frames(self) -> list[str]:
        roles = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for index in range(self.n)
        ]
        return [self._chunk([role]) for role in roles]

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        frames = []
        self.cached[prompt_index] = output.num_cached_tokens
        for out in output.outputs:
            self._count(out.index, out)
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
