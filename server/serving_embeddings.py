"""POST /v1/embeddings: inputs (text, ids, or lists of them) submitted together to the engine, the
model's instruction prompt on texts, truncation, Matryoshka `dimensions`, float or base64 output; and
the check that a route matches the engine's task."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import struct
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine import EmbeddingOutput, EmbeddingPrompts, EngineClient, InvalidRequestError
from server.errors import invalid_request, to_api_error, wrong_task
from server.field_map import EMBEDDING_FIELDS
from server.generation import check_prompts, wait_for_disconnect
from server.protocol import EmbeddingRequest
from server.state import ServerState

if TYPE_CHECKING:
    from engine import Tokenizer


def require_task(engine: EngineClient, task: str) -> None:
    """A 400 when the route needs a different kind of model than the one served."""
    if engine.task != task:
        raise wrong_task(engine.task)


def _inputs(
    req: EmbeddingRequest, tokenizer: Tokenizer, keep: int | None, prompts: EmbeddingPrompts
) -> list[list[int]]:
    """Token ids of each input, at most `keep` of them (texts keep the model's special tokens and
    the instruction prompt put before them); empty inputs are 400s."""
    raw: Any = req.input
    items: list[Any] = [raw] if isinstance(raw, str) else list(raw)
    if not items:
        raise invalid_request("input must not be an empty list", "input")
    if all(isinstance(x, int) for x in items):
        items = [items]
    try:
        prompt = prompts.text_for(req.prompt_name)
    except InvalidRequestError as e:
        raise to_api_error(e, EMBEDDING_FIELDS) from e
    if req.prompt_name is not None and not all(isinstance(item, str) for item in items):
        raise invalid_request(
            "prompt_name applies to text inputs; token-id inputs are embedded as given",
            "prompt_name",
        )
    inputs: list[list[int]] = []
    for i, item in enumerate(items):
        if not item:
            which = "input" if len(items) == 1 else f"input[{i}]"
            raise invalid_request(f"{which} is empty; give a non-empty text or token list", "input")
        if isinstance(item, str):
            inputs.append(_encode(tokenizer, item, keep, prompt))
        else:
            inputs.append(list(item) if keep is None else list(item)[-keep:])
    return inputs


def _encode(tokenizer: Tokenizer, text: str, keep: int | None, prompt: str = "") -> list[int]:
    """The ids of `prompt + text` (sentence-transformers joins them before tokenizing); with `keep`,
    the text's last tokens, still after the prompt and framed by the model's special tokens."""
    ids = list(tokenizer.encode(prompt + text))
    if keep is None or len(ids) <= keep:
        return ids
    content = list(tokenizer.encode(prompt + text, add_special_tokens=False))
    num_special = len(ids) - len(content)
    prefix = next((p for p in range(num_special + 1) if ids[p : p + len(content)] == content), None)
    if prefix is None:
        return ids[-keep:]  # the specials do not simply frame the text: keep the last ids
    # The prompt's tokens stay: those the joined text begins with (a merge across the seam is text).
    prompt_ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if prompt else []
    num_prompt = next(
        (n for n in range(len(prompt_ids), 0, -1) if content[:n] == prompt_ids[:n]), 0
    )
    room = keep - num_special - num_prompt
    if room <= 0:
        held = f"{num_prompt}-token instruction prompt and " if num_prompt else ""
        raise invalid_request(
            f"truncate_prompt_tokens ({keep}) leaves no room for the text beside the model's "
            f"{held}{num_special} special tokens",
            "truncate_prompt_tokens",
        )
    kept = content[:num_prompt] + content[len(content) - room :]
    return ids[:prefix] + kept + ids[prefix + len(content) :]


def _truncation(req: EmbeddingRequest, max_model_len: int) -> int | None:
    """How many tokens to keep per input (None: no truncation)."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep == 0:
        raise invalid_request(
            "truncate_prompt_tokens must be -1 (the model's maximum) or a positive number of tokens",
            "truncate_prompt_tokens",
        )
    if keep > max_model_len:
        raise invalid_request(
            f"truncate_prompt_tokens ({keep}) exceeds the model's maximum input length "
            f"({max_model_len} tokens)",
            "truncate_prompt_tokens",
        )
    return keep


def _check_capacity(engine: EngineClient, inputs: list[list[int]]) -> None:
    """A request the engine's queue could never admit whole is a 400, not a 429 that never clears."""
    if len(inputs) > engine.max_queued_requests:
        raise invalid_request(
            f"this server accepts at most {engine.max_queued_requests} inputs per request "
            "(--max-queued-requests); split the request",
            "input",
        )
    total = sum(len(ids) for ids in inputs)
    max_tokens = engine.max_queued_tokens
    if max_tokens is not None and total > max_tokens:
        raise invalid_request(
            f"the inputs have {total} tokens but this server queues at most "
            f"{max_tokens} (--max-queued-tokens); split the request",
            "input",
        )


class _ClientGone(Exception):
    pass


async def _embed_all(
    engine: EngineClient,
    request_id: str,
    inputs: list[list[int]],
    raw: Request | None,
    lora: str | None = None,
) -> list[EmbeddingOutput]:
    """Submit every input at once (the engine batches them); a disconnect or error cancels the rest."""
    tasks = [
        asyncio.ensure_future(engine.embed(f"{request_id}-{i}", ids, lora=lora))
        for i, ids in enumerate(inputs)
    ]
    gathered = asyncio.gather(*tasks)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw)) if raw is not None else None
    try:
        waiting: set[asyncio.Future[Any]] = {gathered}
        if watcher is not None:
            waiting.add(watcher)
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not gathered.done():
            raise _ClientGone()
        return list(gathered.result())
    finally:
        if watcher is not None:
            watcher.cancel()
        gathered.cancel()
        for task in tasks:
            task.cancel()  # an unfinished engine.embed aborts its engine request when cancelled
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


def _shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """Matryoshka truncation: the first `dimensions` values, L2-normalized again."""
    if dimensions is None:
        return vector
    if dimensions > len(vector):
        raise invalid_request(
            f"dimensions ({dimensions}) exceeds this model's embedding size ({len(vector)})",
            "dimensions",
        )
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def encode_base64(vector: list[float]) -> str:
    """Little-endian float32 bytes in base64, as OpenAI sends (and its SDK decodes) them."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embedding(req: EmbeddingRequest, raw: Request, state: ServerState) -> Response:
    engine = state.require_engine()
    served = state.resolve_model(req.model)
    require_task(engine, "embed")
    tokenizer = engine.tokenizer
    keep = _truncation(req, engine.max_model_len)
    inputs = _inputs(req, tokenizer, keep, engine.embedding_prompts)
    check_prompts(engine, inputs, None, EMBEDDING_FIELDS)
    _check_capacity(engine, inputs)
    request_id = f"embd-{uuid.uuid4().hex}"
    try:
        outputs = await _embed_all(engine, request_id, inputs, raw, served.lora)
    except _ClientGone:
        return Response(status_code=499)
    data = []
    for index, out in enumerate(outputs):
        vector = _shorten(out.embedding, req.dimensions)
        encoded: list[float] | str = (
            encode_base64(vector) if req.encoding_format == "base64" else vector
        )
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    prompt_tokens = sum(out.num_prompt_tokens for out in outputs)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
