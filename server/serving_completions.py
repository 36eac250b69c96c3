"""POST /v1/completions: prompts (text, ids, or lists of them) as a GenerationPlan; n/best_of, echo,
legacy logprobs; rendered from turn events as text_completion objects and SSE chunks."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import CompletionOutput, RequestOutput
from server.cost_sheet import cost_sheet, wants_metrics
from server.errors import invalid_request
from server.field_map import COMPLETION_FIELDS
from server.generation import build_sampling_params, check_prompts, check_stream_options
from server.logprobs import CompletionLogprobsBuilder
from server.plan import GenerationPlan, Prompt
from server.protocol import DEFAULT_COMPLETION_MAX_TOKENS, CompletionRequest
from server.state import ServerState
from server.streaming import ChunkStream, usage_block
from server.structured_outputs import request_constraint
from server.turn_request import Sampling

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


def prepare_completion(req: CompletionRequest, state: ServerState) -> GenerationPlan:
    """Check a completions request and plan it: one engine request per prompt (400s name the field)."""
    engine = state.require_engine()
    served = state.resolve_model(req.model)
    check_stream_options(req)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    prompts = _prompts(req, engine.tokenizer)
    max_prompts = engine.max_queued_requests
    if len(prompts) > max_prompts:
        raise invalid_request(
            f"Too many prompts ({len(prompts)}); this server takes at most {max_prompts} per request.",
            "prompt",
        )
    want_prompt_logprobs = bool(req.echo) and req.logprobs is not None
    params = build_sampling_params(
        Sampling.of(req),
        n=req.n or 1,
        best_of=req.best_of,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if want_prompt_logprobs else None,
        output_kind="delta" if req.stream else "final",
        structured_outputs=request_constraint(req, COMPLETION_FIELDS),
    )
    check_prompts(engine, [ids for _, ids in prompts], params, COMPLETION_FIELDS)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return GenerationPlan(
        engine, served.name, request_id, prompts, params, COMPLETION_FIELDS, lora=served.lora
    )


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Response:
    plan = prepare_completion(req, state)
    tokenizer = plan.engine.tokenizer
    with_metrics = wants_metrics(req.return_metrics, raw)
    created = int(time.time())
    stream = None
    if req.stream:
        stream = _CompletionStream(plan, req, tokenizer, created, with_metrics).frames

    def finish(finals: list[RequestOutput]) -> Response:
        body = _full_response(req, tokenizer, plan, created, finals)
        if with_metrics:
            body["metrics"] = cost_sheet(finals)
        return JSONResponse(body)

    return await plan.respond(raw, stream, finish)


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
    plan: GenerationPlan,
    created: int,
    finals: list[RequestOutput],
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    n = plan.params.n
    for prompt_index, (prompt, final) in enumerate(zip(plan.prompts, finals, strict=True)):
        prompt_text = _prompt_text(prompt, tokenizer) if req.echo else ""
        for out in sorted(final.outputs, key=lambda o: o.index):
            turn = plan.final_turn(out)
            completion_tokens += turn.output_tokens
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
                    "finish_reason": turn.end.value,
                    "stop_reason": turn.stop_reason,
                }
            )
    choices.sort(key=lambda c: c["index"])
    cached = sum(f.num_cached_tokens for f in finals)
    return {
        "id": plan.request_id,
        "object": "text_completion",
        "created": created,
        "model": plan.model,
        "choices": choices,
        "usage": usage_block(plan.num_prompt_tokens, completion_tokens, cached),
        "system_fingerprint": None,
    }


class _CompletionStream(ChunkStream):
    """Turns delta RequestOutputs into OpenAI completion chunks, one choice per chunk."""

    object_name = "text_completion"
    req: CompletionRequest

    def __init__(
        self,
        plan: GenerationPlan,
        req: CompletionRequest,
        tokenizer: Tokenizer,
        created: int,
        with_metrics: bool = False,
    ) -> None:
        super().__init__(plan, req, tokenizer, created, with_metrics)
        self.prompts = plan.prompts
        self.builders: dict[int, CompletionLogprobsBuilder] = {}
        self.echoed: set[int] = set()

    def _frames_for(self, prompt_index: int, output: RequestOutput) -> list[str]:
        frames = []
        self.cached[prompt_index] = output.num_cached_tokens
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            _, step = self._feed(index, out)
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
            reason = step.finish.end.value if step.finish is not None else None
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
