"""A byte-level fake tokenizer and scripted fake engines for fast server tests (no model, no torch).
They implement engine.EngineClient, the one interface the server uses, and validate requests with the
engine's own checks (engine.core.sampling_params), so the server never sees a fake rule. Only the
tokens are scripted: they go into the engine's own request state and detokenizer, and the engine's
OutputProcessor makes the outputs, so their shape (deltas, finishes, logprobs) cannot drift from the
real engine's. `app_client` serves the app over one of them in process; `replica_sender` stands in for
the Ray ingress's calls to replicas' apps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx

from engine import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingPrompts,
    EngineClient,
    EngineHealth,
    EngineSnapshot,
    InvalidRequestError,
    LoRAError,
    LoRAInfo,
    LoRANotFoundError,
    QueueFullError,
    RequestError,
    RequestOutput,
    SamplingParams,
    StepStats,
    TokenLogprob,
)
from engine.core.request import RequestGroup, Sequence, SequenceStatus
from engine.core.sampling_params import check_input_length, check_token_ids, resolve_max_tokens
from engine.output_processor import OutputProcessor
from engine.text.detokenizer import IncrementalDetokenizer
from server.app import build_app
from server.distributed.asgi_call import ForwardRequest, call_asgi
from server.distributed.replica_broadcast import ReplicaAnswer, Send
from server.state import ServerConfig


def app_client(engine: EngineClient | None, **config: Any) -> httpx.AsyncClient:
    """An HTTP client of the app built with `config` over `engine` (in process, no socket)."""
    app = build_app(ServerConfig(**config), engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def replica_sender(apps: dict[str, Any]) -> Send:
    """A Ray-free stand-in for the ingress's sender: each replica id's app, called in process."""

    async def send(replica_id: str, request: ForwardRequest) -> ReplicaAnswer:
        status, chunks, kind = 0, [], "application/json"
        async for item in call_asgi(apps[replica_id], request):
            if isinstance(item, bytes):
                chunks.append(item)
            else:
                status = item.status
                kind = dict(item.headers).get(b"content-type", b"").decode()
        return ReplicaAnswer(replica_id, status, b"".join(chunks), kind)

    return send


class FakeTokenizer:
    """One token per byte: token id == byte value."""

    vocab_size = 256
    eos_token_ids = {0}
    chat_template: str | None = None  # no tool support: tools are described in the prompt
    added_tokens: dict[str, int] = {}  # noqa: RUF012 - never written

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool) -> None:
        return None  # the detokenizer decodes windows

    def render_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        return self.encode(self.render_chat_template(messages, add_generation_prompt, tools))

    def token_strings(self, ids: list[int]) -> list[str]:
        return [bytes([i]).decode("latin-1") for i in ids]

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        return [[i] for i in ids]


class FakeClientBase:
    """The EngineClient plumbing both fakes share: health, snapshots, listeners, lifecycle."""

    model_name = "fake-model"
    task = "generate"
    max_model_len = 64
    max_queued_requests = 1024
    max_queued_tokens: int | None = None
    embedding_prompts = EmbeddingPrompts()

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.active: set[str] = set()
        self.health_state = EngineHealth("ready")
        self.step_listeners: list[Callable[[StepStats], None]] = []
        self.published: EngineSnapshot | None = None  # what snapshot() returns once set
        self.num_resets = 0  # reset_prefix_cache calls

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def health(self) -> EngineHealth:
        return self.health_state

    def snapshot(self) -> EngineSnapshot:
        if self.published is not None:
            return self.published
        return EngineSnapshot(
            task=self.task,
            num_steps=0,
            time=time.monotonic(),
            num_running=len(self.active),
            num_requests_running=len(self.active),
            num_free_blocks=10,
            num_total_blocks=10,
            num_unfinished_requests=len(self.active),
        )

    async def detailed_snapshot(self) -> EngineSnapshot:
        return self.snapshot()

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        if listener not in self.step_listeners:
            self.step_listeners.append(listener)

    # Requests of the other task are refused, as the real engine refuses them.
    does = ""  # what this fake serves, for the refusal: "generates text", "embeds text"

    def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
        raise InvalidRequestError(f"this fake {self.does}")

    async def embed(self, *args: Any, **kwargs: Any) -> EmbeddingOutput:
        raise InvalidRequestError(f"this fake {self.does}")

    async def score(self, *args: Any, **kwargs: Any) -> RequestOutput:
        raise InvalidRequestError(f"this fake {self.does}")

    async def abort(self, request_id: str) -> None:
        self.active.discard(request_id)

    def fail_all(self, error: BaseException) -> int:
        n = len(self.active)
        self.active.clear()
        return n

    # LoRA adapters: the fakes serve none (and load none).
    def loras(self) -> tuple[LoRAInfo, ...]:
        return ()

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        raise LoRAError(f"this fake loads no LoRA adapters ({path})", "lora_path")

    async def unload_lora(self, name: str) -> None:
        raise LoRANotFoundError(name, ())

    async def reset_prefix_cache(self) -> bool:
        """Refused while a request runs, like the real engine's."""
        self.num_resets += 1
        return not self.active

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


