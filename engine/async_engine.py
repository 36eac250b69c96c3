"""Async front of the engine: one asyncio task owns the core and runs each step in a worker thread;
per-request output queues; abort on cancel; admission control; the engine's health."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from engine.core.config import EngineConfig
from engine.core.outputs import (
    EmbeddingOutput,
    EngineDeadError,
    QueueFullError,
    RequestError,
    RequestOutput,
)
from engine.core.sampling_params import SamplingParams
from engine.core.stats import StepStats
from engine.embeddings.embedding_engine import EmbeddingEngine
from engine.faults import ENGINE_DEATH, fault_injection_enabled, wants_fault
from engine.llm_engine import LLMEngine, served_model_name
from engine.models.loader import find_bundled_embedding_model, resolve_model

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    def __init__(self, core: LLMEngine | EmbeddingEngine) -> None:
        self.core = core
        self.config = core.config
        self.tokenizer = core.tokenizer
        self.model_name = core.model_name
        self.max_model_len = core.max_model_len
        self.task: str = core.task
        # A request batch (a list of prompts) larger than this can never be admitted.
        self.max_queued_requests = core.config.scheduler.max_queued_requests
        self._fault_injection = fault_injection_enabled()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._pending: list[tuple[Any, ...]] = []  # adds and aborts applied between steps
        self._pending_tokens = 0
        self._waiting_snapshot = (0, 0)  # (requests, prompt tokens) waiting after the last step
        self._num_running_seqs = 0  # sequences running after the last step
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.dead_error: BaseException | None = None
        self.step_listeners: list[Callable[[StepStats], None]] = []
        self._last_log = time.monotonic()
        self._log_window: list[StepStats] = []

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        """Blocking: loads the model. Call it through asyncio.to_thread from async code."""
        return cls(create_engine_core(config))

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="kvserve-engine")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    @property
    def is_ready(self) -> bool:
        return self._task is not None and self.dead_error is None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    # -- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them; closing the iterator aborts it."""
        self._check_alive()
        if self.task != "generate":
            raise ValueError(
                "this server runs an embedding model: use /v1/embeddings, not text generation"
            )
        async for out in self._submit(request_id, prompt_token_ids, params, prompt):
            yield out

    async def _submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        prompt: str | None,
    ) -> AsyncIterator[Any]:
        self.core.validate(prompt_token_ids, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._admit(len(prompt_token_ids))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        # Arrival is now: time spent here until the next step applies the add counts as queue time.
        self._pending.append(
            ("add", request_id, prompt_token_ids, params, prompt, time.monotonic())
        )
        self._pending_tokens += len(prompt_token_ids)
        self._wake()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestError(item.error)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._pending.append(("abort", request_id))
                self._wake()

    async def embed(self, request_id: str, prompt_token_ids: list[int]) -> EmbeddingOutput:
        """The input's pooled, normalized vector; batched with other requests by the engine."""
        self._check_alive()
        if self.task != "embed":
            raise ValueError(
                "this server runs a generative model: /v1/embeddings needs an embedding model (--task embed)"
            )
        async for out in self._submit(request_id, prompt_token_ids, None, None):
            return out
        raise RequestError("the engine returned no embedding")

    async def abort(self, request_id: str) -> None:
        self._pending.append(("abort", request_id))
        self._wake()

    def _admit(self, num_prompt_tokens: int) -> None:
        sc = self.config.scheduler
        pending_adds = sum(1 for p in self._pending if p[0] == "add")
        waiting, waiting_tokens = self._waiting_snapshot
        if waiting + pending_adds == 0:
            return  # an empty queue takes any request, so a prompt over the token cap still runs
        # Requests that the next step can start right away (free running slots) are not queued.
        free_slots = max(0, sc.max_num_seqs - self._num_running_seqs)
        queued = waiting + pending_adds - free_slots
        if queued >= sc.max_queued_requests:
            raise QueueFullError(
                f"the server is at capacity ({queued} requests waiting); retry shortly",
                retry_after=self._retry_after(),
            )
        if (
            sc.max_queued_tokens is not None
            and waiting_tokens + self._pending_tokens + num_prompt_tokens > sc.max_queued_tokens
        ):
            raise QueueFullError(
                f"the server is at capacity ({waiting_tokens + self._pending_tokens} prompt tokens waiting); retry shortly",
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
        pending, self._pending = self._pending, []
        self._pending_tokens = 0
        waiting, waiting_tokens = self._waiting_snapshot
        for item in pending:
            if item[0] == "abort":
                self.core.abort_request(item[1])
                continue
            _, request_id, prompt_token_ids, params, prompt, arrival_time = item
            queue = self._queues.get(request_id)
            if queue is None:
                continue  # the client left before the request reached the engine
            if self._fault_injection and wants_fault(prompt, ENGINE_DEATH):
                raise RuntimeError("injected engine failure (KVSERVE_FAULT_INJECTION)")
            try:
                self.core.add_request(
                    request_id, prompt_token_ids, params, prompt, arrival_time=arrival_time
                )
            except ValueError as e:
                queue.put_nowait(e)
                continue
            except Exception as e:  # a bug while adding one request fails that request only
                logger.exception("adding request %s failed", request_id)
                queue.put_nowait(RequestError(f"the request could not be started: {e}"))
                continue
            # Counted as waiting until the next step's snapshot, so admission stays strict meanwhile.
            waiting += 1
            waiting_tokens += len(prompt_token_ids)
        self._waiting_snapshot = (waiting, waiting_tokens)

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while True:
                self._apply_pending()
                if not self.core.has_unfinished_requests():
                    self._waiting_snapshot = (0, 0)
                    self._num_running_seqs = 0
                    if not self._pending:
                        self._flush_log_window()  # the busy period's last stats line, then silence
                        self._wakeup.clear()
                        await self._wakeup.wait()
                        self._last_log = time.monotonic()  # rates cover busy time, not the idle gap
                    continue
                outputs: list[Any] = await asyncio.to_thread(self.core.step)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                self._waiting_snapshot = (
                    self.core.num_waiting_requests,
                    self.core.num_waiting_tokens,
                )
                self._num_running_seqs = self.core.num_running_seqs
                self._after_step()
                await asyncio.sleep(0)  # let request handlers run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the loop itself died: fail everyone instead of hanging
            logger.exception("engine loop died")
            self.dead_error = e
            for queue in self._queues.values():
                queue.put_nowait(
                    EngineDeadError(f"the engine stopped after an internal error: {e}")
                )

    def _after_step(self) -> None:
        stats = self.core.last_step
        if stats is None:
            return
        for listener in self.step_listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("step listener failed")
        self._log_window.append(stats)
        if time.monotonic() - self._last_log >= self.config.log_stats_interval:
            self._flush_log_window()

    def _flush_log_window(self) -> None:
        now = time.monotonic()
        if self._log_window and self.config.log_stats_interval > 0:
            self._log_stats(max(now - self._last_log, 1e-6))
        self._last_log = now
        self._log_window = []

    def _log_stats(self, elapsed: float) -> None:
        w = self._log_window
        prompt = sum(s.num_prefill_tokens for s in w)
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

    # -- introspection -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        t = self.core.totals
        stats: dict[str, Any] = {
            "task": self.task,
            "num_unfinished_requests": len(self._queues),
            "num_prompt_tokens": t.num_prompt_tokens,
            "num_generation_tokens": t.num_generation_tokens,
            "num_preemptions": t.num_preemptions,
            "prefix_cache_queries": t.prefix_cache_queries,
            "prefix_cache_hits": t.prefix_cache_hits,
        }
        if isinstance(self.core, EmbeddingEngine):
            stats.update(
                num_running=0,
                num_waiting=len(self.core.waiting),
                num_requests_running=0,
                num_requests_waiting=len(self.core.waiting),
                kv_cache_usage=0.0,
                num_free_blocks=0,
                num_total_blocks=0,
            )
        else:
            kv = self.core.kv
            # Sequences (num_running/num_waiting) vs requests: n > 1 samples are one request.
            running = {s.group.request_id for s in list(self.core.scheduler.running)}
            waiting = {s.group.request_id for s in list(self.core.scheduler.waiting)} - running
            stats.update(
                num_running=len(self.core.scheduler.running),
                num_waiting=len(self.core.scheduler.waiting),
                num_requests_running=len(running),
                num_requests_waiting=len(waiting),
                kv_cache_usage=kv.usage,
                num_free_blocks=kv.num_free_blocks,
                num_total_blocks=kv.num_blocks,
            )
        return stats


def create_engine_core(config: EngineConfig) -> LLMEngine | EmbeddingEngine:
    """Load the model and build the core its task needs (given, or told by the model's files)."""
    mc = config.model
    if mc.model is None and mc.task == "embed":
        model_dir = find_bundled_embedding_model()
        name = "all-MiniLM-L6-v2"
    else:
        model_dir = resolve_model(mc.model, mc.cache_dir)
        name = served_model_name(mc.model, model_dir)
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
