"""POST /v1/score: the probability of each choice as the continuation of a context (a prompt, or chat
messages with the choices as candidate replies), from one prefill of the context; no text generated."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import (
    ContextLengthError,
    InvalidRequestError,
    LoRANotFoundError,
    ScoreResult,
    summarize_scores,
)
from engine.text import build_score_inputs
from server.cost_sheet import cost_sheet, wants_metrics
from server.errors import (
    APIError,
    context_length_exceeded,
    context_length_message,
    invalid_request,
    lora_not_found,
)
from server.generation import wait_for_disconnect
from server.protocol import ScoreRequest
from server.state import ServerState
from server.tool_calling import template_messages
from server.turn_request import turn_messages


async def create_score(req: ScoreRequest, raw: Request, state: ServerState) -> Response:
    engine = state.require_engine()
    served = state.resolve_model(req.model)
    model = served.name
    tokenizer = engine.tokenizer
    limit = state.config.max_score_choices
    if len(req.choices) > limit:
        raise invalid_request(
            f"Too many choices ({len(req.choices)}); this server scores at most {limit} per request "
            "(--max-score-choices).",
            "choices",
        )
    messages = None
    if req.messages is not None:
        messages = template_messages(turn_messages(req.messages), None)
    try:
        inputs = build_score_inputs(
            tokenizer,
            list(req.choices),
            prompt=req.prompt,
            messages=messages,
            include_end_of_turn=bool(req.include_end_of_turn),
        )
    except InvalidRequestError as e:
        raise invalid_request(str(e), e.param) from None
    num_top = req.top_logprobs or 0
    request_id = f"score-{uuid.uuid4().hex}"
    created = int(time.time())
    scoring = asyncio.ensure_future(
        engine.score(
            request_id,
            inputs.context_token_ids,
            inputs.choice_token_ids,
            num_top,
            prompt=req.prompt if isinstance(req.prompt, str) else None,
            lora=served.lora,
        )
    )
    watcher = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        await asyncio.wait({scoring, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not scoring.done():
            return Response(status_code=499)  # the client left: cancelling aborts the request
        output = scoring.result()
    except InvalidRequestError as e:
        raise _score_error(e) from None
    finally:
        watcher.cancel()
        scoring.cancel()
    result = summarize_scores(output, inputs.choice_texts, req.normalize or "sum", num_top)
    body = _response_body(req, tokenizer, model, request_id, created, result)
    if wants_metrics(req.return_metrics, raw):
        body["metrics"] = cost_sheet([output])
    return JSONResponse(body)


def _score_error(e: InvalidRequestError) -> APIError:
    """The engine's refusal, naming the score request's own field (prompt or choices)."""
    if isinstance(e, ContextLengthError):
        return context_length_exceeded(context_length_message(e), e.param or "choices")
    if isinstance(e, LoRANotFoundError):
        return lora_not_found(e)
    return invalid_request(str(e), e.param)


def _response_body(
    req: ScoreRequest,
    tokenizer: Any,
    model: str,
    request_id: str,
    created: int,
    result: ScoreResult,
) -> dict[str, Any]:
    choices = []
    for c in result.choices:
        choice: dict[str, Any] = {
            "index": c.index,
            "text": c.text,
            "logprob": c.logprob,
            "mean_logprob": c.mean_logprob,
            "probability": c.probability,
            "num_tokens": c.num_tokens,
            "is_greedy": c.is_greedy,
        }
        if req.token_logprobs:
            choice["token_logprobs"] = c.token_logprobs
            choice["tokens"] = tokenizer.token_strings(c.token_ids)
        choices.append(choice)
    body: dict[str, Any] = {
        "object": "score",
        "id": request_id,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if req.top_logprobs is not None:
        top_ids = [token_id for token_id, _ in result.top_logprobs]
        strings = tokenizer.token_strings(top_ids)
        body["top_logprobs"] = [
            {"token": s, "token_id": t, "logprob": lp}
            for s, (t, lp) in zip(strings, result.top_logprobs, strict=True)
        ]
    body["usage"] = {
        "prompt_tokens": result.num_prompt_tokens,
        "total_tokens": result.num_prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": result.num_cached_tokens},
    }
    return body
