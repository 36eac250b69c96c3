"""POST /v1/chat/completions: chat template, n, chat-format logprobs with bytes, SSE with role deltas,
structured outputs and tool calls (planned and parsed by server/tool_calling.py)."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import EngineClient, InvalidRequestError, RequestOutput, SamplingParams, ToolPlan
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
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest, ChatMessage
from server.sse import sse_response
from server.state import ServerState
from server.streaming import ChunkStream, usage_block
from server.structured_outputs import request_constraint
from server.tool_calling import (
    ToolCallDeltas,
    check_tool_messages,
    parse_tool_calls,
    template_messages,
    tool_plan,
)

if TYPE_CHECKING:
    from engine import Tokenizer
    from server.chat_translation import FieldNames

# The SSE frames of a streamed response from its first output and the rest of the outputs.
StreamFrames = Callable[
    [tuple[int, RequestOutput] | None, AsyncGenerator[tuple[int, RequestOutput], None]],
    AsyncIterator[str],
]


# Variables the server itself gives the chat template; chat_template_kwargs cannot set them.
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "chat_template", "tokenize")


def template_kwargs(req: ChatCompletionRequest, state: ServerState) -> dict[str, Any]:
    """The server's --chat-template-kwargs overridden by the request's chat_template_kwargs."""
    own = dict(req.chat_template_kwargs or {})
    for key in own:
        if key in _TEMPLATE_OWN:
            raise invalid_request(
                f"chat_template_kwargs cannot set {key!r}: the server gives the template that "
                "variable itself",
                "chat_template_kwargs",
            )
    return {**(state.config.chat_template_kwargs or {}), **own}


def apply_template(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    plan: ToolPlan | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], str]:
    """The prompt's token ids and its text (which says where a reasoning block stands)."""
    check_tool_messages(messages)
    try:
        tools = plan.template_tools if plan is not None else None
        text = tokenizer.render_chat_template(
            template_messages(messages, plan),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=kwargs,
        )
        # The rendered text already holds any BOS the template wants, like transformers does.
        return list(tokenizer.encode(text, add_special_tokens=False)), text
    except InvalidRequestError as e:
        raise invalid_request(
            f"Cannot apply the chat template: {e}. Serve the model with --chat-template FILE.",
            "messages",
        ) from None


