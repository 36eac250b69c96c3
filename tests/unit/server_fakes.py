"""A byte-level fake tokenizer and a scripted fake engine for fast server tests (no model, no torch)."""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator
from typing import Any

from engine import (
    CompletionOutput,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)


class FakeTokenizer:
    """One token per byte: token id == byte value."""

    vocab_size = 256
    eos_token_ids = {0}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def token_strings(self, ids: list[int]) -> list[str]:
        return [bytes([i]).decode("latin-1") for i in ids]

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        return [[i] for i in ids]


class FakeEngine:
    """Sample i continues the prompt's last byte with +1+i, +2+i, ... ('abc' -> 'def...' for i=0).

    With `script` set, every sample emits the UTF-8 bytes of that text instead, one token per byte, and
    (like the real detokenizer) a streamed delta's text stays empty while a character is incomplete.
    """

    model_name = "fake-model"
    max_model_len = 64
    task = "generate"
    is_ready = True
    errored = False
    dead_error = None

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.queue_full = False
        self.fail_after: int | None = None  # raise RequestError after this many tokens
        self.step_delay = 0.0
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.script: str | None = None

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.active), "num_free_blocks": 10, "num_total_blocks": 10}

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if self.queue_full:
            raise QueueFullError("queue is full", retry_after=2.5)
        self.requests.append((request_id, prompt_token_ids, params))
        self.active.add(request_id)
        finished = False
        try:
            max_tokens = params.max_tokens if params.max_tokens is not None else 8
            script = list(self.script.encode()) if self.script is not None else None
            if script is not None:
                max_tokens = min(max_tokens, len(script))
            samples = list(range(params.n))
            utf8 = {i: codecs.getincrementaldecoder("utf-8")("replace") for i in samples}
            tokens: dict[int, list[int]] = {i: [] for i in samples}
            prompt_logprobs = None
            if params.prompt_logprobs is not None:
                prompt_logprobs = [None] + [
                    TokenLogprob(t, -1.0, 1, [(t, -1.0)]) for t in prompt_token_ids[1:]
                ]
            for step in range(max_tokens + 1):
                await asyncio.sleep(self.step_delay)
                if self.fail_after is not None and step >= self.fail_after:
                    raise RequestError("injected failure")
                done = step == max_tokens
                outs = []
                for i in samples:
                    if done:
                        new = []
                    elif script is not None:
                        new = [script[step]]
                    else:
                        new = [(prompt_token_ids[-1] + 1 + i + step) % 256]
                    tokens[i] += new
                    if params.output_kind == "final" and not done:
                        continue
                    ids = new if params.output_kind == "delta" else tokens[i]
                    text = self.tokenizer.decode(ids)
                    if script is not None and params.output_kind == "delta":
                        text = utf8[i].decode(bytes(ids), final=done)
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = [
                            TokenLogprob(
                                t, -0.5, 1, [(t, -0.5), ((t + 1) % 256, -1.5)][: params.logprobs]
                            )
                            for t in ids
                        ]
                    outs.append(
                        CompletionOutput(
                            index=i,
                            text=text,
                            token_ids=ids,
                            logprobs=logprobs,
                            finish_reason="length" if done else None,
                            num_output_tokens=len(tokens[i]),
                        )
                    )
                if outs:
                    first = step == 0 or params.output_kind != "delta"
                    yield RequestOutput(
                        request_id,
                        prompt,
                        prompt_token_ids,
                        outs,
                        finished=done,
                        prompt_logprobs=prompt_logprobs if first else None,
                    )
            finished = True
        finally:
            self.active.discard(request_id)
            if not finished:
                self.aborted.append(request_id)
