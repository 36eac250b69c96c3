"""POST /v1/chat/completions: the chat request as a GenerationPlan (chat template, tools, structured
outputs), rendered from turn events as chat.completion objects and SSE chunks (role deltas, content and
tool-call deltas, chat-format logprobs with bytes). plan_turn plans the turn that chat, Responses and
Messages each parse their request into (server/turn_request.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import InvalidRequestError, RequestOutput
from engine.text import ToolPlan
from server.cost_sheet import cost_sheet, wants_metrics
from server.errors import APIError, context_length_exceeded, invalid_request
from server.field_map import CHAT_FIELDS, FieldMap
from server.generation import (
    build_sampling_params,
    check_prompt_logprobs,
    check_prompts,
    check_stream_options,
    truncate_prompt,
)
from server.logprobs import chat_logprobs, prompt_logprobs
from server.plan import GenerationPlan
from server.protocol import ChatCompletionRequest, NamedToolChoice
from server.settings import TEMPLATE_OWN_VARIABLES
from server.state import ServerState
from server.streaming import ChunkStream, usage_block
from server.structured_outputs import request_constraint
from server.tool_calling import check_tool_messages, template_messages, tool_plan
from server.turn import (
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
    TurnDelta,
    TurnStep,
)
from server.turn_request import (
    NamedTool,
    Sampling,
    ToolSpec,
    TurnMessage,
    TurnRequest,
    turn_messages,
)

if TYPE_CHECKING:
    from engine import Tokenizer, TokenLogprob


def template_kwargs(own: Mapping[str, Any], state: ServerState) -> dict[str, Any]:
    """The server's --chat-template-kwargs overridden by the request's own template variables."""
    for key in own:
        if key in TEMPLATE_OWN_VARIABLES:
            raise invalid_request(
                f"chat_template_kwargs cannot set {key!r}: the server gives the template that "
                "variable itself",
                "chat_template_kwargs",
            )
    return {**(state.config.chat_template_kwargs or {}), **own}


def apply_template(
    tokenizer: Tokenizer,
    messages: Sequence[TurnMessage],
    add_generation_prompt: bool,
    plan: ToolPlan | None = None,
    kwargs: dict[str, Any] | None = None,
    fields: FieldMap = CHAT_FIELDS,
    add_special_tokens: bool = False,
) -> tuple[list[int], str]:
    """The prompt's token ids and its text (which says where a reasoning block stands);
    `add_special_tokens` adds the tokenizer's own (a BOS) to what the template wrote."""
    check_tool_messages(messages, fields)
    try:
        tools = plan.template_tools if plan is not None else None
        text = tokenizer.render_chat_template(
            template_messages(messages, plan),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=kwargs,
        )
        # The rendered text already holds any BOS the template wants, like transformers does.
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens)), text
    except InvalidRequestError as e:
        raise invalid_request(
            f"Cannot apply the chat template: {e}. Serve the model with --chat-template FILE.",
            fields.name("messages"),
        ) from None