@dataclass(frozen=True)
class ChatGeneration:
    """A validated chat request ready for the engine: what every chat-shaped API surface runs."""

    model: str
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_top: int  # top logprobs per token (0: none)
    plan: ToolPlan | None = None  # the request's tools: how they are prompted, forced and parsed
    parallel_tool_calls: bool | None = None
    thinking: bool = False  # a reasoning parser is on: outputs report their reasoning apart

    def open(
        self, engine: EngineClient, raw: Request | None
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Start the engine request; the outputs stream aborts it when closed or when `raw` disconnects."""
        streams = start_streams(
            engine, self.request_id, [(None, self.prompt_ids)], self.params, raw
        )
        return merge_outputs(streams, raw)

    async def respond(
        self,
        engine: EngineClient,
        raw: Request,
        stream: StreamFrames | None,
        finish: Callable[[RequestOutput], Response],
        prompt_param: str = "messages",
        names: FieldNames | None = None,
    ) -> Response:
        """Run the request: refused, an HTTP error (fields renamed by `names`); streamed, the SSE frames
        of `stream`; else `finish` of the last output. 499 once the client has gone."""
        outputs = self.open(engine, raw)
        try:
            with names.renamed() if names is not None else contextlib.nullcontext():
                first = await first_output(outputs, prompt_param)
            if stream is not None:
                return sse_response(stream(first, outputs))
            final = first[1] if first is not None else None
            async for _, output in outputs:
                final = output
        except ClientDisconnected:
            return Response(status_code=499)
        assert final is not None and final.outputs, "the engine ended a request without output"
        return finish(final)


def prepare_chat(
    req: ChatCompletionRequest, state: ServerState, request_id: str | None = None
) -> ChatGeneration:
    """Check a chat request and turn it into prompt token ids and sampling params (400s name the field)."""
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
    constraint = request_constraint(req)
    plan = tool_plan(
        req,
        tokenizer.chat_template,
        state.config.tool_call_parser,
        constraint,
        tokenizer.added_tokens,
    )
    if plan is not None:
        constraint = plan.constraint  # tool calls, the requested answer, or both
    prompt_ids, prompt_text = apply_template(
        tokenizer,
        req.messages,
        req.add_generation_prompt is not False,
        plan,
        template_kwargs(req, state),
    )
    reasoning = state.reasoning_parser(tokenizer.chat_template)
    fmt = reasoning.format_for(prompt_text) if reasoning is not None else None
    num_top = req.top_logprobs or 0
    params = build_sampling_params(
        req,
        n=req.n or 1,
        best_of=None,
        max_tokens=max_tokens,
        logprobs=num_top if req.logprobs else None,
        prompt_logprobs=None,
        output_kind="delta" if req.stream else "final",
        structured_outputs=constraint,
        reasoning=fmt,
    )
    check_prompts(engine, [prompt_ids], params, "messages")
    return ChatGeneration(
        model,
        request_id or f"chatcmpl-{uuid.uuid4().hex}",
        prompt_ids,
        params,
        num_top,
        plan,
        req.parallel_tool_calls,
        reasoning is not None,
    )


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, state: ServerState
) -> Response:
    gen = prepare_chat(req, state)
    engine = state.require_engine()
    created = int(time.time())
    with_metrics = wants_metrics(req.return_metrics, raw)
    stream = None
    if req.stream:
        stream = _ChatStream(
            req,
            engine.tokenizer,
            gen.model,
            gen.request_id,
            created,
            len(gen.prompt_ids),
            gen.params.n,
            gen.num_top,
            gen.plan,
            with_metrics,
            gen.thinking,
        ).frames

    def finish(final: RequestOutput) -> Response:
        body = _completion(req, gen, engine.tokenizer, final, created)
        if with_metrics:
            body["metrics"] = cost_sheet([final])
        return JSONResponse(body)

    return await gen.respond(engine, raw, stream, finish)


def _completion(
    req: ChatCompletionRequest,
    gen: ChatGeneration,
    tokenizer: Tokenizer,
    final: RequestOutput,
    created: int,
) -> dict[str, Any]:
    """The chat.completion object of a finished request."""
    choices = []
    completion_tokens = reasoning_tokens = 0
    for out in sorted(final.outputs, key=lambda o: o.index):
        completion_tokens += out.num_output_tokens or len(out.token_ids)
        reasoning_tokens += out.num_reasoning_tokens
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": chat_logprobs(tokenizer, out.logprobs or [], gen.num_top),
                "refusal": None,
            }
        content, tool_calls = parse_tool_calls(out.text, gen.plan, req.parallel_tool_calls)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if gen.thinking:  # both names: clients read either
            message["reasoning_content"] = message["reasoning"] = out.reasoning or None
        reason = finish_reason(out.finish_reason) or "length"
        if tool_calls:
            message["tool_calls"] = tool_calls
            reason = "tool_calls" if reason == "stop" else reason
        choices.append(
            {
                "index": out.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
                "stop_reason": out.stop_reason,
            }
        )
    return {
        "id": gen.request_id,
        "object": "chat.completion",
        "created": created,
        "model": gen.model,
        "choices": choices,
        "usage": usage_block(
            len(gen.prompt_ids),
            completion_tokens,
            final.num_cached_tokens,
            reasoning_tokens if gen.thinking else None,
        ),
        "system_fingerprint": None,
    }


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
        plan: ToolPlan | None = None,
        with_metrics: bool = False,
        thinking: bool = False,
    ) -> None:
        super().__init__(req, tokenizer, model, request_id, created, prompt_tokens, n, with_metrics)
        self.thinking = thinking
        self.num_top = num_top
        self.pending_logprobs: dict[int, list[Any]] = {}  # tokens whose text is still held back
        self.tool_deltas: dict[int, ToolCallDeltas] | None = None
        if plan is not None and plan.parse_calls:
            self.tool_deltas = {i: ToolCallDeltas(plan, req.parallel_tool_calls) for i in range(n)}

    def _opening_frames(self, first: RequestOutput | None) -> list[str]:
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
            if out.reasoning:  # before the answer's deltas, in a chunk of its own
                frames.append(self._reasoning_frame(out.index, out.reasoning))
                pending = self.pending_logprobs[out.index]
            if self.tool_deltas is not None:
                frames.extend(self._tool_frames(out.index, out.text, reason, out.stop_reason))
                continue
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

    def _reasoning_frame(self, index: int, reasoning: str) -> str:
        """A reasoning delta (both names, as in the whole message); pending logprobs ride on it."""
        logprobs = None
        if self.req.logprobs:
            logprobs = {
                "content": chat_logprobs(
                    self.tokenizer, self.pending_logprobs.get(index, []), self.num_top
                ),
                "refusal": None,
            }
            self.pending_logprobs[index] = []
        delta = {"reasoning_content": reasoning, "reasoning": reasoning}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return self._chunk([choice])

    def _tool_frames(
        self, index: int, text: str, reason: str | None, stop_reason: Any
    ) -> list[str]:
        """Content and tool-call deltas of one choice; logprobs ride on its first frame."""
        assert self.tool_deltas is not None
        parser = self.tool_deltas[index]
        deltas = parser.deltas(text, final=reason is not None)
        if reason is not None:
            if parser.called and reason == "stop":
                reason = "tool_calls"
            deltas.append({})
        frames = []
        for k, delta in enumerate(deltas):
            logprobs = None
            if self.req.logprobs and k == 0:
                logprobs = {
                    "content": chat_logprobs(
                        self.tokenizer, self.pending_logprobs.get(index, []), self.num_top
                    ),
                    "refusal": None,
                }
                self.pending_logprobs[index] = []
            last = k == len(deltas) - 1 and reason is not None
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": reason if last else None,
            }
            if last:
                choice["stop_reason"] = stop_reason
            frames.append(self._chunk([choice]))
        return frames
