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
from server.generation import (
    build_sampling_params,
    check_prompt_logprobs,
    check_prompts,
    check_stream_options,
    truncate_prompt,
)
from server.logprobs import CompletionLogprobsBuilder, prompt_logprobs
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
    special = req.add_special_tokens is not False
    if isinstance(p, str):
        return [(p, tokenizer.encode(p, add_special_tokens=special))]
    if all(isinstance(x, str) for x in p):
        return [(text, tokenizer.encode(text, add_special_tokens=special)) for text in p]
    if all(isinstance(x, int) for x in p):
        return [(None, list(p))]
    return [(None, list(ids)) for ids in p]


def _truncated(prompts: list[Prompt], keep: int | None, max_model_len: int) -> list[Prompt]:
    """Prompts cut to their last `keep` tokens; a cut text prompt is echoed from its tokens."""
    out: list[Prompt] = []
    for text, ids in prompts:
        kept = truncate_prompt(ids, keep, max_model_len)
        out.append((text if len(kept) == len(ids) else None, kept))
    return out


def prepare_completion(req: CompletionRequest, state: ServerState) -> GenerationPlan:
    """Check a completions request and plan it: one engine request per prompt (400s name the field)."""
    engine = state.require_engine()
    served = state.resolve_model(req.model)
    check_stream_options(req)
    check_prompt_logprobs(req)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    prompts = _truncated(
        _prompts(req, engine.tokenizer), req.truncate_prompt_tokens, engine.max_model_len
    )
    max_prompts = engine.max_queued_requests
    if len(prompts) > max_prompts:
        raise invalid_request(
            f"Too many prompts ({len(prompts)}); this server takes at most {max_prompts} per request.",
            "prompt",
        )
    echoed = req.logprobs if req.echo and req.logprobs is not None else None
    wanted = [n for n in (echoed, req.prompt_logprobs) if n is not None]
    params = build_sampling_params(
        Sampling.of(req),
        n=req.n or 1,
        best_of=req.best_of,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=max(wanted) if wanted else None,
        output_kind="delta" if req.stream else "final",
        structured_outputs=request_constraint(req, COMPLETION_FIELDS),
    )
    check_prompts(engine, [ids for _, ids in prompts], params, COMPLETION_FIELDS)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    return GenerationPlan(
        engine,
        served.name,
        request_id,
        prompts,
        params,
        COMPLETION_FIELDS,
        lora=served.lora,
        cache_salt=req.cache_salt,
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
        tokenizer,
        num_top,
        skip_special_tokens=req.skip_special_tokens is not False,
        as_ids=bool(req.return_tokens_as_token_ids),
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
        vllm_prompt_logprobs = None
        if req.prompt_logprobs is not None:
            vllm_prompt_logprobs = prompt_logprobs(
                tokenizer,
                prompt[1],
                final.prompt_logprobs,
                req.prompt_logprobs,
                bool(req.return_tokens_as_token_ids),
            )
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
            choice = {
                "index": prompt_index * n + out.index,
                "text": prompt_text + out.text,
                "logprobs": logprobs,
                "finish_reason": turn.end.value,
                "stop_reason": turn.stop_reason,
            }
            if vllm_prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs
            choices.append(choice)
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