def chat_turn(req: ChatCompletionRequest) -> TurnRequest:
    """A chat request as the turn it asks for (its own shape checks done here)."""
    check_stream_options(req)
    check_prompt_logprobs(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    choice = req.tool_choice
    return TurnRequest(
        model=req.model,
        messages=turn_messages(req.messages),
        sampling=Sampling.of(req),
        stream=bool(req.stream),
        max_tokens=max_tokens,
        max_tokens_field=field,
        n=req.n or 1,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs,
        constraint=request_constraint(req, CHAT_FIELDS),
        tools=[
            ToolSpec(
                t.function.name, t.function.description, t.function.parameters, t.function.strict
            )
            for t in req.tools or ()
        ],
        tool_choice=NamedTool(choice.function.name)
        if isinstance(choice, NamedToolChoice)
        else choice,
        parallel_tool_calls=req.parallel_tool_calls,
        add_generation_prompt=req.add_generation_prompt is not False,
        add_special_tokens=bool(req.add_special_tokens),
        template_kwargs=effort_kwargs(req.reasoning_effort) | (req.chat_template_kwargs or {}),
        cache_salt=req.cache_salt,
        prompt_logprobs=req.prompt_logprobs,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """A reasoning effort as the chat template variable vLLM gives it (nothing when not asked)."""
    return {"reasoning_effort": effort} if effort is not None else {}


def plan_turn(
    req: TurnRequest,
    state: ServerState,
    request_id: str | None = None,
    fields: FieldMap = CHAT_FIELDS,
) -> GenerationPlan:
    """Check a turn against the engine and plan it: prompt token ids, sampling params, constraint
    and tools, every check done here once (400s name the field through `fields`, the surface's
    names)."""
    engine = state.require_engine()
    served = state.resolve_model(req.model)
    tokenizer = engine.tokenizer
    if req.max_tokens == 0:
        name = fields.name(req.max_tokens_field)
        raise invalid_request(f"{name} must be at least 1 for chat completions", name)
    if not req.messages:
        raise invalid_request(f"{fields.prompt} has no messages to answer", fields.prompt)
    constraint = req.constraint
    plan = tool_plan(
        req,
        tokenizer.chat_template,
        state.config.tool_call_parser,
        constraint,
        fields,
        tokenizer.added_tokens,
    )
    if plan is not None:
        constraint = plan.constraint  # tool calls, the requested answer, or both
    prompt_ids, prompt_text = apply_template(
        tokenizer,
        req.messages,
        req.add_generation_prompt,
        plan,
        template_kwargs(req.template_kwargs, state),
        fields,
        req.add_special_tokens,
    )
    prompt_ids = truncate_prompt(prompt_ids, req.truncate_prompt_tokens, engine.max_model_len)
    reasoning = state.reasoning_parser(tokenizer.chat_template)
    fmt = reasoning.format_for(prompt_text) if reasoning is not None else None
    num_top = req.top_logprobs or 0
    params = build_sampling_params(
        req.sampling,
        n=req.n,
        best_of=None,
        max_tokens=req.max_tokens,
        logprobs=num_top if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        output_kind="delta" if req.stream else "final",
        structured_outputs=constraint,
        reasoning=fmt,
    )
    try:
        check_prompts(engine, [prompt_ids], params, fields)
    except APIError as e:
        limit, asked = engine.max_model_len, req.max_tokens
        if (
            e.code == "context_length_exceeded"
            and fields.over_length is not None
            and asked is not None
            and len(prompt_ids) < limit < len(prompt_ids) + asked
        ):
            raise context_length_exceeded(e.message, fields.over_length) from None
        raise
    return GenerationPlan(
        engine,
        served.name,
        request_id or f"chatcmpl-{uuid.uuid4().hex}",
        [(None, prompt_ids)],
        params,
        fields,
        num_top,
        plan,
        req.parallel_tool_calls,
        reasoning is not None,
        lora=served.lora,
        cache_salt=req.cache_salt,
    )


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, state: ServerState
) -> Response:
    plan = plan_turn(chat_turn(req), state)
    tokenizer = plan.engine.tokenizer
    created = int(time.time())
    with_metrics = wants_metrics(req.return_metrics, raw)
    stream = None
    if req.stream:
        stream = _ChatStream(plan, req, tokenizer, created, with_metrics).frames

    def finish(finals: list[RequestOutput]) -> Response:
        body = _completion(req, plan, tokenizer, finals[0], created)
        if with_metrics:
            body["metrics"] = cost_sheet(finals)
        return JSONResponse(body)

    return await plan.respond(raw, stream, finish)


def _completion(
    req: ChatCompletionRequest,
    plan: GenerationPlan,
    tokenizer: Tokenizer,
    final: RequestOutput,
    created: int,
) -> dict[str, Any]:
    """The chat.completion object of a finished request."""
    choices = []
    completion_tokens = reasoning_tokens = 0
    for out in sorted(final.outputs, key=lambda o: o.index):
        turn = plan.final_turn(out)
        completion_tokens += turn.output_tokens
        reasoning_tokens += turn.reasoning_tokens
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": chat_logprobs(
                    tokenizer,
                    out.logprobs or [],
                    plan.num_top,
                    bool(req.return_tokens_as_token_ids),
                ),
                "refusal": None,
            }
        message: dict[str, Any] = {"role": "assistant", "content": turn.content, "refusal": None}
        if plan.thinking:  # both names: clients read either
            message["reasoning_content"] = message["reasoning"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [call.chat_dict() for call in turn.tool_calls]
        choices.append(
            {
                "index": out.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": turn.end.value,
                "stop_reason": turn.stop_reason,
            }
        )
    body = {
        "id": plan.request_id,
        "object": "chat.completion",
        "created": created,
        "model": plan.model,
        "choices": choices,
        "usage": usage_block(
            plan.num_prompt_tokens,
            completion_tokens,
            final.num_cached_tokens,
            reasoning_tokens if plan.thinking else None,
        ),
        "system_fingerprint": None,
    }
    if req.prompt_logprobs is not None:  # vLLM's place: the response, not a choice
        body["prompt_logprobs"] = prompt_logprobs(
            tokenizer,
            plan.prompt_ids,
            final.prompt_logprobs,
            req.prompt_logprobs,
            bool(req.return_tokens_as_token_ids),
        )
    return body


def _chat_delta(delta: TurnDelta) -> dict[str, Any]:
    """A turn delta as chat's `delta`: content, a call's header, or a piece of its arguments."""
    if isinstance(delta, TextDelta):
        return {"content": delta.text}
    if isinstance(delta, ToolCallStart):
        call = {"name": delta.name, "arguments": ""}
        header = {"index": delta.call, "id": delta.id, "type": "function", "function": call}
        return {"tool_calls": [header]}
    assert isinstance(delta, ToolCallArguments), "reasoning goes in a chunk of its own"
    return {"tool_calls": [{"index": delta.call, "function": {"arguments": delta.text}}]}


class _ChatStream(ChunkStream):
    """Turn events -> chat.completion.chunk frames; the first delta of each choice has the role."""

    object_name = "chat.completion.chunk"
    req: ChatCompletionRequest

    def __init__(
        self,
        plan: GenerationPlan,
        req: ChatCompletionRequest,
        tokenizer: Tokenizer,
        created: int,
        with_metrics: bool = False,
    ) -> None:
        super().__init__(plan, req, tokenizer, created, with_metrics)
        self.pending_logprobs: dict[int, list[TokenLogprob]] = {}  # tokens whose text is held back

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

    def _logprobs(self, index: int) -> dict[str, Any] | None:
        """The held logprobs of choice `index`, taken: they ride on its next frame."""
        if not self.req.logprobs:
            return None
        pending, self.pending_logprobs[index] = self.pending_logprobs.get(index, []), []
        return {
            "content": chat_logprobs(
                self.tokenizer,
                pending,
                self.plan.num_top,
                bool(self.req.return_tokens_as_token_ids),
            ),
            "refusal": None,
        }

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        frames = []
        self.cached[prompt_index] = output.num_cached_tokens
        for out in output.outputs:
            turn, step = self._feed(out.index, out)
            if step.logprobs:
                self.pending_logprobs.setdefault(out.index, []).extend(step.logprobs)
            deltas = step.deltas
            if deltas and isinstance(deltas[0], ReasoningDelta):
                frames.append(self._reasoning_frame(out.index, deltas[0]))  # a chunk of its own
                deltas = deltas[1:]
            if turn.parses_tools:
                frames.extend(self._tool_frames(out.index, deltas, step))
                continue
            if not deltas and step.finish is None:
                continue
            text = deltas[0] if deltas else None  # without tools: text, at most once
            choice: dict[str, Any] = {
                "index": out.index,
                "delta": {"content": text.text} if isinstance(text, TextDelta) else {},
                "logprobs": self._logprobs(out.index) if self.req.logprobs else None,
                "finish_reason": step.finish.end.value if step.finish else None,
            }
            if step.finish is not None:
                choice["stop_reason"] = step.finish.stop_reason
            frames.append(self._chunk([choice]))
        return frames

    def _reasoning_frame(self, index: int, delta: ReasoningDelta) -> str:
        """A reasoning delta (both names, as in the whole message); pending logprobs ride on it."""
        reasoning = {"reasoning_content": delta.text, "reasoning": delta.text}
        choice = {
            "index": index,
            "delta": reasoning,
            "logprobs": self._logprobs(index) if self.req.logprobs else None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def _tool_frames(self, index: int, turn_deltas: list[TurnDelta], step: TurnStep) -> list[str]:
        """Content and tool-call deltas of one choice, one frame each, then an empty delta with the
        finish; logprobs ride on its first frame."""
        deltas = [_chat_delta(d) for d in turn_deltas]
        if step.finish is not None:
            deltas.append({})
        frames = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1 and step.finish is not None
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": self._logprobs(index) if k == 0 else None,
                "finish_reason": step.finish.end.value if last and step.finish else None,
            }
            if last and step.finish is not None:
                choice["stop_reason"] = step.finish.stop_reason
            frames.append(self._chunk([choice]))
        return frames
