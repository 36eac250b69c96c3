"""Async front of the engine, implementing engine.core.engine_client.EngineClient: one asyncio task owns
the core and runs its steps on one dedicated thread, back to back while requests run (each step's
outputs reach the loop as it ends); adds and aborts wait as typed PendingWork between steps;
per-request output queues (generation, embeddings, scores); abort on cancel; admission control; health;
the core's published snapshots."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from engine.core.config import EngineConfig, model_id
from engine.core.engine_core import EngineCore
from engine.core.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRANotFoundError,
    QueueFullError,
    RequestError,
    WrongTaskError,
)
from engine.core.lora import LoRAInfo
from engine.core.outputs import EmbeddingOutput, RequestOutput
from engine.core.pending import AbortRequest, AddRequest, PendingWork
from engine.core.sampling_params import SamplingParams
from engine.core.snapshot import EngineHealth, EngineSnapshot
from engine.core.stats import StepStats
from engine.embeddings.embedding_engine import EmbeddingEngine
from engine.embeddings.prompts import EmbeddingPrompts
from engine.faults import EngineDeathFault, fault_injection_enabled
from engine.llm_engine import LLMEngine
from engine.models.loader import find_bundled_embedding_model, resolve_model
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_Output = RequestOutput | EmbeddingOutput
_O = TypeVar("_O", RequestOutput, EmbeddingOutput)
_QueueItem = _Output | BaseException


class AsyncLLMEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.config = core.config
        # Test-only hook, installed here when KVSERVE_FAULT_INJECTION=1 (None otherwise).
        self._add_hook: Callable[[AddRequest], None] | None = (
            EngineDeathFault() if fault_injection_enabled() else None
        )
        self._queues: dict[str, asyncio.Queue[_QueueItem]] = {}
        self._pending = PendingWork()  # adds and aborts applied between steps
        # Calls into the core made between steps (LoRA installs and unloads), with their futures.
        self._between: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._detail_waiters: list[asyncio.Future[EngineSnapshot]] = []
        self._wakeup: asyncio.Event | None = None
        # Set while the loop waits for work (nothing to step, nothing pending): no step runs then.
        self.idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The core steps on one dedicated thread (never the event loop's); _stopping ends its run.
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = False
        self._num_posted = self._num_delivered = 0  # steps' outputs sent to / taken by the loop
        self.dead_error: BaseException | None = None
        self.step_listeners: list[Callable[[StepStats], None]] = []
        # The stats log: at most one line per log_stats_interval, its rates over busy time only.
        self._last_log = time.monotonic()  # when the last line was written
        self._log_window: list[StepStats] = []  # the steps since
        self._window_busy = 0.0  # seconds of the busy periods that ended since the last line
        self._busy_since: float | None = time.monotonic()  # None while idle

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        """Blocking: loads the model. Call it through asyncio.to_thread from async code."""
        return cls(create_engine_core(config))

    # -- the served model's facts -------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def task(self) -> str:
        return self.core.task

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def embedding_prompts(self) -> EmbeddingPrompts:
        core = self.core
        return core.model.prompts if isinstance(core, EmbeddingEngine) else EmbeddingPrompts()

    @property
    def max_queued_requests(self) -> int:
        return self.config.scheduler.max_queued_requests

    @property
    def max_queued_tokens(self) -> int | None:
        return self.config.scheduler.max_queued_tokens

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._stopping = False
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-step")
            self._task = asyncio.create_task(self._run(), name="kvserve-engine")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._stopping = True  # the step thread returns after its current step
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if isinstance(self.core, LLMEngine):
            self.core.close()  # the KV events publisher sends what is queued

    def health(self) -> EngineHealth:
        if self.dead_error is not None:
            return EngineHealth("dead", str(self.dead_error))
        return EngineHealth("ready" if self._task is not None else "starting")

    # -- requests --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None) -> int:
        return self.core.validate(prompt_token_ids, params)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as the engine produces them; closing the iterator aborts it."""
        self._check_alive()
        if self.task != "generate":
            raise WrongTaskError(self.task, "generate")
        self._check_lora(lora)
        item = AddRequest(
            request_id, prompt_token_ids, params, prompt, time.monotonic(), lora=lora,
            cache_salt=cache_salt,
        )  # fmt: skip
        return self._submit(item, RequestOutput)

    async def score(
        self,
        request_id: str,
        context_token_ids: list[int],
        choices: list[list[int]],
        num_top_logprobs: int = 0,
        prompt: str | None = None,
        lora: str | None = None,
    ) -> RequestOutput:
        """Score every choice as the continuation of the context (LLMEngine.add_score_request): the
        finished output once all choices are scored. Cancelling the call aborts the request."""
        self._check_alive()
        if self.task != "generate":
            raise WrongTaskError(self.task, "generate")
        self._check_lora(lora)
        item = AddRequest(
            request_id, context_token_ids, None, prompt, time.monotonic(), choices,
            num_top_logprobs, lora,
        )  # fmt: skip
        stream = self._submit(item, RequestOutput)
        try:
            async for out in stream:
                if out.finished:
                    return out
        finally:
            await stream.aclose()
        raise RequestError("the engine ended the score request without output")

    async def _submit(self, item: AddRequest, kind: type[_O]) -> AsyncGenerator[_O, None]:
        """Queue an add and yield the request's outputs (of `kind`). The front end validated the
        request (validate()) when it planned it; the core's add guards it once more, and its
        refusal comes out of this stream."""
        request_id = item.request_id
        if request_id in self._queues:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if item.params is not None and item.params.structured_outputs is not None:
            # Compiled in a worker thread: this request waits for its grammar, the others step on.
            await asyncio.to_thread(self.core.compile_constraint, item.params.structured_outputs)
        self._admit(item.num_tokens)
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        self._queues[request_id] = queue
        # Arrival was stamped when the add was made: the grammar compile above and the wait for the
        # next step to apply the add count as queue time.
        self._pending.add(item)
        self._wake()
        finished = False
        try:
            while True:
                got = await queue.get()
                if isinstance(got, BaseException):
                    finished = True
                    raise got
                if got.error is not None:
                    finished = True
                    if isinstance(got, RequestOutput) and got.fault is not None:
                        raise got.fault
                    raise RequestError(got.error)
                assert isinstance(got, kind)
                finished = got.finished
                yield got
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._pending.abort(request_id)
                self._wake()

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], lora: str | None = None
    ) -> EmbeddingOutput:
        """The input's pooled, normalized vector; batched with other requests by the engine."""
        self._check_alive()
        if self.task != "embed":
            raise WrongTaskError(self.task, "embed")
        self._check_lora(lora)
        item = AddRequest(request_id, prompt_token_ids, None, None, time.monotonic(), lora=lora)
        async for out in self._submit(item, EmbeddingOutput):
            return out
        raise RequestError("the engine returned no embedding")

    def fail_all(self, error: BaseException) -> int:
        """End every request in flight with `error`: each consumer raises it, and the core aborts
        the requests between two steps (their KV blocks freed)."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(error)
            self._pending.abort(request_id)
        self._wake()
        return len(self._queues)

    async def abort(self, request_id: str) -> None:
        self._pending.abort(request_id)
        self._wake()

    # -- LoRA adapters -----------------------------------------------------------------------------
    def loras(self) -> tuple[LoRAInfo, ...]:
        return self.core.loras()

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Read and check the folder on a worker thread (steps go on), install it between steps."""
        self._check_alive()
        adapter = await asyncio.to_thread(self.core.read_lora, name, path)
        info: LoRAInfo = await self._between_steps(lambda: self.core.install_lora(adapter))
        return info

    async def unload_lora(self, name: str) -> None:
        self._check_alive()
        self._check_lora(name)
        await self._between_steps(lambda: self.core.unload_lora(name))

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block between two steps (KV events: AllBlocksCleared); False,
        and nothing dropped, while running requests hold blocks."""
        self._check_alive()
        done: bool = await self._between_steps(self.core.reset_prefix_cache)
        return done

    def _check_lora(self, name: str | None) -> None:
        """Fail at once for an adapter that is not served (the core checks again when adding)."""
        if name is not None:
            served = tuple(info.name for info in self.core.loras())
            if name not in served:
                raise LoRANotFoundError(name, served)

    async def _between_steps(self, call: Callable[[], Any]) -> Any:
        """Run `call` on the core between two steps (on the event loop) and return its result."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._between.append((call, future))
        self._wake()
        return await future

    def _admit(self, num_prompt_tokens: int) -> None:
        """O(1): the last snapshot's counts plus the running totals of the adds not applied yet."""
        sc = self.config.scheduler
        snap = self.core.snapshot
        waiting = snap.num_requests_waiting + self._pending.num_adds
        if waiting == 0:
            return  # an empty queue takes any request, so a prompt over the token cap still runs
        # Requests that the next step can start right away (free running slots) are not queued.
        free_slots = max(0, sc.max_num_seqs - snap.num_running)
        queued = waiting - free_slots
        if queued >= sc.max_queued_requests:
            raise QueueFullError(
                f"the server is at capacity ({queued} requests waiting); retry shortly",
                retry_after=self._retry_after(),
            )
        waiting_tokens = snap.num_waiting_tokens + self._pending.num_add_tokens
        if (
            sc.max_queued_tokens is not None
            and waiting_tokens + num_prompt_tokens > sc.max_queued_tokens
        ):
            raise QueueFullError(
                f"the server is at capacity ({waiting_tokens} prompt tokens waiting); retry shortly",
                retry_after=self._retry_after(),
            )

    def _retry_after(self) -> float:
        last = self.core.last_step
        return 1.0 if last is None else max(1.0, min(30.0, last.duration * 10))

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead_error}")
        if self._task is None:
            raise EngineDeadError("the engine is not running")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    # -- the loop ----------------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        """Hand the queued adds and aborts to the core (between steps, on the event loop), then
        publish a fresh snapshot so admission and readers see them before the next step ends."""
        calls, self._between = self._between, []
        for call, future in calls:
            try:
                result = call()
            except Exception as e:  # LoRAError / LoRANotFoundError: the caller's to raise
                if not future.done():
                    future.set_exception(e)
            else:
                if not future.done():
                    future.set_result(result)
        items = self._pending.take()
        if calls:
            self.core.publish()
        for item in items:
            if isinstance(item, AbortRequest):
                self.core.abort_request(item.request_id)
            else:
                self._add_to_core(item)
        if items:
            self.core.publish()

    def _add_to_core(self, item: AddRequest) -> None:
        queue = self._queues.get(item.request_id)
        if queue is None:
            return  # the client left before the request reached the engine
        if self._add_hook is not None:
            self._add_hook(item)
        try:
            if item.choices is not None:
                self.core.add_score_request(
                    item.request_id,
                    item.prompt_token_ids,
                    item.choices,
                    item.num_top_logprobs,
                    item.prompt,
                    arrival_time=item.arrival_time,
                    lora=item.lora,
                )
            else:
                self.core.add_request(
                    item.request_id,
                    item.prompt_token_ids,
                    item.params,
                    item.prompt,
                    arrival_time=item.arrival_time,
                    lora=item.lora,
                    cache_salt=item.cache_salt,
                )
        except InvalidRequestError as e:
            queue.put_nowait(e)
        except Exception as e:  # a bug while adding one request fails that request only
            logger.exception("adding request %s failed", item.request_id)
            queue.put_nowait(RequestError(f"the request could not be started: {e}"))

    async def _run(self) -> None:
        assert self._wakeup is not None and self._executor is not None
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if self._detail_waiters:
                    self._publish_detail()
                if not self.core.has_unfinished_requests():
                    if not self._pending and not self._between:
                        self._wakeup.clear()
                        self.idle.set()
                        await self._wait_idle()
                        self.idle.clear()
                    continue
                await loop.run_in_executor(self._executor, self._step_while_running, loop)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the loop itself died: fail everyone instead of hanging
            logger.exception("engine loop died")
            self.dead_error = e
            for queue in self._queues.values():
                queue.put_nowait(
                    EngineDeadError(f"the engine stopped after an internal error: {e}")
                )
            for waiter in self._detail_waiters:
                if not waiter.done():
                    waiter.set_exception(EngineDeadError(f"the engine stopped: {e}"))

    def _step_while_running(self, loop: asyncio.AbstractEventLoop) -> None:
        """In the step thread: step back to back while requests run and the loop has nothing to
        hand the core (adds, aborts, a detailed snapshot, shutdown); each step's outputs go to the
        loop as it ends. So a decode step follows the last without a round trip through the event
        loop, and the loop streams one step's tokens while the next step runs. When the loop has
        not taken the previous step's outputs yet, it is behind: return and let it catch up."""
        last = self.core.last_step
        while True:
            outputs = self.core.step()
            stats = self.core.last_step
            fresh = stats if stats is not last else None  # an empty step leaves the old stats
            last = stats
            try:
                loop.call_soon_threadsafe(self._deliver, outputs, fresh)
            except RuntimeError:  # the loop closed under us (shutdown)
                return
            self._num_posted += 1
            if (
                self._stopping
                or self._pending
                or self._between
                or self._detail_waiters
                or self._num_posted - self._num_delivered > 1
                or not self.core.has_unfinished_requests()
            ):
                return

    def _deliver(self, outputs: Sequence[_Output], stats: StepStats | None) -> None:
        """On the loop: one step's outputs to their request queues, its stats to the listeners."""
        self._num_delivered += 1
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if stats is not None:
            self._after_step(stats)

    def _after_step(self, stats: StepStats) -> None:
        for listener in self.step_listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("step listener failed")
        self._log_window.append(stats)
        if time.monotonic() - self._last_log >= self.config.log_stats_interval:
            self._flush_log_window()

    async def _wait_idle(self) -> None:
        """Wait for work. The busy period's last stats line is written once log_stats_interval has
        passed since the line before (now, or while idle), so back-to-back short requests (one
        client at a time) share a line instead of writing one each; then silence."""
        assert self._wakeup is not None
        now = time.monotonic()
        if self._busy_since is not None:
            self._window_busy += now - self._busy_since
            self._busy_since = None
        if self._log_window:
            wait = self.config.log_stats_interval - (now - self._last_log)
            try:
                if wait > 0:
                    await asyncio.wait_for(self._wakeup.wait(), wait)
            except asyncio.TimeoutError:
                pass
            if not self._wakeup.is_set():
                self._flush_log_window()
        await self._wakeup.wait()
        self._busy_since = time.monotonic()
        if not self._log_window:  # a new busy period: its first line one interval into it
            self._last_log = self._busy_since

    def _flush_log_window(self) -> None:
        now = time.monotonic()
        busy = self._window_busy
        if self._busy_since is not None:
            busy += now - self._busy_since
            self._busy_since = now
        if self._log_window and self.config.log_stats_interval > 0:
            self._log_stats(max(busy, 1e-6))
        self._last_log = now
        self._log_window = []
        self._window_busy = 0.0

    def _log_stats(self, elapsed: float) -> None:
        w = self._log_window
        prompt = sum(s.num_new_prompt_tokens for s in w)  # what kvserve_prompt_tokens counts
        gen = sum(s.num_generation_tokens for s in w)
        queries = sum(s.prefix_cache_queries for s in w)
        hits = sum(s.prefix_cache_hits for s in w)
        last = w[-1]
        logger.info(
            "running=%d waiting=%d kv_usage=%.1f%% prompt=%.1f tok/s generation=%.1f tok/s "
            "prefix_cache_hit_rate=%.1f%% preemptions=%d",
            last.num_running,
            last.num_waiting,
            100 * last.kv_cache_usage,
            prompt / elapsed,
            gen / elapsed,
            100 * hits / queries if queries else 0.0,
            sum(s.num_preemptions for s in w),
        )
        drafts = sum(s.spec_num_drafts for s in w)
        if drafts:  # vLLM's SpecDecoding metrics line
            proposed = sum(s.spec_num_draft_tokens for s in w)
            accepted = sum(s.spec_num_accepted_tokens for s in w)
            logger.info(
                "speculative decoding: drafts=%d draft_tokens=%d accepted_tokens=%d "
                "acceptance_rate=%.1f%% mean_acceptance_length=%.2f",
                drafts,
                proposed,
                accepted,
                100 * accepted / proposed,
                1 + accepted / drafts,  # the bonus token included, as vLLM counts it
            )

    # -- snapshots -------------------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """The snapshot the core published last (after a step, or after adds and aborts), plus the
        requests this front holds; never reads live scheduler state."""
        return dataclasses.replace(self.core.snapshot, num_unfinished_requests=len(self._queues))

    async def detailed_snapshot(self) -> EngineSnapshot:
        """A snapshot with the per-block detail, built by the loop between two steps."""
        self._check_alive()
        waiter: asyncio.Future[EngineSnapshot] = asyncio.get_running_loop().create_future()
        self._detail_waiters.append(waiter)
        self._wake()
        return dataclasses.replace(await waiter, num_unfinished_requests=len(self._queues))

    def _publish_detail(self) -> None:
        snapshot = self.core.publish(detail=True)
        waiters, self._detail_waiters = self._detail_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(snapshot)

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        if listener not in self.step_listeners:
            self.step_listeners.append(listener)


def create_engine_core(config: EngineConfig) -> EngineCore:
    """Load the model and build the core its task needs (given, or told by the model's files)."""
    mc = config.model
    if mc.model is None and mc.task == "embed":
        model_dir = find_bundled_embedding_model()
    else:
        model_dir = resolve_model(mc.model, mc.cache_dir)
    name = model_id(config)
    task = mc.task if mc.task != "auto" else detect_task(model_dir)
    if task == "embed":
        return EmbeddingEngine(config, model_dir, name)
    return LLMEngine(config, model_dir, name)


def detect_task(model_dir: Path) -> str:
    """Encoders and sentence-transformers folders embed; everything else generates."""
    import json

    from engine.embeddings.embedding_model import ENCODER_MODEL_TYPES

    if (model_dir / "modules.json").is_file():
        return "embed"
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return "generate"
    return "embed" if model_type in ENCODER_MODEL_TYPES else "generate"