class FakeEngine(FakeClientBase):
    """Sample i continues the prompt's last byte with +1+i, +2+i, ... ('abc' -> 'def...' for i=0).

    With `script` set, every sample emits the UTF-8 bytes of that text instead, one token per byte, and
    (like the real detokenizer) a streamed delta's text stays empty while a character is incomplete.
    """

    does = "generates text"

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []
        self.queue_full = False
        self.fail_after: int | None = None  # raise RequestError after this many tokens
        self.step_delay = 0.0
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.script: str | None = None
        self.script_stop: str | int | None = None  # set: a finished script ends with "stop" for it

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int:
        if params is None:
            raise InvalidRequestError("a generation request needs sampling parameters")
        check_token_ids(prompt_token_ids, self.vocab_size, "prompt")
        params.validate_for_vocab(self.vocab_size)
        return resolve_max_tokens(len(prompt_token_ids), params.max_tokens, self.max_model_len)

    async def score(
        self,
        request_id: str,
        context_token_ids: list[int],
        choices: list[list[int]],
        num_top_logprobs: int = 0,
        prompt: str | None = None,
        lora: str | None = None,
    ) -> RequestOutput:
        """Token t scores -t/100; it is the most likely one when even."""
        outs = [
            CompletionOutput(
                i,
                "",
                list(c),
                [TokenLogprob(t, -t / 100, 1 if t % 2 == 0 else 2) for t in c],
                "length",
            )
            for i, c in enumerate(choices)
        ]
        return RequestOutput(request_id, prompt, list(context_token_ids), outs, True)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self.validate(prompt_token_ids, params)
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
            group = self._group(request_id, prompt, prompt_token_ids, params, max_tokens)
            end, stop_reason = SequenceStatus.FINISHED_LENGTH, None
            if script is not None and self.script_stop is not None and max_tokens == len(script):
                end, stop_reason = SequenceStatus.FINISHED_STOPPED, self.script_stop
            outputs = OutputProcessor()  # the engine's own: outputs cannot drift from the real ones
            for step in range(max_tokens + 1):
                await asyncio.sleep(self.step_delay)
                if self.fail_after is not None and step >= self.fail_after:
                    raise RequestError("injected failure")
                for seq in group.seqs:
                    if seq.status.finished:
                        continue
                    if step == max_tokens:
                        seq.status, seq.stop_reason = end, stop_reason
                        continue
                    token = script[step] if script is not None else prompt_token_ids[-1] + 1
                    if script is None:
                        token = (token + seq.index + step) % 256
                    self._append(seq, token, params)
                output = outputs.make_output(group)
                if output is not None:
                    yield output
                if group.finished:
                    break
            finished = True
        finally:
            self.active.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    def _group(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
    ) -> RequestGroup:
        """The engine's request state for a request: its samples with the real detokenizer; the
        prompt already computed (a prompt logprob of -1 for every token after the first)."""
        ids = list(prompt_token_ids)
        group = RequestGroup(request_id, prompt, ids, params, max_tokens)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] + [
                TokenLogprob(t, -1.0, 1, [(t, -1.0)]) for t in ids[1:]
            ]
        for i in range(params.n):
            seq = Sequence(f"{request_id}/{i}", group, i, list(ids), len(ids))
            seq.num_computed_tokens = len(ids)
            seq.status = SequenceStatus.RUNNING
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,  # type: ignore[arg-type]
                ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
                params.reasoning,
            )
            group.seqs.append(seq)
        return group

    @staticmethod
    def _append(seq: Sequence, token: int, params: SamplingParams) -> None:
        """Append a scripted token as the engine does (a stop string ends the sample)."""
        seq.append_token(token)
        if params.logprobs is not None:
            top = [(token, -0.5), ((token + 1) % 256, -1.5)][: params.logprobs]
            seq.logprobs.append(TokenLogprob(token, -0.5, 1, top))
            seq.cumulative_logprob -= 0.5
        assert seq.detokenizer is not None
        stop = seq.detokenizer.add_tokens([token])
        if stop is not None:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop


class FakeEmbeddingClient(FakeClientBase):
    """The EngineClient parts of an embedding engine: the task, and the engine's input checks."""

    model_name = "fake-embedder"
    task = "embed"
    does = "embeds text"
    max_model_len = 32
    max_queued_requests = 16

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int:
        if params is not None:
            raise InvalidRequestError("an embedding input takes no sampling parameters")
        check_token_ids(prompt_token_ids, self.vocab_size, "input")
        check_input_length(len(prompt_token_ids), self.max_model_len, "input")
        return 0

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], lora: str | None = None
    ) -> EmbeddingOutput:
        self.validate(prompt_token_ids, None)
        return EmbeddingOutput(request_id, [1.0, 0.0], len(prompt_token_ids))
